"""The planner's FP8 routed experts (plan/fp8.py `expert_cast_bytes`, plan/timing.py): the
bytes of their casts and of the per-expert loop's copies, against the trace of the engine's
experts (lowp/experts.py) on the meta device as an sm90 GPU runs them
(bench/fp8/fp8_experts_trace.py's trace), forward alone and forward + backward, per recipe.

Error model: the planner counts each cast's codes (reads 2 bytes, writes 1 per element, 1
more for a transposed copy) and its scales, exactly; it leaves out the tensorwise amax
kernel's partials, one fp32 per 64x64 tile written and read once: 8 bytes per 4096
elements against the 5 bytes per element of an amax pass and a cast, so at most 8/4096/5 =
3.9e-4 of the casts' bytes. Tolerance 4e-4 relative for every recipe (rowwise, blockwise
and the loop's copies are exact here: measured 0). Delayed tensorwise scaling (its steady
state: every history row filled, as a trace on meta sees it) has no amax pass: the
planner counts its history reads, tile amaxes and folds exactly, so it is held to 0.
"""

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from fivefold.lowp.convert import convert_to_fp8
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.moe import GroupedExperts
from fivefold.models.presets import preset
from fivefold.plan.fp8 import HISTORY_LEN, expert_cast_bytes, rank_dense_cast_bytes
from fivefold.plan.fp8_linears import uniform_fp8_linears
from fivefold.plan.hardware import get_hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.timing import rank_compute
from fivefold.trace import trace_callable

TOL = 4e-4
SHAPES = {"mixtral": (8, 8192, 4096, 14336), "small": (4, 1024, 512, 1024)}
RECIPES = ("tensorwise", "tensorwise_delayed", "rowwise", "blockwise", "rowwise_gw_hp")


def _recipe(name):
    if name == "tensorwise_delayed":  # the planner's history length (HISTORY_LEN)
        return FP8Recipe.from_name("tensorwise", scaling="delayed", history_len=HISTORY_LEN)
    if name == "rowwise_gw_hp":
        return FP8Recipe.from_name(name)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "fp8"))
    import fp8_experts_trace as bench  # the sm90 GPU's blockwise GEMM, as the bench traces

    return bench.recipe_for(name)


