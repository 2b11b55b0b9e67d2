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
blockwise 4 per token per 128 channels (DeepSeek-V3's 1x128 tiles); rowwise_gw_hp saves the
input in the compute dtype (nothing changes). The engine checks this
to the byte (tests/test_fp8_train.py); MoE experts and selective/full recomputation keep
their bf16 terms here (not modelled for FP8).

parallel.fp8_allgather (ZeRO-3, tensorwise): the FP8 linears' weights (every layer's q, k, v
and o, a dense layer's MLP, a MoE layer's shared expert; not the head, norms or embedding)
are all-gathered as 1-byte FP8 (parallel/zero3_fp8.py); `fp8_gather_terms` counts them per
rank, and `fp8_expert_gather_terms` the routed experts' (one scale per expert's weight). The
engine pads each rank's message to the longest rank's (a unit's shard boundaries fall
anywhere in its weights), which this does not count: well under 1% of a unit at real sizes.
Their scales come from one all_reduce(max) of fp32 amaxes per step, one per weight; under
delayed scaling (train.fp8_scaling = delayed) from the weights' amax histories, with no
all-reduce of their own after the first step (their records ride in delayed scaling's one
all-reduce, `delayed_amax_records`). A train.fp8_keep_out linear gathers in bf16; this still
counts it at 1 byte.
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
    `qkv_tokens`: the rows of the column linears' saved input (all T under SP).
    rowwise_gw_hp saves its input in the compute dtype, as bf16 does (its weight gradient
    is a bf16 GEMM of that input): the terms stay as they are."""
    if recipe == "rowwise_gw_hp":
        return
    terms["qkv_input"] = saved_input(recipe, qkv_tokens, h)
    terms["mlp_input"] = saved_input(recipe, qkv_tokens, h)
    terms["attn_out"] = saved_input(recipe, tokens, q)
    product = tokens * f * dtype_bytes
    if swiglu:
        terms["mlp_hidden"] += saved_input(recipe, tokens, f) - product


def _fp8_gather_on(work, layout) -> bool:
    return bool(work.fp8_allgather and work.precision == "fp8" and layout.zero == 3)


def fp8_gather_terms(work, layout, dense: float, moe: float, kv_heads: int
                     ) -> tuple[float, float]:
    """(elements, weights) of this rank's FP8-linear weights that ZeRO-3 gathers in FP8 with
    parallel.fp8_allgather, over `dense` dense and `moe` MoE layers on this pipeline rank;
    `kv_heads`: the k/v heads one tp rank holds. Every layer's q, k, v and o (over tp), a dense
    layer's MLP linears (over tp) and a MoE layer's shared expert (whole on every tp rank, as
    its block runs: plan/model_states.py). Not the routed experts (`fp8_expert_gather_terms`),
    the router, the shared expert's gate, the head, norms or embedding. The weights count the
    fp32 amaxes of the step's one all_reduce(max) that sets their scales."""
    mc = work.model
    if not _fp8_gather_on(work, layout):
        return 0.0, 0.0
    h, d, t = mc.hidden_size, mc.dim_per_head, layout.tp
    attn = 2 * h * mc.num_heads * d / t + 2 * h * kv_heads * d  # q, o; k, v
    linears = 3 if mc.mlp == "swiglu" else 2
    mlp = linears * h * mc.intermediate_size / t
    shared = mc.shared_expert_intermediate_size if mc.num_experts else 0
    elements = (dense + moe) * attn + dense * mlp + moe * linears * h * shared
    weights = 4 * (dense + moe) + linears * (dense + (moe if shared else 0))
    if getattr(work, "fp8_scaling", "dynamic") == "delayed":
        weights = 0.0  # scales from the amax histories: no all-reduce after the first step
    return elements, weights


def fp8_expert_gather_terms(work, layout, elements: float, moe: float) -> tuple[float, float]:
    """(elements, weights) of this rank's routed-expert weights that ZeRO-3 gathers in FP8
    with parallel.fp8_allgather: all its `elements` expert weight elements (w_gate, w_up and
    w_down of the E/ep local experts of the `moe` MoE layers), and one fp32 amax per expert's
    weight (3 per local expert and layer) in the step's amax all_reduce(max): the engine's
    per-expert loop casts each expert's weight tensorwise (parallel/zero3_fp8.py)."""
    if not _fp8_gather_on(work, layout) or not work.model.num_experts:
        return 0.0, 0.0
    return elements, 3 * moe * work.model.num_experts / layout.ep


