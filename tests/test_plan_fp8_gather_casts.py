"""The planner's casts under parallel.fp8_allgather (plan/fp8.py `gather_bytes`,
`rank_gather_cast_bytes`, the `gathered` linears): against the trace on the meta device
(fivefold.trace) of the engine's gather (parallel/zero3_fp8.py FP8UnitGather `start` and
`finish`, one rank of four) and of an FP8 linear given its gathered weight (lowp/linear.py).
On meta the gather takes a GPU's path, the fused pack and unpack (numerics/fp8_gather.py),
as the linears take the fused casts (lowp/fused.py).

Error model: the trace's bytes are exactly the two kernels' (the shard read and its message
written; the gathered messages read, the byte buffer and the unit's buffer written), the
tables (40 bytes a row), the multiplier and scale reads (4 bytes each per weight) and the
scale and record clones (16 per weight). The planner counts weight elements only: it
leaves out the tables, the 24 bytes per weight, the messages' padding to the longest rank's
(read and written) and a segment's padding to a multiple of dp (a raw element of the last
rank's). So 0 <= traced - planned = those bytes, computed here from the unit.
"""

import types

import pytest
import torch

from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.numerics.formats import E4M3
from fivefold.numerics.fp8_cast import MAX_PARTIALS
from fivefold.parallel import zero3_fp8
from fivefold.parallel.zero3_fp8 import FP8UnitGather, GatheredWeight
from fivefold.plan.fp8 import cast_bytes, gather_bytes, linear_cast_bytes, mlp_cast_bytes
from fivefold.trace import trace_callable

DP = 4
# (out, in) weights of one unit: a k/v projection of Llama-3.1-8B; two whose shards cut
# them anywhere (sizes not multiples of dp's share); routed experts' stacked (E, N, K)
# weights (a scale per expert) beside a linear's
UNITS = {"kv": [(1024, 4096)], "odd": [(333, 517), (129, 77)],
         "experts": [(96, 64), (3, 55, 37), (3, 37, 55)]}