def traced(shape, name, backward):
    """{"casts": bytes, "loop": bytes} of the traced kernels: the FP8 cast kernels (with the
    amax passes, and delayed scaling's folds of the casts' amaxes into the pending records),
    and the loop's cat and stack."""
    experts, tokens, hidden, inter = shape
    with torch.device("meta"):
        module = GroupedExperts(experts, hidden, inter).to(torch.bfloat16)
    x = torch.empty(tokens, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(tokens, hidden, device="meta", dtype=torch.bfloat16)
    counts = torch.full((experts,), tokens // experts)
    module.use_grouped_mm(x)
    convert_to_fp8(module, _recipe(name))
    run = (lambda: module(x, counts).backward(g)) if backward else (lambda: module(x, counts))
    out = defaultdict(int)
    for e in trace_callable(run, gpu="h100").events:
        if e.kind != "kernel":
            continue
        if any(op in e.name for op in ("fp8_cast", "fp8_amax_partials", "fp8_amax_fold")):
            out["casts"] += e.bytes_read + e.bytes_written
        elif e.name in ("aten.cat.default", "aten.stack.default"):
            out["loop"] += e.bytes_read + e.bytes_written
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", RECIPES)
def test_planned_expert_cast_bytes_match_the_trace(shape, name):
    experts, tokens, hidden, inter = SHAPES[shape]
    scaling = "delayed" if name.endswith("_delayed") else "dynamic"
    planned = expert_cast_bytes(name.removesuffix("_delayed"), tokens, experts, hidden, inter,
                                scaling=scaling)
    fwd, both = traced(SHAPES[shape], name, False), traced(SHAPES[shape], name, True)
    assert fwd["casts"] > 0 and both["casts"] > fwd["casts"]
    tol = 0 if scaling == "delayed" else TOL
    for part in ("casts", "loop"):
        f, b = planned[part]
        for want, got in ((fwd[part], f), (both[part], f + b)):
            assert abs(got - want) <= tol * want, (part, got, want)
    assert (both["loop"] == 0) == (name == "rowwise")  # rowwise is grouped: no loop


@pytest.mark.parametrize("keep_out", ("", "layers.0.mlp.experts,layers.1.mlp.experts"))
def test_expert_casts_enter_the_predicted_step(keep_out):
    """The cast bytes go into a micro-batch's forward and backward at the HBM rate: between
    two recipes the forward and backward differ by exactly their bytes' difference, the
    experts' and the dense linears' (attention; tests/test_plan_fp8_dense.py) (the GEMMs
    run at the same peaks for both). Routed experts that train.fp8_keep_out leaves in bf16
    cast nothing: only the other layers' experts count."""
    model = preset("mixtral-8x7b")
    hw, assume = get_hardware("h100")
    layout = Layout(dp=8, ep=8, mbs=1)
    per, dense = {}, {}
    for name in ("tensorwise", "rowwise"):
        work = Workload(model=model, seq_len=4096, gbs=64, precision="fp8", fp8_recipe=name,
                        fp8_keep_out=keep_out)
        per[name] = rank_compute(work, layout, hw, assume, 0)
        dense[name] = rank_dense_cast_bytes(work, layout, 4096, uniform_fp8_linears(
            model, model.num_layers, model.num_moe_layers))
    rows = 4096 * model.experts_top_k
    moe = model.num_moe_layers - (2 if keep_out else 0)  # the layers with FP8 experts
    hbm = hw.hbm_tbps * 1e12 * assume.hbm_efficiency / (1 + assume.compute_overhead)
    b = {name: expert_cast_bytes(name, rows, model.num_experts / 8, model.hidden_size,
                                 model.moe_intermediate_size) for name in per}
    for i, phase in enumerate(("forward", "backward")):
        diff = sum(b["tensorwise"][p][i] - b["rowwise"][p][i] for p in ("casts", "loop"))
        d_dense = dense["tensorwise"][i] - dense["rowwise"][i]
        got = getattr(per["tensorwise"], phase) - getattr(per["rowwise"], phase)
        assert diff > 0 and d_dense != 0
        assert got == pytest.approx((moe * diff + d_dense) / hbm, rel=1e-9)


def test_kept_out_experts_run_their_gemms_at_bf16():
    """Each layer's routed experts kept out of FP8 add the same GEMM time (their FLOPs at
    bf16's rate instead of FP8's): 2 of 32 layers' experts add 1/16 of what all 32 add,
    which is (fp8/bf16 peak - 1) times the routed experts' FP8 GEMM time."""
    model = preset("mixtral-8x7b")
    hw, assume = get_hardware("h100")
    layout = Layout(dp=8, ep=8, mbs=1)
    gemm = {keep: rank_compute(Workload(model=model, seq_len=4096, gbs=64, precision="fp8",
                                        fp8_recipe="rowwise", fp8_keep_out=keep),
                               layout, hw, assume, 0).gemm_fwd
            for keep in ("", "layers.0.mlp.experts,layers.1.mlp.experts", "experts")}
    two = gemm["layers.0.mlp.experts,layers.1.mlp.experts"] - gemm[""]
    every = gemm["experts"] - gemm[""]
    assert two > 0 and two == pytest.approx(every * 2 / 32, rel=1e-9)


def test_delayed_expert_casts_enter_the_predicted_step():
    """train.fp8_scaling = delayed: the step's forward and backward differ from dynamic
    tensorwise's by exactly the experts' and the dense linears' cast bytes at the HBM rate
    (no amax pass: less time)."""
    model = preset("mixtral-8x7b")
    hw, assume = get_hardware("h100")
    layout = Layout(dp=8, ep=8, mbs=1)
    linears = uniform_fp8_linears(model, model.num_layers, model.num_moe_layers)
    rows, experts = 4096 * model.experts_top_k, model.num_experts / 8
    per, cast = {}, {}
    for scaling in ("dynamic", "delayed"):
        work = Workload(model=model, seq_len=4096, gbs=64, precision="fp8",
                        fp8_recipe="tensorwise", fp8_scaling=scaling)
        per[scaling] = rank_compute(work, layout, hw, assume, 0)
        e = expert_cast_bytes("tensorwise", rows, experts, model.hidden_size,
                              model.moe_intermediate_size, scaling=scaling)
        d = rank_dense_cast_bytes(work, layout, 4096, linears)
        cast[scaling] = [model.num_moe_layers * (e["casts"][i] + e["loop"][i]) + d[i]
                         for i in range(2)]
    hbm = hw.hbm_tbps * 1e12 * assume.hbm_efficiency / (1 + assume.compute_overhead)
    for i, phase in enumerate(("forward", "backward")):
        want = (cast["dynamic"][i] - cast["delayed"][i]) / hbm
        got = getattr(per["dynamic"], phase) - getattr(per["delayed"], phase)
        assert want > 0 and got == pytest.approx(want, rel=1e-9)
