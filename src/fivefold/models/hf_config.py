"""Hugging Face `config.json` <-> `ModelConfig`, for Llama, Mistral and Qwen2 checkpoints.

This module imports no torch: `config.py` resolves `model.hf_path` through it, and the
planner must stay instant.

Both spellings of the rotary settings are read: `rope_theta` + `rope_scaling` (transformers 4)
and `rope_parameters` (transformers 5). Export writes the first, which both versions (and most
other tools) read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.models.presets import ModelConfig

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
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
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "the Llama MLP uses silu")
    if hf.get("mlp_bias"):
        _refuse(where, "mlp_bias", True, "the Llama MLP has no biases")
    # Llama's attention_bias puts a bias on o_proj too; Qwen2 has q/k/v biases only.
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
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
    uses_window = arch == "MistralForCausalLM" or hf.get("use_sliding_window", False)
    if uses_window and window and window < max_len:
        max_len = window
    return ModelConfig(
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
        qkv_bias=arch == "Qwen2ForCausalLM",
    )


def hf_config_from_model(cfg: ModelConfig, dtype: str | None = None) -> dict:
    """A config.json dict for `cfg`: Qwen2ForCausalLM when it has q/k/v biases, else Llama.

    `dtype` is the stored weights' dtype name ("float32", "bfloat16", ...), if known.
    """
    if cfg.mlp != "swiglu" or cfg.norm != "rmsnorm":
        raise ConfigError(f"model '{cfg.name}' uses mlp={cfg.mlp}, norm={cfg.norm}; only "
                          f"swiglu + rmsnorm (Llama-family) models export to Hugging Face")
    if cfg.num_experts:
        raise ConfigError(f"model '{cfg.name}' has experts; mixture-of-experts export is not "
                          f"available yet")
    qwen = cfg.qkv_bias
    out = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
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
    if qwen:
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_layers)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    if dtype:
        out["torch_dtype"] = dtype
    return out
