"""Model shapes: the `ModelConfig` dataclass and named presets of real models.

This module imports no torch: the planner and the config validator use it too.
Shapes are taken from each model's published Hugging Face `config.json`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (and the GPT-3 style variant the planner needs)."""

    name: str = "custom"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    # Llama-3.1 frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    mlp: str = "swiglu"  # "swiglu" (Llama) or "gelu" (GPT-3 style, 2 matrices)
    norm: str = "rmsnorm"  # "rmsnorm" or "layernorm"
    init_std: float = 0.02
    # Mixture of experts (0 experts: dense). Used by the planner; the engine's MoE comes later.
    num_experts: int = 0
    experts_top_k: int = 0
    moe_intermediate_size: int = 0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.dim_per_head

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.dim_per_head

    def param_counts(self) -> dict[str, int]:
        """Parameter counts by part: embedding, per layer, final norm, output head."""
        h, f = self.hidden_size, self.intermediate_size
        norm_size = 1 if self.norm == "rmsnorm" else 2  # LayerNorm has a bias
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        else:
            mlp = (3 if self.mlp == "swiglu" else 2) * h * f
            if self.mlp == "gelu":
                mlp += f + h  # GPT-style MLP biases
        layer = attn + mlp + 2 * norm_size * h
        embed = self.vocab_size * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return {
            "embedding": embed,
            "layer": layer,
            "layers": layer * self.num_layers,
            "final_norm": norm_size * h,
            "head": head,
        }

    def num_params(self) -> int:
        c = self.param_counts()
        return c["embedding"] + c["layers"] + c["final_norm"] + c["head"]

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _llama3_scaling(factor: float, original: int = 8192) -> dict:
    return {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


PRESETS: dict[str, ModelConfig] = {
    # A debug model that trains in minutes on a 2-core CPU with byte-level tokens.
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=4,
        num_heads=4, num_kv_heads=2, max_seq_len=1024, tie_embeddings=True,
    ),
    # Even smaller, for the unit tests.
    "nano": ModelConfig(
        name="nano", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, max_seq_len=256,
    ),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, max_seq_len=8192, rope_theta=100000.0,
        tie_embeddings=True,
    ),
    "smollm-1.7b": ModelConfig(
        name="smollm-1.7b", vocab_size=49152, hidden_size=2048, intermediate_size=8192,
        num_layers=24, num_heads=32, num_kv_heads=32, max_seq_len=2048, tie_embeddings=True,
    ),
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, max_seq_len=32768, rope_theta=1e6,
        norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
    ),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, max_seq_len=131072, rope_theta=1e6,
        norm_eps=1e-6, qkv_bias=True,
    ),
    "llama-2-7b": ModelConfig(
        name="llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, max_seq_len=4096,
    ),
    "mistral-7b": ModelConfig(
        name="mistral-7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, max_seq_len=32768,
    ),
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, max_seq_len=131072, rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0), tie_embeddings=True,
    ),
    "llama-3.2-3b": ModelConfig(
        name="llama-3.2-3b", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_layers=28, num_heads=24, num_kv_heads=8, max_seq_len=131072, rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0), tie_embeddings=True,
    ),
    "llama-3.1-8b": ModelConfig(
        name="llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, max_seq_len=131072, rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0),
    ),
    "llama-3.1-70b": ModelConfig(
        name="llama-3.1-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, max_seq_len=131072, rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0),
    ),
    "llama-3.1-405b": ModelConfig(
        name="llama-3.1-405b", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
        num_layers=126, num_heads=128, num_kv_heads=8, max_seq_len=131072,
        rope_theta=500000.0, rope_scaling=_llama3_scaling(8.0),
    ),
    # GPT-3 175B (Brown et al. 2020, Table 2.1): GeLU MLP, LayerNorm, learned positions are
    # not modelled (the planner ignores their 0.01% of parameters).
    "gpt3-175b": ModelConfig(
        name="gpt3-175b", vocab_size=50257, hidden_size=12288, intermediate_size=49152,
        num_layers=96, num_heads=96, num_kv_heads=96, max_seq_len=2048, mlp="gelu",
        norm="layernorm", qkv_bias=True,
    ),
}


def preset(name: str) -> ModelConfig:
    """Return a copy of a named preset; unknown names get a suggestion."""
    key = name.lower()
    if key not in PRESETS:
        close = difflib.get_close_matches(key, PRESETS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise KeyError(f"unknown model preset '{name}'{hint}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[key])


MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
