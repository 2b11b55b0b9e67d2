"""Hugging Face `config.json` <-> `ModelConfig`, for Llama, Mistral and Qwen2 checkpoints and
the Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE mixtures of experts (tensors: models/hf_moe.py).

This module imports no torch: the config package resolves `model.hf_path` through it, and the
planner must stay instant.

Both spellings of the rotary settings are read: `rope_theta` + `rope_scaling` (transformers 4)
and `rope_parameters` (transformers 5). Export writes the first, which both versions (and most
other tools) read.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from fivefold.errors import ConfigError
from fivefold.models.presets import ModelConfig

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "Dots1ForCausalLM": "dots1",
}
MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
             "OlmoeForCausalLM", "Dots1ForCausalLM")
# The families whose router has a place for the aux-loss-free expert bias (DeepSeek-V3's
# `gate.e_score_correction_bias`); the others' exports would route without it.
EXPERT_BIAS_ARCHS = ("Dots1ForCausalLM",)
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_hf_json(path: str | os.PathLike) -> dict:
    """The parsed config.json at `path` (a file, or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p} does not exist; give a Hugging Face checkpoint directory "
                          f"with a config.json")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} does not hold a JSON object; it is not a model config")
    return data


def _architecture(hf: dict, where: Path) -> str:
    archs = hf.get("architectures") or []
    if not archs:  # some hand-written configs only name the model type
        by_type = {v: k for k, v in SUPPORTED.items()}
        if hf.get("model_type") in by_type:
            return by_type[hf["model_type"]]
    arch = archs[0] if archs else hf.get("model_type", "<none>")
    if arch not in SUPPORTED:
        raise ConfigError(f"{where}: architecture '{arch}' is not supported; fivefold reads "
                          f"{', '.join(SUPPORTED)}")
    return arch


def _rope(hf: dict, where: Path) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling or None) from either transformers spelling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"{where}: rope type '{kind}' is not supported; fivefold implements "
                          f"plain RoPE and 'llama3' scaling")
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}; add them "
                          f"to rope_scaling")
    return float(theta), {k: scaling[k] for k in LLAMA3_KEYS}


POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "sliding_window")


def check_numbers(hf: dict, where: Path) -> None:
    """Every size a config.json gives must be a positive whole number (not "128", not null,
    not 0), and rope_theta / rms_norm_eps plain numbers: one line naming the key otherwise."""
    for key in POSITIVE_INTS:
        value = hf.get(key)
        if value is None and key in ("num_key_value_heads", "head_dim", "sliding_window",
                                     "max_position_embeddings"):
            continue  # optional: null means "not set"
        if key == "sliding_window" and value == 0 and not hf.get("use_sliding_window"):
            continue  # Qwen2-MoE writes 0 with use_sliding_window false: no window
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{where}: {key} = {json.dumps(value)} is not a positive whole "
                              f"number; fix config.json")
    for key in ("rope_theta", "rms_norm_eps"):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise ConfigError(f"{where}: {key} = {json.dumps(value)} is not a non-negative "
                              f"number; fix config.json")


def check_shape(cfg: ModelConfig, where: Path) -> None:
    """Head counts and widths that fit together; one line naming config.json otherwise."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads = {cfg.num_heads} is not a multiple of "
                          f"num_key_value_heads = {cfg.num_kv_heads}; fix config.json")
    if cfg.head_dim is None and cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"{where}: hidden_size = {cfg.hidden_size} is not divisible by "
                          f"num_attention_heads = {cfg.num_heads}; give head_dim or fix them")


def _refuse(where: Path, key: str, value, why: str) -> None:
    raise ConfigError(f"{where}: {key} = {value!r} is not supported ({why})")


def model_config_from_hf(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face Llama / Mistral / Qwen2 `config.json`.

    Anything fivefold's model would compute differently is refused with a ConfigError rather
    than silently approximated.
    """
    where = Path(path) if not Path(path).is_dir() else Path(path) / "config.json"
    hf = read_hf_json(where)
    arch = _architecture(hf, where)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in hf:
            raise ConfigError(f"{where}: missing key '{key}'; this config.json is incomplete")
    check_numbers(hf, where)
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "the Llama MLP uses silu")
    if hf.get("mlp_bias"):
        _refuse(where, "mlp_bias", True, "the Llama MLP has no biases")
    # Llama's attention_bias puts a bias on o_proj too; Qwen2 has q/k/v biases only.
    qkv_bias = arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM"
                                              and hf.get("qkv_bias", True))
    if arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and hf.get("attention_bias"):
        _refuse(where, "attention_bias", True, "an o_proj bias is not modelled")
    theta, scaling = _rope(hf, where)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim == hf["hidden_size"] // heads:
        head_dim = None
    max_len = hf.get("max_position_embeddings", 2048)
    # A sliding window changes attention only beyond the window, so cap the length at it:
    # within the window our full causal attention computes the same thing.
    window = hf.get("sliding_window")
    uses_window = arch in ("MistralForCausalLM", "MixtralForCausalLM") or hf.get(
        "use_sliding_window", False)
    if uses_window and window and window < max_len:
        max_len = window
    moe = moe_fields(arch, hf, where) if arch in MOE_ARCHS else {}
    cfg = ModelConfig(
        name=where.parent.name or "hf",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_seq_len=max_len,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        # Only what export would not pick by itself (Llama, Qwen2 and the MoE classes it does).
        hf_architecture=arch if arch == "MistralForCausalLM" else "",
        **moe,
    )
    check_shape(cfg, where)
    return cfg


