"""Where a plan's inputs come from: a preset, a Hugging Face config.json, or a training TOML.

No torch and no engine module is imported: a config.json is read as plain JSON.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from fivefold import config as fconfig
from fivefold.config.parallel import offload_value
from fivefold.errors import ConfigError
from fivefold.models.hf_config import check_shape
from fivefold.models.presets import MODEL_FIELDS, ModelConfig, preset
from fivefold.plan.grad_sync import resolve_grad_sync
from fivefold.plan.hardware import get_hardware, hardware_for_device_name, runs_on_host
from fivefold.plan.layout import Layout, Workload, layout_offload, tier

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - Python 3.10
    pass


def model_from_hf_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json (Llama, Mistral, Qwen2, Mixtral, GPT-2
    style). Unknown keys are ignored; missing essentials are an error naming the key."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; give a config.json or its directory")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None

    def get(*keys, default=None):
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        if default is None:
            raise ConfigError(f"{path} has none of {', '.join(keys)}; is it a decoder config?")
        return default

    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} does not hold a JSON object; it is not a model config")

    def get_number(*keys, default=None, kind=int):
        value = get(*keys, default=default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            kind is float or float(value).is_integer())
        if not ok or not math.isfinite(value) or value <= 0:
            what = "a positive whole number" if kind is int else "a positive number"
            raise ConfigError(f"{path}: {keys[0]} = {json.dumps(value)} is not {what}; fix "
                              f"config.json")
        return kind(value)

    from fivefold.models.hf_config import SUPPORTED, model_config_from_hf

    if (cfg.get("architectures") or [None])[0] in SUPPORTED:
        try:  # the engine's own reading: exact layer kinds, shared experts, q/k norms
            return model_config_from_hf(path)
        except ConfigError:
            pass  # a setting the engine refuses still has a shape worth planning

    gpt_style = cfg.get("model_type") in ("gpt2", "gpt_neox", "gptj", "opt") or "n_embd" in cfg
    hidden = get_number("hidden_size", "n_embd", "d_model")
    heads = get_number("num_attention_heads", "n_head")
    has_experts = any(cfg.get(k) for k in ("num_local_experts", "num_experts",
                                           "n_routed_experts"))
    experts = get_number("num_local_experts", "num_experts", "n_routed_experts",
                         default=1) if has_experts else 0
    head_dim = cfg.get("head_dim")
    model = ModelConfig(
        name=str(cfg.get("_name_or_path") or path.parent.name or "hf-model"),
        vocab_size=get_number("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get_number("intermediate_size", "n_inner", "ffn_dim",
                                     default=4 * hidden),
        num_layers=get_number("num_hidden_layers", "n_layer", "num_layers"),
        num_heads=heads,
        num_kv_heads=get_number("num_key_value_heads", default=heads),
        head_dim=get_number("head_dim") if head_dim is not None else None,
        max_seq_len=get_number("max_position_embeddings", "n_positions", "n_ctx",
                               default=2048),
        rope_theta=get_number("rope_theta", default=10000.0, kind=float),
        rope_scaling=cfg.get("rope_scaling"),
        norm_eps=get_number("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps",
                            default=1e-5, kind=float),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gpt_style)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2") or gpt_style),
        mlp="gelu" if gpt_style else "swiglu",
        norm="layernorm" if gpt_style else "rmsnorm",
        num_experts=experts,
        experts_top_k=get_number("num_experts_per_tok", "top_k", default=2) if experts else 0,
        moe_intermediate_size=get_number("moe_intermediate_size", "intermediate_size",
                                         default=4 * hidden) if experts else 0,
        **(_moe_shape(cfg) if experts else {}),
    )
    check_shape(model, path)
    return model


def _moe_shape(cfg: dict) -> dict:
    """Which layers are MoE, shared experts and routing of other MoE families (DeepSeek-V2/V3's
    first_k_dense_replace, n_shared_experts, sigmoid scores and expert groups; Qwen's
    decoder_sparse_step and leading mlp_only_layers)."""
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    dense = sorted(cfg.get("mlp_only_layers") or [])
    first = int(cfg.get("first_k_dense_replace") or 0) or (
        len(dense) if dense == list(range(len(dense))) else 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) or int(
        cfg.get("n_shared_experts") or 0) * inter
    groups = int(cfg.get("n_group") or 1)
    return dict(moe_first_dense=first,
                moe_layer_freq=int(cfg.get("decoder_sparse_step") or 1)
                if isinstance(cfg.get("decoder_sparse_step", 1), int) else 1,
                shared_expert_intermediate_size=shared,
                router_score="sigmoid" if cfg.get("scoring_func") == "sigmoid" else "softmax",
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                router_groups=groups, router_topk_groups=int(cfg.get("topk_group") or groups),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))


def _apply_model_overrides(model: ModelConfig, overrides: dict) -> ModelConfig:
    unknown = [k for k in overrides if k not in MODEL_FIELDS]
    if unknown:
        raise ConfigError(f"unknown model field '{unknown[0]}'; fields: {', '.join(MODEL_FIELDS)}")
    return model.replace(**overrides) if overrides else model


def resolve_model(spec: str) -> ModelConfig:
    """A preset name, a config.json (or its directory), or a training TOML's [model]."""
    p = Path(spec)
    if p.suffix == ".toml":
        cfg = read_training_config(p)
        return training_model(cfg)
    if p.suffix == ".json" or p.is_dir():
        return model_from_hf_config(p)
    try:
        return preset(spec)
    except KeyError as e:
        raise ConfigError(str(e).strip("\"'") + "; or give a config.json / .toml path") from None


