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
all-reduce, `delayed_amax_records`). A train.fp8_keep_out linear is no FP8 linear to any
term here: the terms take the rank's counts of FP8 linears (plan/fp8_linears.py), so it
gathers in bf16, casts nothing and records no amax.

Time: the fused cast kernels' HBM bytes (read + written), which plan/timing.py adds to a
micro-batch at the HBM rate: the dense linears' (`cast_bytes` per operand,
`rank_dense_cast_bytes` per pipeline rank) and the routed experts' (`expert_cast_bytes`),
each held to the meta trace of the engine (tests/test_plan_fp8_dense.py,
tests/test_plan_fp8_experts.py); under parallel.fp8_allgather ZeRO-3's FP8 gathers in place
of the weights' casts (`rank_gather_cast_bytes`; tests/test_plan_fp8_gather_casts.py).
"""

from __future__ import annotations

import functools
import math

from fivefold.plan.fp8_linears import FP8Linears

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
                    f: float, dtype_bytes: int, swiglu: bool, qkv_tokens: float,
                    linears: FP8Linears | None = None) -> None:
    """Rewrite a dense layer's recompute = none terms (plan/activations.py) in place.
    `qkv_tokens`: the rows of the column linears' saved input (all T under SP).
    rowwise_gw_hp saves its input in the compute dtype, as bf16 does (its weight gradient
    is a bf16 GEMM of that input): the terms stay as they are. `linears`: the layer's FP8
    linears (plan/fp8_linears.py; None: all): a train.fp8_keep_out linear saves its input
    as bf16 does, beside the FP8 copy where another reader of that input is FP8."""
    if recipe == "rowwise_gw_hp":
        return
    n = linears or FP8Linears(1, 1, 1, 1, 1, int(swiglu), 1, 1, 1)
    up = 2 if swiglu else 1
    for term, fp8, bf16 in (("qkv_input", n.qkv_input, n.q + n.k + n.v < 3),
                            ("mlp_input", n.mlp_input, n.gate + n.up < up)):
        terms[term] = ((terms[term] if bf16 else 0.0)
                       + (saved_input(recipe, qkv_tokens, h) if fp8 else 0.0))
    if n.o:
        terms["attn_out"] = saved_input(recipe, tokens, q)
    product = tokens * f * dtype_bytes
    if swiglu and n.down:
        terms["mlp_hidden"] += saved_input(recipe, tokens, f) - product


def _fp8_gather_on(work, layout) -> bool:
    return bool(work.fp8_allgather and work.precision == "fp8" and layout.zero == 3)


def fp8_gather_terms(work, layout, linears: FP8Linears, kv_heads: int
                     ) -> tuple[float, float]:
    """(elements, weights) of this rank's FP8-linear weights that ZeRO-3 gathers in FP8 with
    parallel.fp8_allgather, `linears`: the FP8 linears of the rank's layers
    (plan/fp8_linears.py); `kv_heads`: the k/v heads one tp rank holds. q, k, v and o (over
    tp), a dense layer's MLP linears (over tp) and a MoE layer's shared expert (whole on
    every tp rank, as its block runs: plan/model_states.py). Not the routed experts
    (`fp8_expert_gather_terms`), the router, the shared expert's gate, the head, norms,
    embedding or a kept-out linear. The weights count the fp32 amaxes of the step's one
    all_reduce(max) that sets their scales."""
    mc, n = work.model, linears
    if not _fp8_gather_on(work, layout):
        return 0.0, 0.0
    h, d, t = mc.hidden_size, mc.dim_per_head, layout.tp
    elements = (h * mc.num_heads * d / t * (n.q + n.o) + h * kv_heads * d * (n.k + n.v)
                + h * mc.intermediate_size / t * (n.gate + n.up + n.down)
                + h * mc.shared_expert_intermediate_size * (n.shared_gate + n.shared_up
                                                            + n.shared_down))
    weights = n.linears
    if getattr(work, "fp8_scaling", "dynamic") == "delayed":
        weights = 0.0  # scales from the amax histories: no all-reduce after the first step
    return elements, weights


def fp8_expert_gather_terms(work, layout, elements: float, moe: float) -> tuple[float, float]:
    """(elements, weights) of this rank's routed-expert weights that ZeRO-3 gathers in FP8
    with parallel.fp8_allgather: all its `elements` expert weight elements (w_gate, w_up and
    w_down of the E/ep local experts of the `moe` MoE layers), and one fp32 amax per expert's
    weight (3 per local expert and layer) in the step's amax all_reduce(max): the engine's
    per-expert loop casts each expert's weight tensorwise (parallel/zero3_fp8.py); none
    under delayed scaling, whose scales come from the experts' histories after the first
    step (as `fp8_gather_terms`' linears')."""
    if not _fp8_gather_on(work, layout) or not work.model.num_experts:
        return 0.0, 0.0
    if getattr(work, "fp8_scaling", "dynamic") == "delayed":
        return elements, 0.0
    return elements, 3 * moe * work.model.num_experts / layout.ep


def delayed_amax_records(work, linears) -> float:
    """The fp32 elements delayed scaling (train.fp8_scaling = delayed, lowp/delayed.py)
    reduces in its one all_reduce(max) a step over the ranks of one pipeline stage (dp x cp
    x tp; the `stage` group, every rank without pp), for the FP8 linears of the rank's
    layers (`linears`, plan/fp8_linears.py `FP8Linears`; under pp the rank's chunks' layers
    only, each stage reducing its own; a train.fp8_keep_out linear is none of them): x, W
    and ∂y of every FP8 linear (q, k, v, o and a dense layer's MLP or a MoE layer's shared
    expert, a tp shard each) and, per MoE layer with FP8 routed experts, of every expert's
    three projections, each with a flag of whether the rank recorded it (all E experts'
    even under ep, where a rank fills its own experts' rows: `_expert_block`)."""
    if work.precision != "fp8" or getattr(work, "fp8_scaling", "dynamic") != "delayed":
        return 0.0
    return 3 * linears.linears + 2 * 9 * work.model.num_experts * linears.experts


def expert_cast_bytes(recipe: str, rows: float, experts: float, h: int, inter: int,
                      dtype_bytes: int = 2, gathered: bool = False, scaling: str = "dynamic"
                      ) -> dict[str, tuple[float, float]]:
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
        delayed scaling (train.fp8_scaling = delayed; lowp/delayed.py, each expert's
        projections with their own histories): each expert's casts are a delayed FP8
        linear's (`cast_bytes`: no amax pass; the history read, the 64x64 tiles' amaxes
        written and folded), over its rows/experts tokens: in forward x (gate's cast, which
        up shares: lowp/linear.py `_quantized_input`), down's input and the three W; in
        backward the three ∂y and the three Wᵀ (not folded);
      blockwise (loop): W in 128x128 blocks twice (W, Wᵀ), 4 bytes a block; x and ∂y in
        1x128 tiles with their transposed tiles: 4 bytes and two scales per 128;
      rowwise_gw_hp (loop): rowwise's casts along K, and Wᵀ tensorwise (amax + cast);
      the loop (all but rowwise): cat of the outputs (fwd) and of the input gradients (bwd),
        stack of the weight gradients (bwd): read + write B per element.
    gathered (parallel.fp8_allgather, tensorwise): each expert's W is ZeRO-3's gathered codes
      (`rank_gather_cast_bytes`), not cast in the loop; its Wᵀ a copy of them (2 per element);
      under delayed scaling each expert's weight folds its gathered record in forward
      (RECORD_FOLD bytes, every local expert's, as the linears' `_linears_cast_bytes`).
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
    if recipe == "tensorwise" and scaling == "delayed":
        casts = _linears_cast_bytes(recipe, n / e, [(inter, h)] * 2 + [(h, inter)],
                                    [h, inter], [inter, inter, h], b, scaling, gathered)
        return {"casts": (e * casts[0], e * casts[1]), "loop": loop}
    if recipe == "tensorwise":
        passes = b + cast  # the amax pass reads, the cast pass reads and writes
        w_f, w_b = (0.0, 2 * FP8_BYTES * w) if gathered else (passes * w, passes * w)
        return {"casts": (passes * a_f + w_f + a_f, passes * a_b + w_b + a_b), "loop": loop}
    if recipe == "blockwise":
        blocks = cast * w + SCALE_BYTES * w / 128 ** 2
        tiles = cast + 1 + 2 * SCALE_BYTES / 128
        return {"casts": (blocks + tiles * a_f, blocks + tiles * a_b), "loop": loop}
    if recipe == "rowwise_gw_hp":
        return {"casts": (row_f, row_b + (b + cast) * w), "loop": loop}
    raise ValueError(f"unknown FP8 recipe '{recipe}'")


