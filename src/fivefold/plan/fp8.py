"""What train.precision = fp8 changes in the planner's saved activations.

An FP8 linear (lowp/linear.py) saves its input quantised: 1 byte per element plus its
scales, instead of the compute dtype's B bytes. Per dense layer, with recompute = none:

    qkv_input    T·h·B  ->  T·h + scales      (q, k and v share one quantised input)
    mlp_input    T·h·B  ->  T·h + scales      (gate and up share one)
    mlp_hidden   of SwiGLU's 4·T·f·B, the product (down_proj's input) becomes T·f + scales
    attn_out     o_proj's input: in bf16 a view of the attention output a saved flash core
                 keeps anyway (no bytes of its own); in FP8 a new copy, T·q + scales

Scales per saved input of K channels (fp32): tensorwise 4 bytes; rowwise 4 per channel (it
saves x quantised along the tokens, for the weight gradient: lowp/linear.py);
blockwise 4 per token per 128 channels (DeepSeek-V3's 1x128 tiles). The engine checks this
to the byte (tests/test_fp8_train.py); MoE experts and selective/full recomputation keep
their bf16 terms here (not modelled for FP8).

parallel.fp8_allgather (ZeRO-3, tensorwise): the dense layers' linear weights (q, k, v, o and
the MLP's; not the head, norms, embedding or MoE experts) are all-gathered as 1-byte FP8
(parallel/zero3_fp8.py); `fp8_gather_params` counts them per rank. The engine pads each
rank's FP8 and bf16 messages to the largest rank's count (a unit's shard boundaries fall
anywhere in its weights), which this does not count: well under 1% of a unit at real sizes.
Their scales come from one all_reduce(max) of fp32 amaxes per step, one per weight
(`fp8_gather_weights`).
"""

from __future__ import annotations

import math

FP8_BYTES = 1
SCALE_BYTES = 4


def scale_bytes(recipe: str, tokens: float, channels: float) -> float:
    if recipe == "tensorwise":
        return SCALE_BYTES
    if recipe == "rowwise":
        return channels * SCALE_BYTES
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


def _fp8_gather_on(work, layout) -> bool:
    return bool(work.fp8_allgather and work.precision == "fp8" and layout.zero == 3)


def _dense_layers(mc, layers: int) -> float:
    return layers - (layers * mc.num_moe_layers / mc.num_layers if mc.num_experts else 0)


def fp8_gather_params(work, layout, layers: int) -> float:
    """Elements of this rank's FP8-linear weights that ZeRO-3 gathers in FP8 (dense layers
    of `layers` on this pipeline stage, over tp); 0 unless parallel.fp8_allgather is on."""
    mc = work.model
    if not _fp8_gather_on(work, layout):
        return 0
    h = mc.hidden_size
    attn = h * mc.q_size * 2 + h * mc.kv_size * 2  # q, o; k, v
    mlp = h * mc.intermediate_size * (3 if mc.mlp == "swiglu" else 2)
    return (attn * layers + mlp * _dense_layers(mc, layers)) / layout.tp


def fp8_gather_weights(work, layout, layers: int) -> float:
    """How many weights those are (q, k, v, o per layer and the dense layers' MLP linears):
    the fp32 amaxes of the one all_reduce(max) per step that sets their scales."""
    mc = work.model
    if not _fp8_gather_on(work, layout):
        return 0
    return 4 * layers + (3 if mc.mlp == "swiglu" else 2) * _dense_layers(mc, layers)
