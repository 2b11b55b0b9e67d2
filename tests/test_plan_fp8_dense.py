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
from fivefold.plan.fp8_linears import uniform_fp8_linears
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


@pytest.mark.parametrize("name", ("tensorwise", "rowwise", "rowwise_gw_hp", "blockwise"))
def test_planned_layer_cast_bytes_match_a_traced_block(name):
    """One engine Block (models/llama.py: q, k, v, o, SwiGLU) converted to FP8, forward +
    backward on the meta device: its kernels other than the GEMMs move the bf16 Block's
    non-GEMM bytes plus the planner's per-layer cast bytes (`rank_dense_cast_bytes` of one
    layer): q, k and v cast their shared input once, as do gate and up. Left out as in the
    linear's test: <= 2 KiB of amax partials per amax pass, 2 x 7 weights + x, o's input,
    the MLP's two inputs and 7 ∂y = 25 passes for tensorwise, 7 (the weights' backward)
    for rowwise_gw_hp; every width a multiple of 512 (no block-scale padding)."""
    from fivefold.lowp.convert import convert_to_fp8
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
            convert_to_fp8(block, recipe)
        x = torch.empty(b, s, cfg.hidden_size, device="meta", dtype=torch.bfloat16,
                        requires_grad=True)
        cos = torch.empty(s, cfg.dim_per_head, device="meta")
        g = torch.empty_like(x, requires_grad=False)
        t = trace_callable(lambda: block(x, cos, cos).backward(g), gpu="h100")
        return sum(e.bytes_read + e.bytes_written for e in t.events
                   if e.kind == "kernel" and not e.flops)

    got = non_gemm_bytes(recipe_of(name)[0]) - non_gemm_bytes(None)
    work = Workload(model=cfg, seq_len=s, gbs=b, precision="fp8", fp8_recipe=name)
    planned = sum(rank_dense_cast_bytes(work, Layout(), b * s, uniform_fp8_linears(cfg, 1, 0)))
    slack = 2 * 4 * MAX_PARTIALS * {"tensorwise": 25, "rowwise_gw_hp": 7}.get(name, 0)
    assert 0 <= got - planned <= slack, (name, got, planned)