ROW_PROGRAM = 32  # the row cast's programs: column partial amaxes per 32 rows (fp32)
FOLD_TILE = 64  # delayed scaling's cast records one fp32 amax per 64x64 tile
HISTORY_LEN = 16  # train.fp8_history_len's default: the history a delayed cast reads


def cast_bytes(recipe: str, role: str, rows: float, cols: float, dtype_bytes: int = 2,
               scaling: str = "dynamic") -> float:
    """HBM bytes (read + written) of the fused cast kernels (lowp/fused.py,
    numerics/fp8_cast.py) for one (rows, cols) operand of an FP8 linear in the compute dtype
    (B bytes): role "act" (x in forward, ∂y in backward: its codes along K and the
    transposed copy the weight gradient takes), "weight_fwd" (W) or "weight_bwd" (W again
    for the input gradient: not saved in FP8). S = rows·cols; a cast pass reads B·S and
    writes 1 byte per element per copy; an amax pass reads B·S:
      tensorwise   amax + cast: act 2B·S + 2S, a weight 2B·S + S; 4 bytes of scale;
        delayed scaling (train.fp8_scaling): no amax pass; the cast reads the history
        (HISTORY_LEN fp32) and records each 64x64 tile's amax, which a fold kernel reads
        into the step's pending record (4 bytes read, 4 written; not for W's backward
        cast, whose amax the forward folded);
      rowwise      act: a row cast (B·S + S, 4 per row) leaving each column's amax per 32
        rows (fp32), which the column cast reads with x (B·S) to write xᵀ (S, 4 per
        column); a weight: a row cast of W (forward) or of the view Wᵀ (backward);
      rowwise_gw_hp  act: the row cast alone (the weight gradient is a bf16 GEMM of the
        saved input); W: a row cast forward, tensorwise (amax + cast) backward, its one
        scale repeated per row of Wᵀ (4 + 4·cols: _scaled_mm takes both operands rowwise);
      blockwise    act: one pass writing the 1x128 tiles of x and of xᵀ (2S, 4 bytes per
        tile each); a weight: 128x128 blocks of W or Wᵀ (S, 4 bytes per block).
    Left out: the tensorwise amax partials (<= 256 fp32 written and read per amax pass,
    numerics/fp8_cast.py MAX_PARTIALS) and blockwise's padding of the weight's block scales
    to a multiple of 4 columns for cuBLASLt (none when the widths are multiples of 512).
    tests/test_plan_fp8_dense.py holds this to the trace of the engine's FP8 linear."""
    b, s, c = dtype_bytes, rows * cols, cols
    copies = 2 if role == "act" else 1
    if recipe == "tensorwise":
        if scaling == "delayed":
            tiles = SCALE_BYTES * math.ceil(rows / FOLD_TILE) * math.ceil(cols / FOLD_TILE)
            cast = b * s + SCALE_BYTES * HISTORY_LEN + copies * s + SCALE_BYTES + tiles
            if role == "weight_bwd":  # W's amax was folded into the record in forward
                return cast
            return cast + tiles + 2 * SCALE_BYTES  # the fold: tiles and pending in, pending out
        return 2 * b * s + copies * s + SCALE_BYTES
    if recipe == "rowwise":
        if role == "act":
            partials = SCALE_BYTES * c * math.ceil(rows / ROW_PROGRAM)
            return (b + 1) * s * 2 + SCALE_BYTES * (rows + c) + 2 * partials
        return (b + 1) * s + SCALE_BYTES * (rows if role == "weight_fwd" else c)
    if recipe == "rowwise_gw_hp":
        if role == "weight_bwd":
            return 2 * b * s + s + SCALE_BYTES + SCALE_BYTES * (1 + c)
        return (b + 1) * s + SCALE_BYTES * rows
    if recipe == "blockwise":
        if role == "act":
            tiles = rows * math.ceil(c / 128) + c * math.ceil(rows / 128)
            return (b + 2) * s + SCALE_BYTES * tiles
        return (b + 1) * s + SCALE_BYTES * math.ceil(rows / 128) * math.ceil(c / 128)
    raise ValueError(f"unknown FP8 recipe '{recipe}'")