def moe_fields(arch: str, hf: dict, where: Path) -> dict:
    """The ModelConfig fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json.

    Mixtral: every layer MoE, softmax over all experts, top-k, always renormalised; its
    `intermediate_size` is the experts'. OLMoE: as Mixtral, renormalised iff `norm_topk_prob`,
    with RMSNorm over the whole q and k vectors. Qwen2/3-MoE: softmax, top-k, renormalised iff
    `norm_topk_prob`; layer i is MoE when (i+1) % decoder_sparse_step == 0 and i is not in
    `mlp_only_layers` (supported when those are the first layers); Qwen2-MoE adds a shared
    expert scaled by sigmoid(x·w); Qwen3-MoE normalises each head's q and k.
    """
    if hf.get("router_jitter_noise"):
        _refuse(where, "router_jitter_noise", hf["router_jitter_noise"],
                "multiplicative router noise in training is not modelled; set it to 0")
    if arch == "OlmoeForCausalLM":
        if hf.get("clip_qkv") is not None:
            _refuse(where, "clip_qkv", hf["clip_qkv"], "clamping q, k, v is not modelled")
        return dict(num_experts=hf.get("num_experts", hf.get("num_local_experts", 64)),
                    experts_top_k=hf.get("num_experts_per_tok", 8),
                    moe_intermediate_size=hf["intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)), qk_norm=True,
                    qk_norm_whole=True)
    if arch == "Dots1ForCausalLM":
        return dots1_fields(hf)
    if arch == "MixtralForCausalLM":
        return dict(num_experts=hf.get("num_local_experts", 8),
                    experts_top_k=hf.get("num_experts_per_tok", 2),
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        _refuse(where, "mlp_only_layers", dense, "only a run of first layers can stay dense")
    # transformers 5 writes Qwen3-MoE's count as num_local_experts, published configs num_experts
    out = dict(num_experts=hf.get("num_experts", hf.get("num_local_experts", 60)),
               experts_top_k=hf.get("num_experts_per_tok", 4),
               moe_intermediate_size=hf["moe_intermediate_size"],
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               moe_layer_freq=hf.get("decoder_sparse_step", 1), moe_first_dense=len(dense))
    if arch == "Qwen2MoeForCausalLM":
        out.update(shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                   shared_expert_gate=True)
    else:
        out.update(qk_norm=True)
    return out


def dots1_fields(hf: dict) -> dict:
    """dots.llm1 (transformers' Dots1): DeepSeek-V3's router (sigmoid scores, groups, the
    expert bias as `gate.e_score_correction_bias`, routed scaling) and ungated shared experts
    after `first_k_dense_replace` dense layers, with Qwen3's per-head q/k norms."""
    inter = hf["moe_intermediate_size"]
    return dict(num_experts=hf.get("n_routed_experts") or hf.get("num_local_experts"),
                experts_top_k=hf["num_experts_per_tok"], moe_intermediate_size=inter,
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), router_score="sigmoid",
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                router_groups=hf.get("n_group") or 1, router_topk_groups=hf.get("topk_group") or 1,
                moe_first_dense=hf.get("first_k_dense_replace") or 0,
                shared_expert_intermediate_size=inter * (hf.get("n_shared_experts") or 0),
                qk_norm=True)


def _dots1_fits(cfg: ModelConfig) -> bool:
    return (cfg.router_score == "sigmoid" and cfg.qk_norm and not cfg.qk_norm_whole
            and not cfg.qkv_bias and cfg.moe_layer_freq == 1 and cfg.capacity_factor == 0
            and not cfg.shared_expert_gate and cfg.shared_expert_intermediate_size > 0
            and cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size == 0
            and cfg.num_experts % cfg.router_groups == 0)


def _moe_arch(cfg: ModelConfig) -> str:
    """The HF family a fivefold MoE model exports to, or a ConfigError saying why none fits."""
    where = f"model '{cfg.name}'"
    if _dots1_fits(cfg):
        return "Dots1ForCausalLM"
    plain = (cfg.router_score == "softmax" and cfg.routed_scaling_factor == 1.0
             and cfg.router_groups == 1 and cfg.capacity_factor == 0)
    if not plain:
        raise ConfigError(f"{where}: sigmoid scores, routed scaling, group-limited routing and "
                          f"capacity have no Mixtral/Qwen-MoE equivalent, and dots.llm1's also "
                          f"needs per-head qk_norm, ungated shared experts (a multiple of "
                          f"moe_intermediate_size), every layer MoE after moe_first_dense and no "
                          f"capacity; it cannot be exported")
    if cfg.shared_expert_intermediate_size:
        if not cfg.shared_expert_gate or cfg.qk_norm:
            raise ConfigError(f"{where}: a shared expert exports only as Qwen2-MoE (gated, "
                              f"no qk_norm)")
        return "Qwen2MoeForCausalLM"
    if cfg.qk_norm and cfg.qk_norm_whole:
        if cfg.num_moe_layers != cfg.num_layers or cfg.qkv_bias:
            raise ConfigError(f"{where}: whole-vector q/k norms export only as OLMoE (every "
                              f"layer MoE, no qkv bias)")
        return "OlmoeForCausalLM"
    if cfg.qk_norm:
        return "Qwen3MoeForCausalLM"
    if cfg.norm_topk_prob and cfg.num_moe_layers == cfg.num_layers and not cfg.qkv_bias:
        return "MixtralForCausalLM"
    raise ConfigError(f"{where}: without qk_norm only a Mixtral-shaped MoE exports (every layer "
                      f"MoE, norm_topk_prob, no qkv bias); set model.qk_norm for Qwen3-MoE")


def _moe_export(cfg: ModelConfig, arch: str) -> dict:
    if arch == "Dots1ForCausalLM":
        return {"n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_top_k,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "n_shared_experts": cfg.shared_expert_intermediate_size
                // cfg.moe_intermediate_size, "n_group": cfg.router_groups,
                "topk_group": cfg.router_topk_groups, "first_k_dense_replace": cfg.moe_first_dense,
                "norm_topk_prob": cfg.norm_topk_prob,
                "routed_scaling_factor": cfg.routed_scaling_factor, "attention_bias": False,
                "sliding_window": None, "max_window_layers": cfg.num_layers,
                "output_router_logits": False}
    if arch == "OlmoeForCausalLM":
        return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_top_k,
                "intermediate_size": cfg.moe_intermediate_size, "clip_qkv": None,
                "norm_topk_prob": cfg.norm_topk_prob, "output_router_logits": False,
                "attention_bias": False}
    if arch == "MixtralForCausalLM":
        return {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_top_k,
                "intermediate_size": cfg.moe_intermediate_size, "router_jitter_noise": 0.0,
                "sliding_window": None, "output_router_logits": False}
    out = {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_top_k,
           "moe_intermediate_size": cfg.moe_intermediate_size,
           "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.moe_layer_freq,
           "mlp_only_layers": list(range(cfg.moe_first_dense)), "output_router_logits": False,
           "use_sliding_window": False, "sliding_window": None,
           "max_window_layers": cfg.num_layers}
    if arch == "Qwen2MoeForCausalLM":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                   qkv_bias=cfg.qkv_bias)
    else:
        out.update(attention_bias=False)
        if cfg.qkv_bias:
            raise ConfigError(f"model '{cfg.name}': Qwen3-MoE has no q/k/v biases; set "
                              f"model.qkv_bias = false to export")
    return out


