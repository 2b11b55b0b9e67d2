"""What train.precision = fp8 changes in the planner's saved activations.

An FP8 linear (lowp/linear.py) saves its input quantised: 1 byte per element plus its
scales, instead of the compute dtype's B bytes. Per dense layer, with recompute = none:

    qkv_input    T·h·B  ->  T·h + scales      (q, k and v share one quantised input)
    mlp_input    T·h·B  ->  T·h + scales      (gate and up share one)
    mlp_hidden   of SwiGLU's 4·T·f·B, the product (down_proj's input) becomes T·f + scales
    attn_out     o_proj's input: in bf16 a view of the attention output a saved flash core
                 keeps anyway (no bytes of its own); in FP8 a new copy, T·q + scales

Scales per saved input of K channels (fp32): tensorwise 4 bytes; rowwise 4 per token;
blockwise 4 per token per 128 channels (DeepSeek-V3's 1x128 tiles). The engine checks this
to the byte (tests/test_fp8_train.py); MoE experts and selective/full recomputation keep
their bf16 terms here (not modelled for FP8).
"""

from __future__ import annotations

import math

FP8_BYTES = 1
SCALE_BYTES = 4


def scale_bytes(recipe: str, tokens: float, channels: float) -> float:
    if recipe == "tensorwise":
        return SCALE_BYTES
    if recipe == "rowwise":
        return tokens * SCALE_BYTES
    return tokens * math.ceil(channels / 128) * SCALE_BYTES  # blockwise


def saved_input(recipe: str, tokens: float, channels: float) -> float:
    """Bytes an FP8 linear keeps of its (tokens, channels) input."""
    return tokens * channels * FP8_BYTES + scale_bytes(recipe, tokens, channels)


def apply_fp8_terms(terms: dict[str, float], *, recipe: str, tokens: float, h: int, q: float,
                    f: float, dtype_bytes: int, swiglu: bool, qkv_tokens: float) -> None:
    """Rewrite a dense layer's recompute = none terms (plan/activations.py) in place.
    `qkv_tokens`: the rows of the column linears' saved input (all T under SP)."""
    terms["qkv_input"] = saved_input(recipe, qkv_tokens, h)
    terms["mlp_input"] = saved_input(recipe, qkv_tokens, h)
    terms["attn_out"] = saved_input(recipe, tokens, q)
    product = tokens * f * dtype_bytes
    if swiglu:
        terms["mlp_hidden"] += saved_input(recipe, tokens, f) - product