def linear_cast_bytes(recipe: str, tokens: float, k: float, n: float, dtype_bytes: int = 2,
                      scaling: str = "dynamic") -> tuple[float, float]:
    """(forward, backward) cast bytes of one FP8 linear (tokens, k) -> (tokens, n):
    x and W in forward; W again and ∂y in backward (`cast_bytes`)."""
    def one(role, rows, cols):
        return cast_bytes(recipe, role, rows, cols, dtype_bytes, scaling)
    return (one("act", tokens, k) + one("weight_fwd", n, k),
            one("weight_bwd", n, k) + one("act", tokens, n))


GATHER_CAST = 1  # + B per shard element: ZeRO-3's FP8 gather's cast (`gather_bytes`)
GATHER_UNPACK = 2  # + B per gathered element: its unpack


def gather_bytes(elements: float, shards: float, dtype_bytes: int = 2) -> float:
    """HBM bytes (read + written) of one ZeRO-3 gather in FP8 (parallel.fp8_allgather,
    parallel/zero3_fp8.py) of `elements` weight elements sharded over `shards` ranks, beside
    the bf16 gather's (which writes the unit's buffer directly), as a GPU runs it: one fused
    kernel each way per unit (numerics/fp8_gather.py). `fp8_gather_pack` reads the rank's
    1/shards of the weights and writes their codes into the message: B + 1 per shard
    element; `fp8_gather_unpack` reads every gathered code and writes it to the unit's byte
    buffer and its dequantised value to the unit's buffer: 2 + B per element. (The CPU's
    eager torch ops move B + 28 and 19 + 3B; the planner plans GPUs, as `cast_bytes` counts
    the fused casts.) Under delayed scaling the linear that takes a gathered weight folds its
    record (RECORD_FOLD bytes a weight a forward): counted with the linears' casts
    (`_linears_cast_bytes`), where the engine runs it. Left out: the kernels' tables (40
    bytes per piece), 4 bytes per weight of the multiplier and the scale reads, 16 of the
    scale and record clones, the messages' padding to the longest rank's, and a unit's
    other elements (norms) copied through the message (2B each way)."""
    b = dtype_bytes
    return elements / shards * (GATHER_CAST + b) + elements * (GATHER_UNPACK + b)


