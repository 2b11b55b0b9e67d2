"""[model]: which model, as a preset or a Hugging Face directory, with field overrides; and
the rules of its shape (heads, RoPE, mixture-of-experts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.config.rules import choice, not_quantized, positive, suggest
from fivefold.errors import ConfigError
from fivefold.models.presets import PARAMETER_KEYS, PRESETS, ModelConfig, preset


@dataclass
class ModelSection:
    preset: str = "tiny-bpe"
    hf_path: str = ""  # a local Hugging Face checkpoint directory (config.json + safetensors)
    init_from: str = ""  # a fivefold checkpoint whose weights start the run (fresh optimizer)
    # Any ModelConfig field may be overridden here (hidden_size, num_layers, ...).
    overrides: dict = field(default_factory=dict)

    def resolve(self) -> ModelConfig:
        """The model shape: the preset (or the HF config.json) with the overrides applied."""
        if self.hf_path:
            from fivefold.models.hf_config import model_config_from_hf

            base = model_config_from_hf(Path(self.hf_path) / "config.json")
        else:
            base = preset(self.preset)
        return base.replace(**self.overrides) if self.overrides else base


def check_model(cfg) -> ModelConfig:
    """The model's own keys (and the few that depend on the layout); returns the shape."""
    m, par = cfg.model, cfg.parallel
    if not m.hf_path and m.preset.lower() not in PRESETS:
        raise ConfigError(f"model.preset = '{m.preset}' is unknown{suggest(m.preset, PRESETS)};"
                          f" known presets: {', '.join(PRESETS)}")
    not_quantized("model.hf_path", m.hf_path)
    if m.hf_path and not (Path(m.hf_path) / "config.json").is_file():
        raise ConfigError(f"model.hf_path = '{m.hf_path}' has no config.json; give a Hugging "
                          f"Face checkpoint directory")
    if m.hf_path:  # absolute in the run's metadata: its checkpoints load from anywhere
        m.hf_path = str(Path(m.hf_path).resolve())
    mc = m.resolve()
    if m.init_from:
        check_init_from(m, mc)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_seq_len"):
        positive(f"model.{name}", getattr(mc, name))
    if mc.num_heads % mc.num_kv_heads:
        raise ConfigError(f"model.num_heads = {mc.num_heads} is not a multiple of "
                          f"model.num_kv_heads = {mc.num_kv_heads}; pick kv heads dividing it")
    if mc.head_dim is None and mc.hidden_size % mc.num_heads:
        raise ConfigError(f"model.hidden_size = {mc.hidden_size} is not divisible by "
                          f"model.num_heads = {mc.num_heads}; set model.head_dim or change them")
    if mc.dim_per_head % 2:
        raise ConfigError(f"head dimension {mc.dim_per_head} is odd; RoPE needs an even one")
    positive("model.rope_theta", mc.rope_theta)
    positive("model.norm_eps", mc.norm_eps, allow_zero=True)
    positive("model.init_std", mc.init_std, allow_zero=True)
    if mc.rope_scaling is not None:
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if k not in mc.rope_scaling]
        if missing:
            raise ConfigError(f"model.rope_scaling lacks {', '.join(missing)}; give all four "
                              f"keys of Llama-3.1 scaling, or leave rope_scaling unset")
    positive("model.num_experts", mc.num_experts, allow_zero=True)
    if mc.num_experts:
        check_moe(mc, par)
    if mc.qk_norm and mc.qk_norm_whole and par.tp > 1:
        raise ConfigError(f"model.qk_norm_whole = true with parallel.tp = {par.tp}: a norm over "
                          f"all heads' q and k spans the tp ranks; use tp = 1")
    choice("model.mlp", mc.mlp, ("swiglu", "gelu"))
    choice("model.norm", mc.norm, ("rmsnorm", "layernorm"))
    return mc


