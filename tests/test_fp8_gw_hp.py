"""rowwise_gw_hp (torchao's ROWWISE_WITH_GW_HP) in routed experts, against its float64
reference.

The routed experts run rowwise_gw_hp as a loop over the experts with the FP8 linear
(lowp/experts.py: only `rowwise` and `blockwise` have grouped paths). Its reference, written
from the recipe's definition with float64 autograd: each GEMM's forward multiplies x and W
quantised by rows (power-of-two scales, E4M3); its input gradient multiplies ∂y quantised
by rows with W quantised whole (one power-of-two scale); its weight gradient is ∂yᵀ x
unquantised. SiLU and the gating product are float64 autograd. fp32 in: the engine's
GEMMs accumulate in fp32 and its SiLU and product round to fp32, so a quantised operand
(h, ∂h) may differ from the float64 one by fp32 rounding; tolerance 1e-5 relative (as the
one-linear float64 test of tests/test_fp8_delayed.py).
Under tensor and expert parallelism rowwise_gw_hp runs in tests/test_fp8_parallel.py.
"""

import math

import torch

from fivefold.lowp.convert import convert_to_fp8
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.moe import GroupedExperts
from fivefold.numerics.formats import E4M3


def _q64(t, fmt=E4M3):
    """t quantised whole with a power-of-two multiplier, dequantised, float64."""
    amax = t.detach().abs().max().item()
    mult = 2.0 ** math.floor(math.log2(fmt.max / max(amax, 1e-12)))
    return (t.double() * mult).clamp(-fmt.max, fmt.max).float().to(fmt.dtype).double() / mult


def _rows64(t):
    return torch.stack([_q64(r) for r in t])


class _Linear64(torch.autograd.Function):
    """rowwise_gw_hp's definition in float64 (the module docstring)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _rows64(x) @ _rows64(w).t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return _rows64(g) @ _q64(w), g.t() @ x


def test_rowwise_gw_hp_experts_match_the_float64_reference():
    torch.manual_seed(5)
    experts, hidden, inter = 3, 48, 40
    module = GroupedExperts(experts, hidden, inter)
    for w in (module.w_gate, module.w_up, module.w_down):
        torch.nn.init.normal_(w, std=0.2)
    reference = {n: p.detach().double().clone().requires_grad_()
                 for n, p in module.named_parameters()}
    assert convert_to_fp8(module, FP8Recipe.from_name("rowwise_gw_hp")) == [""]
    counts = torch.tensor([7, 0, 12])  # an expert with no tokens too
    x = (torch.randn(19, hidden) * torch.logspace(-1, 1, hidden)).requires_grad_()
    g = torch.randn(19, hidden) * 1e-2
    y = module(x, counts)
    y.backward(g)

    x64 = x.detach().double().requires_grad_()
    outs = []
    for e, rows in enumerate(x64.split(counts.tolist())):
        if rows.shape[0] == 0:
            continue
        wg, wu, wd = (reference[n][e] for n in ("w_gate", "w_up", "w_down"))
        h = torch.nn.functional.silu(_Linear64.apply(rows, wg)) * _Linear64.apply(rows, wu)
        outs.append(_Linear64.apply(h, wd))
    y64 = torch.cat(outs)
    y64.backward(g.double())
    pairs = [("y", y, y64), ("grad_x", x.grad, x64.grad)]
    pairs += [(n, p.grad, reference[n].grad) for n, p in module.named_parameters()]
    for name, ours, ref in pairs:
        rel = (ours.double() - ref).norm() / ref.norm()
        assert rel < 1e-5, f"{name}: relative error {rel:.2e} against the float64 reference"
    assert module.w_gate.grad[1].abs().sum() == 0  # the expert without tokens: no gradient