def fp8_gathers(work, layout) -> tuple[float, float]:
    """ZeRO-3's FP8 gathers of a unit per micro-batch, (forward, backward): one for the
    forward and one again for the backward (parallel/zero3.py frees a unit after its
    forward); under a pipeline that keeps the gathered parameters (plan/comm.py
    `keeps_gathered`) one per step, 1/m of it per micro-batch. (0, 0) without
    parallel.fp8_allgather."""
    if not _fp8_gather_on(work, layout) or work.fp8_recipe != "tensorwise":
        return 0.0, 0.0
    if work.zero3_keep_gathered_pp and layout.pp > 1:
        return 1.0 / work.num_microbatches(layout), 0.0
    return 1.0, 1.0


# Delayed scaling with ZeRO-3's FP8 gather: a gathered weight's record (the amax of the
# rank's piece, parallel/zero3_fp8.py `GatheredWeight.record`) folds into the linear's
# pending W record in each forward (lowp/delayed.py `record_gathered`: one aten.maximum of
# two fp32 scalars into the first, 12 bytes read and 4 written as the trace counts it:
# tests/test_plan_fp8_gather_casts.py). Per weight tensor (an expert's slice is one), not
# per element.
RECORD_FOLD = 16


def _linears_cast_bytes(recipe: str, tokens: float, weights: list, acts_f: list,
                       acts_b: list, dtype_bytes: int, scaling: str, gathered: bool = False
                       ) -> tuple[float, float]:
    def one(role, rows, cols):
        if gathered and role.startswith("weight"):  # the FP8 codes ZeRO-3 gathered: no
            # cast; the input gradient's Wᵀ is a contiguous copy of them (numerics/fp8.py
            # FP8Tensor.t), 1 byte read and 1 written per element; delayed scaling folds
            # the gathered record in forward
            if role == "weight_bwd":
                return 2 * FP8_BYTES * rows * cols
            return RECORD_FOLD if scaling == "delayed" else 0.0
        return cast_bytes(recipe, role, rows, cols, dtype_bytes, scaling)
    fwd = sum(one("act", tokens, c) for c in acts_f) + sum(one("weight_fwd", *w)
                                                            for w in weights)
    bwd = sum(one("act", tokens, c) for c in acts_b) + sum(one("weight_bwd", *w)
                                                            for w in weights)
    return fwd, bwd