def read_training_config(path: str | Path, overrides: list[str] | None = None) -> fconfig.Config:
    """Parse a training TOML with its `--section.key value` overrides. Only the type checks run
    here, not the full launch validation: a plan may precede the data files and may use
    dimensions the engine does not offer yet (the planner checks the layout itself)."""
    return fconfig.read(path, overrides)


def training_model(cfg: fconfig.Config) -> ModelConfig:
    m = cfg.model
    if m.hf_path:
        return _apply_model_overrides(model_from_hf_config(m.hf_path), m.overrides)
    try:
        base = preset(m.preset)
    except KeyError as e:
        raise ConfigError(f"model.preset: {str(e).strip(chr(34) + chr(39))}") from None
    return _apply_model_overrides(base, m.overrides)


def training_plan_inputs(cfg: fconfig.Config, hw=None, assume=None,
                         **workload_options) -> tuple[Workload, Layout]:
    """The workload and layout a training config describes ('auto' precision plans as bf16,
    what it resolves to on a GPU; parallel.mbs = 0 plans the micro-batch the engine picks;
    parallel.grad_sync = auto plans what plan/grad_sync.py picks on `hw`, by default the
    catalog's default GPU, as the engine does on a CPU)."""
    fconfig.resolve_mbs(cfg)
    par, tr = cfg.parallel, cfg.train
    precision = "bf16" if tr.precision == "auto" else tr.precision
    workload_options.setdefault("grad_sync", getattr(par, "grad_sync", "step"))
    # the config's optimizer and the [optim] keys its plan depends on (--optimizer overrides)
    workload_options.setdefault("optimizer", getattr(tr, "optimizer", "adamw"))
    oc = getattr(cfg, "optim", None)
    if oc is not None:
        workload_options.setdefault("muon_exclude", oc.muon_exclude)
        workload_options.setdefault("adafactor_factored", oc.adafactor_factored)
    workload_options.setdefault("memory_budget_gib", getattr(tr, "memory_budget_gib", 0.0))
    workload_options.setdefault("fp8_recipe", getattr(tr, "fp8_recipe", "blockwise"))
    workload_options.setdefault("fp8_allgather", getattr(par, "fp8_allgather", False))
    workload_options.setdefault("fp8_scaling", getattr(tr, "fp8_scaling", "dynamic"))
    workload_options.setdefault("fp8_keep_out", getattr(tr, "fp8_keep_out", ""))
    if hw is not None and not runs_on_host(hw):  # a GPU's fused loss: chunks by its memory
        workload_options.setdefault("loss_device_memory", hw.memory_gib * 2**30)
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.rank > 0:  # a frozen base with adapters (plan/lora.py)
        workload_options.setdefault("lora_rank", lora.rank)
        workload_options.setdefault("lora_base", lora.base)
        workload_options.setdefault("lora_targets", lora.targets)
    work = Workload(model=training_model(cfg), seq_len=tr.seq_len, gbs=tr.gbs,
                    precision=precision, bucket_mb=par.bucket_mb,
                    buckets_in_flight=par.buckets_in_flight, **workload_options)
    layout = Layout(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, zero=par.zero,
                    mbs=par.mbs, recompute=tr.recompute, schedule=par.schedule,
                    virtual_stages=par.virtual_stages, sp=par.sp,
                    offload=layout_offload(offload_value(par.offload)),
                    sp_saved=par.sp_saved_input, cp_comm=par.cp_comm, pp_split=par.pp_split,
                    pp_layers=tuple(par.pp_layers))
    if work.grad_sync == "auto":
        default_hw, default_assume = get_hardware(DEFAULT_GPU)
        work = resolve_grad_sync(work, layout, hw or default_hw, assume or default_assume)
    return work, layout


DEFAULT_GPU = "h100-sxm"  # `fivefold plan --gpu`'s default


def resolve_config_grad_sync(cfg, device_name: str | None = None) -> str:
    """Make a training config's `parallel.grad_sync = "auto"` concrete in place, as planned
    for the GPU called `device_name` (`torch.cuda.get_device_name`; None or an unknown name:
    the planner's default GPU). Returns the choice."""
    if cfg.parallel.grad_sync == "auto":
        hw = hardware_for_device_name(device_name) if device_name else None
        _, assume = get_hardware(DEFAULT_GPU)
        work, _ = training_plan_inputs(cfg, hw, assume)
        cfg.parallel.grad_sync = work.grad_sync
    return cfg.parallel.grad_sync


