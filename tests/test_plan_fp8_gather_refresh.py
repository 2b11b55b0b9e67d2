"""ZeRO-3's FP8 gathers' scale refresh (parallel/zero3_fp8.py `refresh_scales`: once per
step, the amax of each rank's shard of every FP8-gathered weight, under dynamic and delayed
scaling alike) in the planner (plan/fp8.py `gather_refresh_bytes`, in plan/timing.py
`optimizer_time`), against the trace on the meta device (fivefold.trace) of the engine's
refresh, rank 0 of four.

Error model: the trace's bytes are the eager amax's (numerics/scaling.py `tensor_amax`:
3B + 14 bytes per shard element of a weight, exactly) plus fp32 scalars the planner leaves
out: per weight the amax vector, the concatenation, amax_to_scale's float64 round trip,
the multiplier, scale and record updates (under 200 bytes a weight), and per piece the
amax's result, its NaN select and its copy (under 50). So 0 <= traced - planned <=
200 a weight + 50 a piece.
"""

import types

import pytest
import torch
from test_plan_fp8_gather_casts import meta_unit

from fivefold.parallel import zero3_fp8
from fivefold.parallel.zero3_fp8 import refresh_scales
from fivefold.plan.fp8 import REFRESH_AMAX, gather_refresh_bytes
from fivefold.trace import trace_callable

DP = 4
UNITS = {"kv": [(1024, 4096)], "odd": [(333, 517), (129, 77)],
         "experts": [(96, 64), (3, 55, 37), (3, 37, 55)]}


def _unit(weights):
    unit, _, _, size = meta_unit(weights, DP)
    return unit, size


@pytest.mark.parametrize("name", UNITS)
def test_refresh_bytes_match_the_traced_refresh(name, monkeypatch):
    monkeypatch.setattr(zero3_fp8.comm, "all_reduce",
                        lambda t, group, op=None, async_op=False: zero3_fp8.comm.DONE)
    unit, size = _unit(UNITS[name])
    shard = torch.empty(size // DP, dtype=torch.bfloat16, device=torch.device("meta"))
    watchdog = types.SimpleNamespace(wait=lambda handle, what: None)
    events = [e for e in trace_callable(
        lambda: refresh_scales({0: unit}, shard, types.SimpleNamespace(size=DP), watchdog),
        gpu="h100").events if e.kind == "kernel"]
    got = sum(e.bytes_read + e.bytes_written for e in events)
    # rank 0's weight elements: its shard less the segment's other elements (none here
    # but the padding, which is on the last rank's)
    mine = sum(hi - lo for k, lo, hi, _ in unit.pieces[0] if k >= 0)
    assert mine == size // DP
    planned = mine * (3 * 2 + REFRESH_AMAX)
    pieces = sum(1 for k, *_ in unit.pieces[0] if k >= 0)
    assert 0 <= got - planned <= 200 * len(unit.entries) + 50 * pieces, (name, got, planned)


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_refresh_enters_the_optimizer_time(scaling):
    """Llama-3.1-8B, tp2 dp4 ZeRO-3 tensorwise: parallel.fp8_allgather adds to the step's
    optimizer time exactly the refresh's bytes at the HBM rate: 20 bytes (B = 2) per
    element of the rank's shard of its FP8 linears' weights, every step."""
    from fivefold.models.presets import preset
    from fivefold.plan.fp8 import fp8_gather_terms
    from fivefold.plan.fp8_linears import rank_fp8_linears
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.timing import optimizer_time

    hw, assume = get_hardware("h100")
    layout = Layout(dp=4, tp=2, sp=True, mbs=1, zero=3)
    works = {on: Workload(model=preset("llama-3.1-8b"), seq_len=4096, gbs=64,
                          precision="fp8", fp8_recipe="tensorwise", fp8_allgather=on,
                          fp8_scaling=scaling) for on in (False, True)}
    elements = fp8_gather_terms(works[True], layout,
                                rank_fp8_linears(works[True], layout, 0), 4)[0]
    h, q, kv, f = 4096, 4096 / 2, 4 * 128, 14336 / 2
    assert elements == 32 * h * (2 * q + 2 * kv + 3 * f)
    refresh = gather_refresh_bytes(works[True], layout, rank_fp8_linears(
        works[True], layout, 0), 4, 0.0)
    assert refresh == elements / 4 * 20
    got = optimizer_time(works[True], layout, hw, assume) - optimizer_time(
        works[False], layout, hw, assume)
    assert got == pytest.approx(refresh / (hw.hbm_tbps * 1e12 * assume.hbm_efficiency),
                                rel=1e-9)
    assert got > 0