def delayed_amax_records(work, layers: float) -> float:
    """The fp32 amax records delayed scaling (train.fp8_scaling = delayed, lowp/delayed.py)
    reduces in its one all_reduce(max) over every rank a step: x, W and ∂y of every FP8
    linear of the `layers` (q, k, v, o and the MLP's, a tp shard each; delayed scaling runs
    without pp and routed experts). A train.fp8_keep_out linear records nothing; this still
    counts it (a few bytes)."""
    if work.precision != "fp8" or getattr(work, "fp8_scaling", "dynamic") != "delayed":
        return 0.0
    linears = 4 + (3 if work.model.mlp == "swiglu" else 2)
    return 3 * linears * layers


def expert_cast_bytes(recipe: str, rows: float, experts: float, h: int, inter: int,
                      dtype_bytes: int = 2) -> dict[str, tuple[float, float]]:
    """HBM bytes (read + written) one MoE layer's FP8 routed experts (lowp/experts.py) spend
    beyond the bf16 grouped matmul's kernels, forward and backward: `rows` routed token
    copies spread evenly over `experts` experts (SwiGLU: gate and up h -> inter, down
    inter -> h). {"casts": (fwd, bwd), "loop": (fwd, bwd)}: the cast kernels' bytes, and
    the per-expert loop's own copies (its output's cat, the weight gradients' stack).

    With A_f = rows·(h + inter) (x, shared by gate and up, and down's input), A_b =
    rows·(h + 2·inter) (the three output gradients), W = 3·experts·h·inter, a cast reads
    B = 2 bytes and writes 1 per element (the fused casts, lowp/fused.py, numerics/fp8_cast.py):
      rowwise (grouped): along K, fwd A_f and W, bwd A_b; along the tokens per group (or
        along N for Wᵀ), fwd A_f, bwd A_b and W; plus 4 bytes per row scale and per
        (group, column) scale;
      tensorwise (loop): an amax pass (reads B) and a cast pass per operand, each expert's
        W cast again for Wᵀ; x and ∂y write their transposed codes too (1 byte);
      blockwise (loop): W in 128x128 blocks twice (W, Wᵀ), 4 bytes a block; x and ∂y in
        1x128 tiles with their transposed tiles: 4 bytes and two scales per 128;
      rowwise_gw_hp (loop): rowwise's casts along K, and Wᵀ tensorwise (amax + cast);
      the loop (all but rowwise): cat of the outputs (fwd) and of the input gradients (bwd),
        stack of the weight gradients (bwd): read + write B per element.
    Left out: the amax kernel's partials (a few bytes per 64x64 tile) and a grouped cast's
    padding of a group to 16 tokens (none when the groups are multiples of 16).
    tests/test_plan_fp8_experts.py holds this to the trace of the engine's experts
    (bench/fp8/fp8_experts_trace.py's kernels)."""
    n, e, b = rows, experts, dtype_bytes
    a_f, a_b, w = n * (h + inter), n * (h + 2 * inter), 3 * e * h * inter
    cast = b + 1
    loop = (b * 2 * n * h, b * 2 * n * h + 2 * b * w)
    row_f = cast * (a_f + w) + SCALE_BYTES * (2 * n + e * (2 * inter + h))
    row_b = cast * a_b + SCALE_BYTES * 3 * n
    if recipe == "rowwise":
        cols_f = cast * a_f + SCALE_BYTES * e * (h + inter)
        cols_b = cast * (a_b + w) + SCALE_BYTES * e * (h + 2 * inter + 2 * h + inter)
        return {"casts": (row_f + cols_f, row_b + cols_b), "loop": (0.0, 0.0)}
    if recipe == "tensorwise":
        passes = b + cast  # the amax pass reads, the cast pass reads and writes
        return {"casts": (passes * (a_f + w) + a_f, passes * (a_b + w) + a_b), "loop": loop}
    if recipe == "blockwise":
        blocks = cast * w + SCALE_BYTES * w / 128 ** 2
        tiles = cast + 1 + 2 * SCALE_BYTES / 128
        return {"casts": (blocks + tiles * a_f, blocks + tiles * a_b), "loop": loop}
    if recipe == "rowwise_gw_hp":
        return {"casts": (row_f, row_b + (b + cast) * w), "loop": loop}
    raise ValueError(f"unknown FP8 recipe '{recipe}'")
