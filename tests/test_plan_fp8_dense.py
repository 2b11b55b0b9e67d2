"""The planner's FP8 dense linears (plan/fp8.py `cast_bytes`, `linear_cast_bytes`): the
bytes of their cast kernels against the trace of the engine's FP8 linear
(lowp/linear.py `fp8_linear`) on the meta device as an H100 runs it (fivefold.trace, the
fused casts of lowp/fused.py), forward alone and forward + backward, per recipe, tensorwise
with dynamic and with delayed scaling (its steady state: every history row filled).

What the trace counts as the casts: every kernel of the linear that is not a GEMM (no
FLOPs): the amax, cast and fold kernels and the scales' small copies.

Error model: the planner counts each cast's codes, transposed copies, scales, the row
cast's column partials and delayed scaling's history reads and tile records exactly; it
leaves out (a) the tensorwise amax partials, at most MAX_PARTIALS = 256 fp32 written by
the amax pass and read by the cast: <= 2 KiB per amax pass (x and W in forward, W and ∂y
in backward; rowwise_gw_hp's Wᵀ in backward), and (b) blockwise's padding of the weight's
block scales to a multiple of 4 columns, none here (every width a multiple of 512). So
0 <= traced - planned <= 2 KiB x the amax passes, and the relative gap is printed by the
assertion when it fails.
"""

import dataclasses

import pytest
import torch

from fivefold.lowp.linear import fp8_linear
from fivefold.numerics.fp8_cast import MAX_PARTIALS
from fivefold.plan.fp8 import linear_cast_bytes
from fivefold.plan.fp8_linears import layers_fp8_linears, uniform_fp8_linears
from fivefold.trace import trace_callable
from tests.test_fp8_trace import recipe_of

# (tokens, in, out): a k/v projection of Llama-3.1-8B at 4096 tokens; its down projection
SHAPES = {"kv": (4096, 4096, 1024), "down": (2048, 14336, 4096)}
RECIPES = ("tensorwise", "tensorwise_delayed", "rowwise", "rowwise_gw_hp", "blockwise")
# amax passes (forward, forward + backward): each leaves <= 256 fp32 partials out
AMAX_PASSES = {"tensorwise": (2, 4), "rowwise_gw_hp": (0, 1)}