# Layout field → [parallel] key, for every field that decides what the engine runs.
PARALLEL_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero",
                 "mbs": "mbs", "schedule": "schedule", "virtual_stages": "virtual_stages",
                 "sp": "sp", "offload": "offload", "cp_comm": "cp_comm",
                 "sp_saved": "sp_saved_input", "pp_split": "pp_split", "pp_layers": "pp_layers"}


def layout_config(cfg: fconfig.Config, layout: Layout) -> fconfig.Config:
    """A copy of `cfg` running `layout`: every field the layout fixes replaces the config's
    (the pipeline split and the SP saved input too: a config's pp_layers for its own pp
    must not follow a layout onto another pp)."""
    trial = copy.deepcopy(cfg)
    for name, key in PARALLEL_KEYS.items():
        value = getattr(layout, name)
        if name == "offload":  # the layout's tier; True keeps a config's nvme tier nvme
            given = offload_value(cfg.parallel.offload)
            value = tier(value) if tier(value) != "cpu" else (
                given if given != "none" else "cpu")
        setattr(trial.parallel, key, list(value) if name == "pp_layers" else value)
    trial.train.recompute = layout.recompute
    return trial


def engine_accepts(cfg: fconfig.Config) -> Callable[[Layout], bool]:
    """A filter of layouts: True for those `fivefold train` runs with this config's model
    and batch (config.engine_refusal decides, so it follows the engine as it grows)."""

    def accepts(layout: Layout) -> bool:
        return fconfig.engine_refusal(layout_config(cfg, layout)) is None

    return accepts


# The default global batch: about 4M tokens, the first-stage batch of Llama 3 405B's
# pre-training (4M tokens of 4,096-token sequences, later 8M and 16M; Llama Team 2024, "The
# Llama 3 Herd of Models", §3.4.1) and near GPT-3 175B's 3.2M (Brown et al. 2020, Table 2.1).
DEFAULT_GBS_TOKENS = 4e6


def default_gbs(num_gpus: int, seq_len: int, tokens: float = DEFAULT_GBS_TOKENS) -> int:
    """The default global batch in sequences: num_gpus · 2^k nearest (in ratio) to `tokens`
    tokens, so every dp that divides the GPUs divides it and so do the micro-batch sizes
    under it (4M tokens of 4096 are 976.6 sequences; 977 is prime and would leave dp = 1 to
    every layout)."""
    target = tokens / seq_len
    k = 0
    while num_gpus * 2 ** (k + 1) <= target:
        k += 1
    low, high = num_gpus * 2**k, num_gpus * 2 ** (k + 1)
    return high if high / target < target / low else low


def parse_layout(text: str, num_gpus: int | None = None) -> Layout:
    """'dp=8,tp=8,pp=2,zero=1,mbs=1,recompute=selective,schedule=1f1b,sp=true' → Layout.
    dp may be left out when the number of GPUs is known."""
    values: dict = {}
    fields = {"dp", "tp", "pp", "cp", "ep", "zero", "mbs", "virtual_stages", "recompute",
              "schedule", "sp", "offload", "v", "sp_saved", "cp_comm", "pp_split", "pp_layers"}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        if "=" not in item:
            raise ConfigError(f"--layout item {item!r} needs the form key=value, e.g. tp=8")
        key, value = item.split("=", 1)
        key = "virtual_stages" if key == "v" else key
        if key not in fields:
            raise ConfigError(f"--layout key {key!r} is unknown; use {', '.join(sorted(fields))}")
        if key in ("recompute", "schedule", "sp_saved", "cp_comm", "pp_split"):
            values[key] = value
        elif key == "pp_layers":  # pp_layers=3-4-4-3 (commas separate the items)
            try:
                values[key] = tuple(int(n) for n in value.replace("/", "-").split("-"))
            except ValueError:
                raise ConfigError(f"--layout pp_layers={value!r} must be whole numbers "
                                  f"joined by '-', e.g. pp_layers=3-4-4-3") from None
        elif key == "offload" and value.lower() == "nvme":
            values[key] = "nvme"
        elif key in ("sp", "offload"):
            values[key] = value.lower() in ("1", "true", "yes", "on")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise ConfigError(f"--layout {key}={value!r} must be a whole number") from None
    if "sp" not in values and values.get("tp", 1) > 1:
        values["sp"] = True
    layout = Layout(**values)
    if "dp" not in values and num_gpus:
        rest = layout.tp * layout.pp * layout.cp
        if num_gpus % rest:
            raise ConfigError(f"--gpus {num_gpus} is not divisible by tp·pp·cp = {rest}")
        layout = layout.replace(dp=num_gpus // rest)
    return layout
