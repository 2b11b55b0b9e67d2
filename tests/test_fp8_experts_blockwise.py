"""Blockwise FP8 experts on casts made once for all tokens (lowp/experts_blockwise.py,
numerics/fp8_grouped_tiles.py): bit-equal to the per-expert loop on a CPU (the emulated
blockwise GEMM, fp32 and bf16, uneven groups with empty experts and groups crossing 128),
and the grouped tile kernel byte-equal to fp8_cast_tiles of each expert's rows alone in
Triton's interpreter (fp32, fp16)."""

import copy

import pytest
import torch
from common import run_interpreted

from fivefold.lowp.convert import convert_to_fp8
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.moe import GroupedExperts

NE, NH, NI = 4, 128, 256  # widths in whole 128-blocks: the stacked weight's blocks


def _pair(dtype, grouped_casts=True, hidden=NH):
    torch.manual_seed(0)
    m = GroupedExperts(NE, hidden, NI)
    for w in (m.w_gate, m.w_up, m.w_down):
        torch.nn.init.normal_(w, std=0.1)
    m = m.to(dtype)
    loop = copy.deepcopy(m)
    loop.impl = "loop"
    for module in (m, loop):
        convert_to_fp8(module, FP8Recipe.from_name("blockwise"))
    m.fp8_grouped_casts = grouped_casts
    return m, loop


def _run(module, x, g, sizes):
    x = x.clone().requires_grad_()
    y = module(x, torch.tensor(sizes))
    y.backward(g)
    return [y.detach(), x.grad, module.w_gate.grad, module.w_up.grad, module.w_down.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[5, 0, 40, 12], [130, 1, 0, 3]])
def test_grouped_casts_equal_the_per_expert_loop_bit_for_bit(dtype, sizes):
    grouped, loop = _pair(dtype)
    assert grouped.uses_grouped_fp8() and not loop.uses_grouped_fp8()
    x = torch.randn(sum(sizes), NH, dtype=dtype) * torch.logspace(-3, 1, NH, dtype=dtype)
    g = torch.randn(sum(sizes), NH, dtype=dtype)
    for name, a, b in zip(["y", "dx", "dw_gate", "dw_up", "dw_down"],
                          _run(grouped, x, g, sizes), _run(loop, x, g, sizes)):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_grouped_casts_need_whole_blocks_and_the_switch():
    assert not _pair(torch.float32, grouped_casts=False)[0].uses_grouped_fp8()
    assert not _pair(torch.float32, hidden=96)[0].uses_grouped_fp8()  # blocks would straddle


KERNEL_CHECK = r"""
import json, torch
from fivefold.numerics import fp8_cast as C
from fivefold.numerics import fp8_grouped_tiles as G
assert G.kernels is not None and G.triton_usable(torch.device("cpu"))
torch.manual_seed(0)
report = {}
sizes = [5, 0, 140, 12]
for dtype in (torch.float32, torch.float16):
    x = (torch.randn(sum(sizes), 136) * torch.logspace(-3, 2, 136)).to(dtype)
    x[3, 5] = float("nan")
    for fmt, requant in (("e4m3", True), ("e5m2", False)):
        c, s, ct, st = G.fp8_cast_group_tiles(x, sizes, fmt, requant)
        ok = bool(torch.equal(c.view(torch.uint8)[x.isfinite()], C.fp8_cast_tiles(
            x, fmt, False)[0].view(torch.uint8)[x.isfinite()]))
        start, (tstarts, _) = 0, G.tile_starts(sizes)
        for size, ts in zip(sizes, tstarts):
            if size:
                rc, rs, rct, rst = C.fp8_cast_tiles(x[start:start + size], fmt, requant)
                ok &= torch.equal(s[start:start + size].nan_to_num(7.0), rs.nan_to_num(7.0))
                got = G.group_t(ct, 136, start, size).float().nan_to_num(7.0)
                ok &= torch.equal(got, rct.float().nan_to_num(7.0))
                ok &= torch.equal(st[:, ts:ts + rst.shape[1]].nan_to_num(7.0),
                                  rst.nan_to_num(7.0))
            start += size
        report[f"{dtype}/{fmt}/requant={requant}"] = bool(ok)
print(json.dumps(report))
"""


def test_group_tiles_kernel_in_the_interpreter_equals_fp8_cast_tiles_per_expert():
    """Both sides run Triton kernels in the interpreter (fp8_cast_tiles' own kernel is
    tested byte-equal to the reference in tests/test_fp8_cast.py)."""
    report = run_interpreted(["-c", KERNEL_CHECK], timeout=300)
    assert len(report) == 4 and all(report.values()), report