def init_step(path: str) -> Path:
    """The step directory model.init_from names (a checkpoint root: the step its `latest`
    pointer names now), absolute."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model.init_from = '{path}' is not a directory; give a fivefold "
                          f"checkpoint (a step_* directory or a checkpoint.dir)")
    if (p / "latest").is_file():
        p = p / (p / "latest").read_text().strip()
    if not (p / "meta.json").is_file():
        raise ConfigError(f"model.init_from = '{path}' holds no fivefold checkpoint (no "
                          f"meta.json in {p}); give a step_* directory or a checkpoint.dir, or "
                          f"model.hf_path for a Hugging Face directory")
    return p.resolve()


def check_init_from(m: ModelSection, mc: ModelConfig) -> None:
    """model.init_from: a float fivefold checkpoint of this model's shape (the shape checks
    of resume, before anything is written); stored as the absolute step directory, so a
    later run of the base does not change what this run started from."""
    not_quantized("model.init_from", m.init_from)
    if m.hf_path:
        raise ConfigError("model.init_from and model.hf_path both name starting weights; "
                          "keep one")
    step = init_step(m.init_from)
    try:
        saved = json.loads((step / "meta.json").read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"model.init_from: {step / 'meta.json'} is garbled; give another "
                          f"step_* directory") from None
    for key in PARAMETER_KEYS:
        if key in saved and saved[key] != getattr(mc, key):
            raise ConfigError(f"model.init_from = '{m.init_from}' holds a model with "
                              f"model.{key} = {saved[key]}, but the config asks for "
                              f"{getattr(mc, key)}; use the checkpoint's model settings "
                              f"(model.preset and overrides)")
    m.init_from = str(step)


def check_moe(mc: ModelConfig, par) -> None:
    """Mixture-of-experts keys (models/moe.py)."""
    e, k = mc.num_experts, mc.experts_top_k
    if not 1 <= k <= e:
        raise ConfigError(f"model.experts_top_k = {k} must lie in [1, model.num_experts = {e}]")
    positive("model.moe_intermediate_size", mc.moe_intermediate_size)
    positive("model.moe_layer_freq", mc.moe_layer_freq)
    positive("model.moe_first_dense", mc.moe_first_dense, allow_zero=True)
    if mc.num_moe_layers == 0:
        raise ConfigError(f"model.moe_first_dense = {mc.moe_first_dense} and moe_layer_freq = "
                          f"{mc.moe_layer_freq} leave no MoE layer among {mc.num_layers}; "
                          f"lower them or set model.num_experts = 0")
    choice("model.router_score", mc.router_score, ("softmax", "sigmoid"))
    groups = mc.router_groups
    if groups < 1 or e % groups:
        raise ConfigError(f"model.router_groups = {groups} must divide model.num_experts = {e}")
    if not 1 <= mc.router_topk_groups <= groups:
        raise ConfigError(f"model.router_topk_groups = {mc.router_topk_groups} must lie in "
                          f"[1, model.router_groups = {groups}]")
    if k > mc.router_topk_groups * (e // groups):
        raise ConfigError(f"model.experts_top_k = {k} exceeds the experts of the "
                          f"{mc.router_topk_groups} kept groups; raise router_topk_groups")
    positive("model.routed_scaling_factor", mc.routed_scaling_factor)
    for name in ("shared_expert_intermediate_size", "capacity_factor", "aux_loss_coeff",
                 "z_loss_coeff", "expert_bias_rate"):
        positive(f"model.{name}", getattr(mc, name), allow_zero=True)
    cut = [n for n in ("aux_loss_coeff", "z_loss_coeff", "capacity_factor") if getattr(mc, n)]
    if par.cp > 1 and cut:
        raise ConfigError(f"model.{cut[0]} = {getattr(mc, cut[0])} with parallel.cp = {par.cp}: "
                          f"the per-sequence balance losses and capacity need whole sequences; "
                          f"set it to 0 (the expert bias balances without it) or cp = 1")
    if par.sp:
        raise ConfigError("parallel.sp = true with a mixture-of-experts model: sequence "
                          "parallelism would cut the sequences the balance loss is taken over; "
                          "set parallel.sp = false (tp shards the attention, experts replicate)")