def mlp_cast_bytes(recipe: str, tokens: float, h: int, f: float, swiglu: bool,
                   dtype_bytes: int = 2, scaling: str = "dynamic", gathered: bool = False
                   ) -> tuple[float, float]:
    """(forward, backward) cast bytes of an MLP of width f (per rank): gate and up (SwiGLU;
    one cast of their common input) or up, and down; every linear in FP8 (a rank's layers:
    `rank_dense_cast_bytes`). `gathered`: weights gathered in FP8 (`_linears_cast_bytes`)."""
    up = 2 if swiglu else 1
    return _linears_cast_bytes(recipe, tokens, [(f, h)] * up + [(h, f)], [h, f],
                               [f] * up + [h], dtype_bytes, scaling, gathered)


def rank_dense_cast_bytes(work, layout, tokens: float, linears: FP8Linears
                          ) -> tuple[float, float]:
    """(forward, backward) bytes of the dense FP8 linears' casts of one micro-batch of
    `tokens` on a pipeline rank whose layers hold `linears` (plan/fp8_linears.py): the
    attention linears and a dense layer's MLP (over tp), a MoE layer's shared expert
    (whole, as its block runs), each one's weight and ∂y, and the inputs they share cast
    once (q, k and v's if any of them is FP8, gate and up's likewise, o's and down's own).
    A train.fp8_keep_out linear casts nothing. The routed experts are `expert_cast_bytes`'.
    Delayed scaling at its steady state (its first step adds an amax pass per operand).
    Under parallel.fp8_allgather the weights' casts are their FP8 gathers' instead
    (`rank_gather_cast_bytes`), and their backward's Wᵀ a copy of the gathered codes."""
    if work.precision != "fp8":
        return 0.0, 0.0
    mc, t, n = work.model, layout.tp, linears
    d = mc.dim_per_head
    table = _kind_cast_bytes(work.fp8_recipe, getattr(work, "fp8_scaling", "dynamic"), tokens,
                             mc.hidden_size, mc.num_heads * d / t, mc.num_kv_heads * d / t,
                             mc.intermediate_size / t, mc.shared_expert_intermediate_size,
                             work.dtype_bytes, fp8_gathers(work, layout) != (0.0, 0.0))
    counts = (n.q, n.k, n.v, n.o, n.qkv_input, n.o, n.gate, n.up, n.down, n.mlp_input, n.down,
              n.shared_gate, n.shared_up, n.shared_down, n.shared_input, n.shared_down)
    return (sum(c * fwd for c, (fwd, _) in zip(counts, table) if c),
            sum(c * bwd for c, (_, bwd) in zip(counts, table) if c))


@functools.lru_cache(maxsize=4096)
def _kind_cast_bytes(recipe: str, scaling: str, tokens: float, h: int, q: float, kv: float,
                     f: float, fs: float, b: int, g: bool) -> tuple:
    """(forward, backward) cast bytes of one linear of each kind (its W and ∂y: q, k, v, o,
    gate, up, down, the shared expert's three) and of each input cast once for the linears
    reading it (q, k and v's; o's; gate and up's; down's; the shared expert's two), in
    `rank_dense_cast_bytes`' order."""
    def linear(out, inp):
        return _linears_cast_bytes(recipe, tokens, [(out, inp)], [], [out], b, scaling, g)

    def inputs(channels):
        return _linears_cast_bytes(recipe, tokens, [], [channels], [], b, scaling, g)

    return (linear(q, h), linear(kv, h), linear(kv, h), linear(h, q), inputs(h), inputs(q),
            linear(f, h), linear(f, h), linear(h, f), inputs(h), inputs(f),
            linear(fs, h), linear(fs, h), linear(h, fs), inputs(h), inputs(fs))


def rank_gather_cast_bytes(work, layout, linears: FP8Linears, kv_heads: int,
                           expert_elements: float) -> tuple[float, float]:
    """(forward, backward) bytes per micro-batch of ZeRO-3's FP8 gathers (`gather_bytes`,
    `fp8_gathers`) on a pipeline rank whose layers hold `linears` (plan/fp8_linears.py):
    the FP8 linears' weights (`fp8_gather_terms`, sharded over dp·cp) and the FP8 routed
    experts' `expert_elements` (over dp·cp/ep: the edp group's ZeRO-3)."""
    gathers = fp8_gathers(work, layout)
    if gathers == (0.0, 0.0):
        return 0.0, 0.0
    b, shards = work.dtype_bytes, layout.dp * layout.cp
    dense = fp8_gather_terms(work, layout, linears, kv_heads)[0]
    experts = fp8_expert_gather_terms(work, layout, expert_elements, linears.experts)[0]
    one = gather_bytes(dense, shards, b) + gather_bytes(experts, shards / layout.ep, b)
    return gathers[0] * one, gathers[1] * one