def meta_unit(weights, dp: int):
    """(rank 0's FP8UnitGather on the meta device of a unit holding `weights` over dp
    ranks, its (slot, module, name) triples, its weights' elements, its segment's size)."""
    slots, start = [], 0
    for shape in weights:
        numel = torch.Size(shape).numel()
        slots.append((types.SimpleNamespace(shape=shape, start=start, numel=numel),
                      torch.nn.Module(), "weight"))
        start += numel
    size = -(-start // dp) * dp  # the segment padded to a multiple of dp (odd sizes)
    seg = types.SimpleNamespace(size=size, start=0)
    layout = types.SimpleNamespace(shards=dp, segment_shard=lambda shard, seg: shard)
    unit = FP8UnitGather(layout, seg, slots, 0, torch.device("meta"), torch.bfloat16)
    return unit, slots, start, size


def traced_gather_bytes(weights, monkeypatch):
    """(bytes read + written by rank 0's FP8 gather of a unit holding `weights`, the unit,
    its weights' elements, its segment's size). The collective itself is the communication
    model's: replaced by a no-op."""
    monkeypatch.setattr(zero3_fp8.comm, "all_gather",
                        lambda out, send, group, async_op=False: zero3_fp8.comm.DONE)
    unit, slots, start, size = meta_unit(weights, DP)
    meta = torch.device("meta")
    shard = torch.empty(size // DP, dtype=torch.bfloat16, device=meta)
    full = torch.empty(size, dtype=torch.bfloat16, device=meta)
    events = [e for e in trace_callable(lambda: unit.start(full, shard, types.SimpleNamespace(
        size=DP)).wait(), gpu="h100").events if e.kind == "kernel"]
    ops = [e.name for e in events]
    # one fused kernel each way, and the scale and record clones (2 a weight: an expert's)
    assert ops.count("fivefold.fp8_gather_pack.default") == 1, ops
    assert ops.count("fivefold.fp8_gather_unpack.default") == 1, ops
    assert len(ops) == 2 + 2 * len(unit.entries), ops
    for slot, module, _ in slots:
        experts = len(slot.shape) == 3
        got = module.fp8_experts["weight"] if experts else [module.fp8_weight]
        assert len(got) == (slot.shape[0] if experts else 1)
        assert all(isinstance(w, GatheredWeight) for w in got)
    return sum(e.bytes_read + e.bytes_written for e in events), unit, start, size


@pytest.mark.parametrize("unit", UNITS)
def test_gather_bytes_match_the_traced_gather(unit, monkeypatch):
    got, gather, elements, size = traced_gather_bytes(UNITS[unit], monkeypatch)
    weights, per, message = len(gather.entries), size // DP, gather.message
    rows = len(gather.pack_rows) + len(gather.unpack_rows)
    # the kernels' bytes, B = 2: the shard read (B per element) and rank 0's message
    # written; the DP messages read, the byte buffer (1) and the unit's buffer (B) written
    kernels = 2 * per + message + DP * message + size + 2 * size
    assert got == kernels + 40 * rows + 24 * weights, (unit, got, kernels)
    planned = gather_bytes(elements, DP, 2)
    assert planned == elements / DP * 3 + elements * 4
    # what the planner leaves out: the messages' padding beyond the weights' codes (rank
    # 0's written, every rank's read), the segment's padding (pad raw elements: B read,
    # 1 + B written), rank 0's share of that padding, the tables and per-weight scalars
    pad = size - elements
    left_out = ((DP + 1) * message - elements - elements / DP + 3 * pad + 2 * pad / DP
                + 40 * rows + 24 * weights)
    assert got - planned == pytest.approx(left_out, abs=1e-6), (unit, got, planned)
    assert 0 <= got - planned <= 0.03 * planned + 2000, (unit, got, planned)


@pytest.mark.parametrize("shape", ((4096, 4096, 1024), (2048, 14336, 4096)))
def test_linear_with_a_gathered_weight_casts_its_activations_alone(shape):
    """fp8_linear given ZeRO-3's gathered codes, forward + backward: the activations' and
    ∂y's casts as without the gather, the weight's casts replaced by the copy of Wᵀ."""
    tokens, k, n = shape
    recipe = FP8Recipe.from_name("tensorwise")
    meta = torch.device("meta")
    x = torch.empty(tokens, k, device=meta, dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(n, k, device=meta, dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(tokens, n, device=meta, dtype=torch.bfloat16)
    wq = GatheredWeight(torch.empty(n, k, device=meta, dtype=E4M3.dtype),
                        torch.ones((), device=meta), "tensorwise", E4M3)

    def run():
        fp8_linear(x, w, None, recipe, wq).backward(g)

    events = [e for e in trace_callable(run, gpu="h100").events if e.kind == "kernel"]
    got = sum(e.bytes_read + e.bytes_written for e in events if not e.flops)
    assert sum(1 for e in events if e.flops) == 3
    fwd, bwd = linear_cast_bytes("tensorwise", tokens, k, n, 2)
    plain = fwd + bwd
    # the plain linear's W casts, forward and backward: amax + cast, 5 bytes an element
    weights = cast_bytes("tensorwise", "weight_fwd", n, k) + cast_bytes(
        "tensorwise", "weight_bwd", n, k)
    assert weights == 2 * (5 * n * k + 4)
    planned = plain - weights + 2 * n * k
    assert 0 <= got - planned <= 2 * 2 * 4 * MAX_PARTIALS, (got, planned)
    # and the planner's layer sums take the gathered linears so
    f1, b1 = mlp_cast_bytes("tensorwise", tokens, k, n, True, 2, "dynamic", True)
    f0, b0 = mlp_cast_bytes("tensorwise", tokens, k, n, True, 2)
    assert (f0 - f1, b0 - b1) == (3 * (5 * n * k + 4), 3 * (3 * n * k + 4))


@pytest.mark.parametrize("keep_out", ("", "layers.0,*.o_proj"))
def test_fp8_allgather_casts_enter_the_predicted_step(keep_out):
    """Llama-3.1-8B, tp2 dp4 ZeRO-3 tensorwise: with parallel.fp8_allgather the step's
    forward and backward differ from the plain FP8 run's by exactly the cast bytes'
    difference at the HBM rate (the weights' casts out; the gathers and Wᵀ copies in), of
    the FP8 linears only under train.fp8_keep_out (a kept-out weight gathers in bf16, as
    the ZeRO-3 unit's other elements)."""
    from fivefold.models.presets import preset
    from fivefold.plan.fp8 import fp8_gather_terms, rank_dense_cast_bytes
    from fivefold.plan.fp8_linears import FP8Linears, rank_fp8_linears, uniform_fp8_linears
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.timing import rank_compute

    hw, assume = get_hardware("h100")
    hbm = hw.hbm_tbps * 1e12 * assume.hbm_efficiency / (1 + assume.compute_overhead)
    layout = Layout(dp=4, tp=2, sp=True, mbs=1, zero=3)
    rc, cast = {}, {}
    for on in (False, True):
        work = Workload(model=preset("llama-3.1-8b"), seq_len=4096, gbs=64, precision="fp8",
                        fp8_recipe="tensorwise", fp8_allgather=on, fp8_keep_out=keep_out)
        rc[on] = rank_compute(work, layout, hw, assume, 0)
        cast[on] = rank_dense_cast_bytes(work, layout, 4096, rank_fp8_linears(work, layout, 0))
    fp8 = rank_fp8_linears(work, layout, 0)
    assert fp8 == (uniform_fp8_linears(work.model, 32, 0) if not keep_out else
                   uniform_fp8_linears(work.model, 31, 0) - FP8Linears(o=31))
    elements = fp8_gather_terms(work, layout, fp8, 4)[0]
    h, q, kv, f = 4096, 4096 / 2, 4 * 128, 14336 / 2  # per tp rank (kv: 4 heads of 128)
    assert elements == (31 * h * (q + 2 * kv + 3 * f) if keep_out  # no layer 0, no o
                        else 32 * h * (2 * q + 2 * kv + 3 * f))
    gathered = gather_bytes(elements, 4, 2)
    assert cast[True][0] < cast[False][0]  # no weight cast in the linears' forward
    for i, phase in enumerate(("forward", "backward")):
        got = getattr(rc[True], phase) - getattr(rc[False], phase)
        want = (cast[True][i] + gathered - cast[False][i]) / hbm
        assert got == pytest.approx(want, rel=1e-9), phase
    # per weight element the fused gather moves 3/dp + 4 = 4.75 bytes (dp 4) each way, the
    # linear's own cast of W 5 (amax 2, cast 2 + 1); backward adds Wᵀ's copy (2)
    assert gathered == pytest.approx(4.75 * elements)
    assert rc[True].forward < rc[False].forward
    assert rc[True].backward > rc[False].backward


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_gathered_experts_loop_drops_the_weight_casts(scaling):
    """The tensorwise experts' loop (lowp/experts.py) given ZeRO-3's gathered codes
    (`fp8_experts`), forward + backward on the meta device: its kernels other than GEMMs move
    the plain loop's bytes less every expert weight's amax pass and cast (5 bytes an element,
    forward and again backward) plus the Wᵀ copies (2), as `expert_cast_bytes(gathered=True)`
    plans. Tolerance: the plain loop's W amax partials the planner leaves out (one fp32 per
    64x64 tile, written and read: 8 bytes per 4096 elements per amax pass). Under delayed
    scaling no amax pass: the plain loop's delayed W casts and folds (`cast_bytes`), less
    the Wᵀ copies and the gathered weights' record folds (16 bytes each), exactly."""
    from fivefold.lowp.convert import convert_to_fp8
    from fivefold.models.moe import GroupedExperts
    from fivefold.plan.fp8 import expert_cast_bytes

    experts, tokens, hidden, inter = 4, 1024, 512, 1024
    meta = torch.device("meta")

    def non_gemm_bytes(gathered):
        with meta:
            module = GroupedExperts(experts, hidden, inter).to(torch.bfloat16)
        x = torch.empty(tokens, hidden, device=meta, dtype=torch.bfloat16, requires_grad=True)
        g = torch.empty(tokens, hidden, device=meta, dtype=torch.bfloat16)
        counts = torch.full((experts,), tokens // experts)
        module.use_grouped_mm(x)
        convert_to_fp8(module, FP8Recipe.from_name("tensorwise", scaling=scaling))
        if gathered:
            module.fp8_experts = {
                name: [GatheredWeight(torch.empty(w.shape[1:], device=meta, dtype=E4M3.dtype),
                                      torch.ones((), device=meta), "tensorwise", E4M3,
                                      record=torch.zeros((), device=meta))
                       for _ in range(experts)]
                for name, w in (("w_gate", module.w_gate), ("w_up", module.w_up),
                                ("w_down", module.w_down))}
        events = trace_callable(lambda: module(x, counts).backward(g), gpu="h100").events
        return sum(e.bytes_read + e.bytes_written for e in events
                   if e.kind == "kernel" and not e.flops)

    plain = expert_cast_bytes("tensorwise", tokens, experts, hidden, inter,
                              scaling=scaling)["casts"]
    gathered = expert_cast_bytes("tensorwise", tokens, experts, hidden, inter, gathered=True,
                                 scaling=scaling)["casts"]
    planned = sum(plain) - sum(gathered)
    weights = 3 * experts * hidden * inter
    got = non_gemm_bytes(False) - non_gemm_bytes(True)
    if scaling == "delayed":  # each gathered weight's record folded (aten.maximum: 12 bytes
        # read, 4 written: RECORD_FOLD), counted in the gathered casts, every local expert's
        assert got == planned, (got, planned)
    else:
        assert planned == 2 * 5 * weights - 2 * weights
        assert 0 <= got - planned <= 2 * 8 * weights / 4096, (got, planned)


@pytest.mark.parametrize("shape", ((4096, 4096, 1024), (2048, 14336, 4096)))
def test_delayed_linear_with_a_gathered_weight_folds_its_record(shape):
    """Delayed scaling (every history row filled, the steady state) with ZeRO-3's gathered
    codes and their record: the linear's kernels other than GEMMs, forward and forward +
    backward, are exactly the planner's gathered casts (`mlp_cast_bytes`' path,
    `_linears_cast_bytes`): x's delayed cast and fold, the gathered record folded into W's
    pending record (RECORD_FOLD = 16 bytes, one aten.maximum of fp32 scalars, per weight
    and forward: not per element), ∂y's cast and fold and Wᵀ's copy in backward. Delayed
    casts have no amax partials: nothing is left out, so the tolerance is 0."""
    from fivefold.lowp.delayed import DelayedState
    from fivefold.plan.fp8 import RECORD_FOLD, _linears_cast_bytes

    tokens, k, n = shape
    meta = torch.device("meta")
    recipe = FP8Recipe.from_name("tensorwise", scaling="delayed")

    def traced(backward):
        state = DelayedState(torch.zeros(3, 16, device=meta), [True] * 3, record=True)
        x = torch.empty(tokens, k, device=meta, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(n, k, device=meta, dtype=torch.bfloat16, requires_grad=True)
        g = torch.empty(tokens, n, device=meta, dtype=torch.bfloat16)
        wq = GatheredWeight(torch.empty(n, k, device=meta, dtype=E4M3.dtype),
                            torch.ones((), device=meta), "tensorwise", E4M3,
                            record=torch.zeros((), device=meta))

        def run():
            y = fp8_linear(x, w, None, recipe, wq, state)
            if backward:
                y.backward(g)

        events = [e for e in trace_callable(run, gpu="h100").events if e.kind == "kernel"]
        folds = [e for e in events if e.name == "aten.maximum.out"]
        assert len(folds) == 1 and folds[0].bytes_read + folds[0].bytes_written == RECORD_FOLD
        return sum(e.bytes_read + e.bytes_written for e in events if not e.flops)

    fwd, bwd = _linears_cast_bytes("tensorwise", tokens, [(n, k)], [k], [n], 2, "delayed",
                                   gathered=True)
    assert traced(False) == fwd and traced(True) == fwd + bwd, (fwd, bwd)
    act = cast_bytes("tensorwise", "act", tokens, k, 2, "delayed")
    assert fwd == act + RECORD_FOLD  # x's cast, and the record: no weight cast