def traced_cast_bytes(shape, name, backward):
    """Bytes read + written by the linear's kernels other than its GEMMs, and the GEMMs'
    count (a fresh x each time: the linear caches an input's cast by identity)."""
    tokens, k, n = shape
    recipe, state = recipe_of(name)
    x = torch.empty(tokens, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(n, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(tokens, n, device="meta", dtype=torch.bfloat16)

    def run():
        y = fp8_linear(x, w, None, recipe, None, state)
        if backward:
            y.backward(g)

    events = [e for e in trace_callable(run, gpu="h100").events if e.kind == "kernel"]
    casts = sum(e.bytes_read + e.bytes_written for e in events if not e.flops)
    return casts, sum(1 for e in events if e.flops)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", RECIPES)
def test_planned_dense_cast_bytes_match_the_trace(shape, name):
    tokens, k, n = SHAPES[shape]
    scaling = "delayed" if name == "tensorwise_delayed" else "dynamic"
    fwd, bwd = linear_cast_bytes(name.removesuffix("_delayed"), tokens, k, n, 2, scaling)
    for i, (planned, backward) in enumerate(((fwd, False), (fwd + bwd, True))):
        got, gemms = traced_cast_bytes(SHAPES[shape], name, backward)
        assert gemms == (3 if backward else 1)
        slack = 2 * 4 * MAX_PARTIALS * AMAX_PASSES.get(name, (0, 0))[i]
        assert 0 <= got - planned <= slack, (name, backward, got, planned,
                                             (got - planned) / got)


def _compute(recipe, recompute="none", **work_options):
    from fivefold.models.presets import preset
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.timing import rank_compute

    hw, assume = get_hardware("h100")
    work = Workload(model=preset("llama-3.1-8b"), seq_len=4096, gbs=64, precision="fp8",
                    fp8_recipe=recipe, **work_options)
    layout = Layout(dp=4, tp=2, sp=True, mbs=1, recompute=recompute)
    hbm = hw.hbm_tbps * 1e12 * assume.hbm_efficiency / (1 + assume.compute_overhead)
    ratio = hw.peak_flops("fp8") / hw.peak_flops("bf16")
    return rank_compute(work, layout, hw, assume, 0), work, layout, hbm, ratio


def test_dense_casts_enter_the_predicted_step():
    """Between two recipes a dense model's forward and backward differ by exactly their
    dense cast bytes' difference at the HBM rate (the GEMMs at the same FP8 peak), and
    rowwise_gw_hp's backward also by its weight-gradient GEMMs at bf16's peak instead of
    FP8's (the forward GEMMs' time once more, times fp8/bf16 peak - 1)."""
    from fivefold.plan.fp8 import rank_dense_cast_bytes

    model_layers = 32
    rc, b, hbm = {}, {}, None
    for name in ("tensorwise", "rowwise", "rowwise_gw_hp"):
        rc[name], work, layout, hbm, ratio = _compute(name)
        b[name] = rank_dense_cast_bytes(work, layout, 4096,
                                        uniform_fp8_linears(work.model, model_layers, 0))
        assert b[name][0] > 0 and b[name][1] > 0
    gemm = rc["rowwise"].gemm_fwd
    for name, extra in (("tensorwise", 0.0), ("rowwise_gw_hp", gemm * (ratio - 1))):
        assert rc[name].gemm_fwd == gemm
        for i, phase in enumerate(("forward", "backward")):
            got = getattr(rc[name], phase) - getattr(rc["rowwise"], phase)
            want = (b[name][i] - b["rowwise"][i]) / hbm + (extra if i else 0.0)
            assert got == pytest.approx(want, rel=1e-9), (name, phase)
    assert ratio == pytest.approx(2.0, rel=1e-3)  # H100: 1978.9 and 989.4 dense TFLOP/s
    assert rc["rowwise_gw_hp"].backward > rc["rowwise"].backward


@pytest.mark.parametrize("name", ("tensorwise", "rowwise_gw_hp"))
def test_kept_out_linears_run_at_bf16_and_cast_nothing(name):
    """train.fp8_keep_out = "layers.0,*.o_proj" on Llama-3.1-8B (tp2): the kept-out
    linears' forward GEMM FLOPs (all of layer 0's, o_proj's in the other 31 layers) run at
    bf16's rate (fp8/bf16 peak times slower: the same thinness) and their casts leave the
    step: forward and backward differ from the all-FP8 plan by exactly those GEMMs' extra
    time and the cast bytes' difference at the HBM rate. (rowwise_gw_hp's weight-gradient
    GEMMs already run at bf16: a kept-out linear's backward slows by its input gradient's
    GEMM alone.)"""
    from fivefold.models.presets import preset
    from fivefold.plan.fp8 import rank_dense_cast_bytes
    from fivefold.plan.fp8_linears import rank_fp8_linears

    mc = preset("llama-3.1-8b")
    h, f, q, kv = mc.hidden_size, mc.intermediate_size, mc.q_size, mc.kv_size
    layer = 2 * (2 * h * q + 2 * h * kv + 3 * h * f)  # forward FLOPs per token
    kept = (layer + 31 * 2 * q * h) / (32 * layer)  # the kept-out share of the GEMM FLOPs
    rc, cast = {}, {}
    for keep_out in ("", "layers.0,*.o_proj"):
        rc[keep_out], work, layout, hbm, ratio = _compute(name, fp8_keep_out=keep_out)
        cast[keep_out] = rank_dense_cast_bytes(work, layout, 4096,
                                               rank_fp8_linears(work, layout, 0))
    plain, keep = rc[""], rc["layers.0,*.o_proj"]
    cast_keep, cast_all = cast["layers.0,*.o_proj"], cast[""]
    extra = plain.gemm_fwd * kept * (ratio - 1)
    assert keep.gemm_fwd == pytest.approx(plain.gemm_fwd + extra, rel=1e-9)
    assert cast_keep[0] < cast_all[0] and cast_keep[1] < cast_all[1]
    # backward: input gradient and weight gradient GEMMs, each the forward's FLOPs
    bwd_extra = extra * (1 if name == "rowwise_gw_hp" else 2)
    for i, (phase, gemms) in enumerate((("forward", extra), ("backward", bwd_extra))):
        got = getattr(keep, phase) - getattr(plain, phase)
        want = gemms + (cast_keep[i] - cast_all[i]) / hbm
        assert got == pytest.approx(want, rel=1e-9), phase


@pytest.mark.parametrize("recompute", ("full", "op"))
def test_recompute_casts_the_forward_again(recompute):
    """Full recomputation runs the forward's casts again in backward; per-operator
    recomputation those of the matmuls it re-runs (their FLOP share)."""
    from fivefold.plan.activations import op_sac_recomputed_matmul_share
    from fivefold.plan.fp8 import rank_dense_cast_bytes

    share = 1.0
    if recompute == "op":
        from fivefold.models.presets import preset

        share = op_sac_recomputed_matmul_share(preset("llama-3.1-8b"))
        assert 0 < share < 1
    d = {}
    for name in ("tensorwise", "rowwise"):
        rc, work, layout, hbm, _ = _compute(name, recompute)
        d[name] = (rc, rank_dense_cast_bytes(work, layout, 4096,
                                             uniform_fp8_linears(work.model, 32, 0)))
    got = d["tensorwise"][0].backward - d["rowwise"][0].backward
    (tf, tb), (rf, rb) = d["tensorwise"][1], d["rowwise"][1]
    assert got == pytest.approx((tb - rb + share * (tf - rf)) / hbm, rel=1e-9)


# train.fp8_keep_out patterns on one block: none; o_proj and down_proj (their inputs are
# then cast by nobody); q and gate (k and v still share one cast of x, up casts its own);
# k, v and up (q's and gate's casts alone)
BLOCK_KEEP_OUT = ("", "o_proj,down_proj", "q_proj,gate_proj", "k_proj,v_proj,up_proj")


@pytest.mark.parametrize("keep_out", BLOCK_KEEP_OUT)
@pytest.mark.parametrize("name", ("tensorwise", "rowwise", "rowwise_gw_hp", "blockwise"))
def test_planned_layer_cast_bytes_match_a_traced_block(name, keep_out):
    """One engine Block (models/llama.py: q, k, v, o, SwiGLU) converted to FP8 with the
    keep-out patterns, forward + backward on the meta device: its kernels other than the
    GEMMs move the bf16 Block's non-GEMM bytes plus the planner's per-layer cast bytes
    (`rank_dense_cast_bytes` of the layer's FP8 linears, plan/fp8_linears.py): q, k and v
    cast their shared input once if any of them is FP8, as do gate and up; a kept-out
    linear casts nothing. Left out as in the linear's test: <= 2 KiB of amax partials per
    amax pass, for tensorwise 3 per FP8 linear (W forward and backward, ∂y) and one per
    input cast (x, o's input, the MLP's two inputs): 25 with no keep-out; for rowwise_gw_hp
    one per FP8 linear (W's backward); every width a multiple of 512 (no block-scale
    padding)."""
    from fivefold.lowp.convert import convert_to_fp8, parse_keep_out
    from fivefold.models.llama import Block
    from fivefold.models.presets import preset
    from fivefold.plan.fp8 import rank_dense_cast_bytes
    from fivefold.plan.layout import Layout, Workload

    cfg = dataclasses.replace(preset("tiny"), hidden_size=1024, intermediate_size=2048,
                              num_heads=16, num_kv_heads=8)
    assert (cfg.q_size, cfg.kv_size, cfg.mlp) == (1024, 512, "swiglu")
    b, s = 2, 256

    def non_gemm_bytes(recipe):
        with torch.device("meta"):
            block = Block(cfg).to(torch.bfloat16)
        if recipe is not None:
            convert_to_fp8(block, recipe, parse_keep_out(keep_out))
        x = torch.empty(b, s, cfg.hidden_size, device="meta", dtype=torch.bfloat16,
                        requires_grad=True)
        cos = torch.empty(s, cfg.dim_per_head, device="meta")
        g = torch.empty_like(x, requires_grad=False)
        t = trace_callable(lambda: block(x, cos, cos).backward(g), gpu="h100")
        return sum(e.bytes_read + e.bytes_written for e in t.events
                   if e.kind == "kernel" and not e.flops)

    got = non_gemm_bytes(recipe_of(name)[0]) - non_gemm_bytes(None)
    work = Workload(model=cfg, seq_len=s, gbs=b, precision="fp8", fp8_recipe=name,
                    fp8_keep_out=keep_out)
    fp8 = layers_fp8_linears(work, 0, 1)
    assert fp8.linears == 7 - len(parse_keep_out(keep_out))
    planned = sum(rank_dense_cast_bytes(work, Layout(), b * s, fp8))
    inputs = fp8.qkv_input + fp8.o + fp8.mlp_input + fp8.down
    passes = {"tensorwise": 3 * fp8.linears + inputs, "rowwise_gw_hp": fp8.linears}
    slack = 2 * 4 * MAX_PARTIALS * passes.get(name, 0)
    assert 0 <= got - planned <= slack, (name, got, planned)