def hf_config_from_model(cfg: ModelConfig, dtype: str | None = None) -> dict:
    """A config.json dict for `cfg`: Qwen2ForCausalLM when it has q/k/v biases, else Llama.

    `dtype` is the stored weights' dtype name ("float32", "bfloat16", ...), if known.
    """
    if cfg.mlp != "swiglu" or cfg.norm != "rmsnorm":
        raise ConfigError(f"model '{cfg.name}' uses mlp={cfg.mlp}, norm={cfg.norm}; only "
                          f"swiglu + rmsnorm (Llama-family) models export to Hugging Face")
    qwen = cfg.qkv_bias
    arch = _moe_arch(cfg) if cfg.num_experts else (
        "Qwen2ForCausalLM" if qwen else "LlamaForCausalLM")
    mistral = arch == "LlamaForCausalLM" and cfg.hf_architecture == "MistralForCausalLM"
    if mistral:  # imported from Mistral: exported as Mistral (the same computation here)
        arch = "MistralForCausalLM"
    if cfg.qk_norm and not cfg.num_experts:
        raise ConfigError(f"model '{cfg.name}': qk_norm exports only with experts (Qwen3-MoE)")
    out = {
        "architectures": [arch],
        "model_type": SUPPORTED[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": ({"rope_type": "llama3", **cfg.rope_scaling}
                         if cfg.rope_scaling else None),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
    }
    if cfg.num_experts:
        out.update(_moe_export(cfg, arch))
    elif qwen:
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_layers)
    elif mistral:  # the window capped max_seq_len on import: within it, attention is full
        out.update(sliding_window=None)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    if dtype:
        out["torch_dtype"] = dtype
    return out
