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
    qk_norm: bool = False  # RMSNorm on the queries and keys, before RoPE
    qk_norm_whole: bool = False  # over all heads' q and k at once (OLMoE), not per head (Qwen3)
    mlp: str = "swiglu"  # "swiglu" (Llama) or "gelu" (GPT-3 style, 2 matrices)
    norm: str = "rmsnorm"  # "rmsnorm" or "layernorm"
    init_std: float = 0.02
    hf_architecture: str = ""  # imported from this HF class (Mistral); export names it again
    # Mixture of experts (0 experts: dense); see models/moe.py.
    num_experts: int = 0
    experts_top_k: int = 0
    moe_intermediate_size: int = 0
    moe_layer_freq: int = 1  # layer i is MoE when (i + 1) % freq == 0 (Qwen's decoder_sparse_step)
    moe_first_dense: int = 0  # the first k layers stay dense (DeepSeek's first_k_dense_replace)
    router_score: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the k chosen weights to sum to 1
    routed_scaling_factor: float = 1.0
    router_groups: int = 1  # group-limited routing: experts in groups, topk_groups of them kept
    router_topk_groups: int = 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x·w) scales the shared expert
    capacity_factor: float = 0.0  # 0: dropless; else per-sequence capacity (models/moe.py)
    aux_loss_coeff: float = 0.0  # sequence-wise balance loss
    z_loss_coeff: float = 0.0  # router z-loss
    expert_bias_rate: float = 0.0  # aux-loss-free bias update per step; 0: off

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i >= self.moe_first_dense
                and (i + 1) % self.moe_layer_freq == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

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
        """Parameter counts by part: embedding, per layer, final norm, output head.

        'layer' is one layer of the most common kind (an MoE layer in an MoE model),
        'layers' the sum over all layers (dense and MoE alike)."""
        embed = self.vocab_size * self.hidden_size
        layers = [self.layer_params(i) for i in range(self.num_layers)]
        moe = [n for i, n in enumerate(layers) if self.is_moe_layer(i)]
        return {
            "embedding": embed,
            "layer": moe[0] if moe else layers[0],
            "layers": sum(layers),
            "final_norm": self._norm_size * self.hidden_size,
            "head": 0 if self.tie_embeddings else embed,
        }

    @property
    def _norm_size(self) -> int:
        return 1 if self.norm == "rmsnorm" else 2  # LayerNorm has a bias

    def attention_params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += self.q_size + self.kv_size if self.qk_norm_whole else 2 * self.dim_per_head
        return attn + 2 * self._norm_size * h

    def moe_params(self, active: bool = False) -> dict[str, int]:
        """One MoE layer's feed-forward: 'router', 'routed' experts ('active': only the top-k
        a token passes through), 'shared' expert (and its gate)."""
        h = self.hidden_size
        experts = self.experts_top_k if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h * self.shared_expert_gate
        return {"router": h * self.num_experts,
                "routed": experts * 3 * h * self.moe_intermediate_size, "shared": shared}

    def layer_params(self, i: int, active: bool = False) -> int:
        h, f = self.hidden_size, self.intermediate_size
        if self.is_moe_layer(i):
            mlp = sum(self.moe_params(active).values())
        else:
            mlp = (3 if self.mlp == "swiglu" else 2) * h * f
            if self.mlp == "gelu":
                mlp += f + h  # GPT-style MLP biases
        return self.attention_params() + mlp

    def num_params(self) -> int:
        c = self.param_counts()
        return c["embedding"] + c["layers"] + c["final_norm"] + c["head"]

    def num_active_params(self) -> int:
        """Parameters a token passes through: the top-k routed experts instead of all E."""
        c = self.param_counts()
        layers = sum(self.layer_params(i, active=True) for i in range(self.num_layers))
        return c["embedding"] + layers + c["final_norm"] + c["head"]

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
    # The default job's model: tiny with the vocabulary of the bundled corpus's 2048-token BPE
    # (data.tokenizer auto takes it), 1.05M parameters (1,049,728) of which 0.26M are the tied
    # embedding.
    "tiny-bpe": ModelConfig(
        name="tiny-bpe", vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=4,
        num_heads=4, num_kv_heads=2, max_seq_len=1024, tie_embeddings=True,
    ),
    # The CPU benchmark's model: 25.3M parameters in 8 layers of width 512 (SwiGLU 8h/3),
    # plus a tied 32,000-token embedding (Llama 2's vocabulary) of 16.4M.
    "llama-25m": ModelConfig(
        name="llama-25m", vocab_size=32000, hidden_size=512, intermediate_size=1376,
        num_layers=8, num_heads=8, num_kv_heads=8, max_seq_len=2048, tie_embeddings=True,
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
    # --- mixtures of experts (models/moe.py) ---
    # The tiny model with 8 top-2 experts: the MoE debug run, the tests and the balance study.
    "tiny-moe": ModelConfig(
        name="tiny-moe", vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=4,
        num_heads=4, num_kv_heads=2, max_seq_len=1024, tie_embeddings=True, num_experts=8,
        experts_top_k=2, moe_intermediate_size=128, aux_loss_coeff=0.01, z_loss_coeff=0.001,
    ),
    # OLMoE-1B-7B-0924: 64 experts, top-8, no renormalisation, q/k norms over whole vectors.
    "olmoe-1b-7b": ModelConfig(
        name="olmoe-1b-7b", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
        num_layers=16, num_heads=16, num_kv_heads=16, max_seq_len=4096, qk_norm=True,
        qk_norm_whole=True, num_experts=64,
        experts_top_k=8, moe_intermediate_size=1024, norm_topk_prob=False,
        aux_loss_coeff=0.01, z_loss_coeff=0.001,
    ),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, max_seq_len=32768, rope_theta=1e6,
        num_experts=8, experts_top_k=2, moe_intermediate_size=14336, aux_loss_coeff=0.02,
    ),
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, max_seq_len=40960,
        rope_theta=1e6, norm_eps=1e-6, qk_norm=True, num_experts=128, experts_top_k=8,
        moe_intermediate_size=768, aux_loss_coeff=0.001,
    ),
    # DeepSeek-V3's experts and router (Liu et al. 2024, arXiv 2412.19437; config_671B.json):
    # 3 dense layers, then 256 routed experts (top-8 of 8 groups, 4 kept, sigmoid scores,
    # scale 2.5) and one shared expert; aux-loss-free bias (γ = 0.001) with the sequence-wise
    # loss at α = 1e-4. The ATTENTION IS LLAMA-STYLE multi-head attention (128 heads of 128),
    # not DeepSeek's multi-head latent attention, so attention parameters, FLOPs and the KV
    # footprint differ from the real model; no multi-token prediction, no YaRN.
    "deepseek-v3-shaped": ModelConfig(
        name="deepseek-v3-shaped", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_layers=61, num_heads=128, num_kv_heads=128, head_dim=128, max_seq_len=4096,
        norm_eps=1e-6, num_experts=256, experts_top_k=8, moe_intermediate_size=2048,
        moe_first_dense=3, router_score="sigmoid", routed_scaling_factor=2.5, router_groups=8,
        router_topk_groups=4, shared_expert_intermediate_size=2048, aux_loss_coeff=1e-4,
        expert_bias_rate=1e-3,
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

# Every ModelConfig field that decides which tensors the model has or their shapes
# (tests/test_checkpoint_refusal.py changes each field of ModelConfig and checks this list).
PARAMETER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "tie_embeddings", "qkv_bias", "qk_norm",
                  "qk_norm_whole", "mlp", "norm", "num_experts", "moe_intermediate_size",
                  "moe_layer_freq", "moe_first_dense", "shared_expert_intermediate_size",
                  "shared_expert_gate")
