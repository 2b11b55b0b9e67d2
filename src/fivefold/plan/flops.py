"""FLOPs: model FLOPs (what MFU counts) and hardware FLOPs (with recomputation).

A multiply-add is 2 FLOPs; backward costs twice the forward (one GEMM for the input gradient,
one for the weight gradient), so training is 3× forward (Kaplan et al. 2020; Narayanan et al.
2021 eq. 3). Attention scores are counted over the full s×s square by default (PaLM,
Narayanan, torchtitan, the Ultra-Scale Playbook); `causal=True` halves them (Megatron ≥ 2025).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.models.presets import ModelConfig

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token, by part."""

    layer_matmul: float  # projections and MLP of one layer (the 2·N term)
    layer_attention: float  # QKᵀ and PV of one layer (the s-dependent term)
    head: float  # output projection 2·h·V (the embedding lookup is free)
    num_layers: int

    @property
    def layer(self) -> float:
        return self.layer_matmul + self.layer_attention

    @property
    def total(self) -> float:
        return self.num_layers * self.layer + self.head


def forward_flops_per_token(model: ModelConfig, seq_len: int, causal: bool = False) -> ForwardFlops:
    """2 FLOPs per weight a token passes through (MoE: top-k experts), plus attention
    2·2·s·heads·head_dim per layer (QKᵀ and PV; Narayanan 2021 §3.1)."""
    h, d = model.hidden_size, model.dim_per_head
    q, kv = model.num_heads * d, model.num_kv_heads * d
    attn_proj = 2 * h * q + 2 * h * kv
    mlp = mlp_weights_per_token(model)
    scores = 2 * 2 * seq_len * q * (0.5 if causal else 1.0)
    return ForwardFlops(2 * (attn_proj + mlp), scores, 2 * h * model.vocab_size, model.num_layers)


def mlp_weights_per_token(model: ModelConfig) -> float:
    """MLP weights one token passes through, averaged over the layers: a dense layer's MLP, or
    an MoE layer's router, top-k routed experts and shared expert (the ACTIVE parameters:
    counting all E experts would overstate Mixtral's FLOPs 3.6×, maxtext PR #678)."""
    h = model.hidden_size
    dense = (3 if model.mlp == "swiglu" else 2) * h * model.intermediate_size
    if not model.num_experts:
        return float(dense)
    moe = sum(model.moe_params(active=True).values())
    n = model.num_moe_layers
    return (n * moe + (model.num_layers - n) * dense) / model.num_layers


def model_flops_per_token(model: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs per token without recomputation: 3 × forward. For a dense model this is
    6·N_nonembedding + 12·L·s·q (+ 6·h·V for the head), the figure MFU is computed from."""
    return 3 * forward_flops_per_token(model, seq_len, causal).total


def recompute_flops_per_token(model: ModelConfig, seq_len: int, recompute: str,
                              causal: bool = False) -> float:
    """Extra forward FLOPs per token that recomputation spends in backward: "full" reruns every
    layer's forward (Korthikanti: ~33% more), "selective" only QKᵀ/softmax/PV (2.7% for GPT-3)."""
    fwd = forward_flops_per_token(model, seq_len, causal)
    if recompute == "full":
        return fwd.num_layers * fwd.layer
    if recompute == "selective":
        return fwd.num_layers * fwd.layer_attention
    return 0.0


def hardware_flops_per_token(model: ModelConfig, seq_len: int, recompute: str,
                             causal: bool = False) -> float:
    """FLOPs the GPUs execute per token (what HFU counts): model FLOPs plus recomputation."""
    return (model_flops_per_token(model, seq_len, causal)
            + recompute_flops_per_token(model, seq_len, recompute, causal))


def training_flops(num_params: float, tokens: float, recompute: str = "none") -> float:
    """The rule of thumb C = 6·N·D; with full recomputation 8·N·D (one more forward)."""
    return (8.0 if recompute == "full" else 6.0) * num_params * tokens


def training_days(total_flops: float, num_gpus: int, flops_per_gpu: float) -> float:
    """Wall-clock days at an achieved per-GPU rate: C / (n · X)."""
    return total_flops / (num_gpus * flops_per_gpu) / SECONDS_PER_DAY


def korthikanti_model_flops(model: ModelConfig, batch: int, seq_len: int) -> float:
    """Korthikanti et al. 2022 / Narayanan eq. 3 without recompute, per iteration:
    72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)). Exact for an MHA 4h-MLP GPT block."""
    h, L = model.hidden_size, model.num_layers
    return 72 * batch * seq_len * L * h * h * (1 + seq_len / (6 * h)
                                               + model.vocab_size / (12 * L * h))
