"""FP8 numerics and the FP8 linear layer against their oracles.

- tensorwise, rowwise and rowwise_gw_hp: torchao 0.18's `Float8Linear` on the same weights,
  inputs and output gradient (rowwise_gw_hp: its recipe ROWWISE_WITH_GW_HP). Both compute
  the same thing (same scales, same casts, `torch._scaled_mm` with fp32 accumulation), so
  the tolerance is zero: outputs and the three gradients are
  bit-for-bit equal in bf16 and fp32. One documented exception: torchao's rowwise path
  returns a bf16 result even for fp32 inputs (float8_ops.py, "work around torch._scaled_mm
  not having float32 output type") and adds the bias after that rounding, so for fp32 the
  comparison runs without a bias and rounds ours to bf16 first.
- blockwise: a float64 reference written from the definition (DeepSeek-V3 §3.3): quantise
  each 1x128 tile / 128x128 block on its own, dequantise, multiply in float64. Ours
  accumulates in fp32, so the tolerance is fp32 accumulation error: 1e-5 relative (norm).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.numerics.formats import E4M3, E5M2
from fivefold.numerics.fp8 import dequantize, fp8_mm, quantize
from fivefold.numerics.scaling import amax_to_scale

TORCHAO_NAMES = {"rowwise_gw_hp": "rowwise_with_gw_hp"}


def _torchao_linear(lin: nn.Linear, recipe: str) -> nn.Module:
    float8 = pytest.importorskip("torchao.float8")
    cfg = float8.Float8LinearConfig.from_recipe_name(TORCHAO_NAMES.get(recipe, recipe))
    return float8.convert_to_float8_training(copy.deepcopy(lin), config=cfg)


def _run(fn, x, g):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_torchao_float8_linear(recipe, dtype):
    torch.manual_seed(0)
    # torchao's bf16 workaround (rowwise GEMMs; rowwise_gw_hp's high-precision weight
    # gradient is not one, and is compared unrounded below)
    rounded = recipe.startswith("rowwise") and dtype == torch.float32
    lin = nn.Linear(256, 192, bias=not rounded).to(dtype)
    ref = _torchao_linear(lin, recipe)
    x = torch.randn(3, 40, 256, dtype=dtype) * 3
    g = torch.randn(3, 40, 192, dtype=dtype) * 1e-3
    y_ref, gx_ref = _run(ref, x, g)
    w = lin.weight.detach().clone().requires_grad_()
    b = None if rounded else lin.bias.detach().clone().requires_grad_()
    y, gx = _run(lambda t: fp8_linear(t, w, b, FP8Recipe.from_name(recipe)), x, g)
    ours = [y, gx, w.grad] + ([] if rounded else [b.grad])
    theirs = [y_ref, gx_ref, ref.weight.grad] + ([] if rounded else [ref.bias.grad])
    for name, a, b_ in zip(["y", "grad_x", "grad_w", "grad_b"], ours, theirs):
        assert a.dtype == b_.dtype, name
        if rounded and not (recipe == "rowwise_gw_hp" and name == "grad_w"):
            a, b_ = a.bfloat16(), b_.bfloat16()
        assert torch.equal(a, b_), f"{recipe} {dtype} {name}: max diff {(a - b_).abs().max()}"


# ---- float64 reference of the blockwise recipe, from the definition -----------------------

def _q64(x: torch.Tensor, fmt=E4M3) -> torch.Tensor:
    """Quantise one group (any shape) with its own amax, then dequantise, in float64."""
    amax = x.abs().max().item()
    m = fmt.max / max(amax, 1e-12)
    q = (x.double() * m).clamp(-fmt.max, fmt.max).float().to(fmt.dtype)
    return q.double() / m


def _tiles64(x: torch.Tensor, fmt=E4M3) -> torch.Tensor:
    """1x128 tiles along the last dim of a 2-D tensor, each on its own."""
    out = torch.empty_like(x, dtype=torch.float64)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 128):
            out[r, c:c + 128] = _q64(x[r, c:c + 128], fmt)
    return out


def _blocks64(w: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(w, dtype=torch.float64)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            out[r:r + 128, c:c + 128] = _q64(w[r:r + 128, c:c + 128])
    return out


def test_blockwise_linear_matches_float64_reference():
    torch.manual_seed(1)
    t, k, n = 150, 320, 272  # none a multiple of 128: partial tiles and blocks on every edge
    x = torch.randn(t, k) * torch.logspace(-2, 2, k)  # channels of very different ranges
    w = torch.randn(n, k) / math.sqrt(k)
    g = torch.randn(t, n) * 1e-4
    wp = w.clone().requires_grad_()
    y, gx = _run(lambda v: fp8_linear(v, wp, None, FP8Recipe.from_name("blockwise")), x, g)

    xq, wq = _tiles64(x), _blocks64(w)
    y_ref = xq @ wq.t()
    gx_ref = _tiles64(g) @ _blocks64(w.t()).t()  # dgrad: ∂y tiles along N, W blocks
    # wgrad: ∂yᵀ and the saved FP8 input, both as 1x128 tiles along the tokens
    gw_ref = _tiles64(g.t()) @ _tiles64(xq.float().t()).t()
    for name, ours, ref in [("y", y, y_ref), ("grad_x", gx, gx_ref), ("grad_w", wp.grad, gw_ref)]:
        rel = (ours.double() - ref).norm() / ref.norm()
        assert rel < 1e-5, f"{name}: relative error {rel:.2e} against the float64 reference"
    # and FP8 is FP8: the error against the exact float64 product is far above fp32's
    exact = (x.double() @ w.double().t())
    assert 1e-3 < ((y.double() - exact).norm() / exact.norm()) < 0.1


def test_blockwise_mm_tiles_times_tiles_and_blocks():
    torch.manual_seed(2)
    a, b = torch.randn(64, 384), torch.randn(96, 384)
    for gb in ("tiles", "blocks"):
        qa, qb = quantize(a, E4M3, "tiles"), quantize(b, E4M3, gb)
        ref = dequantize(qa).double() @ dequantize(qb).double().t()
        assert ((fp8_mm(qa, qb).double() - ref).norm() / ref.norm()) < 1e-6


# ---- scaling: saturation and the special amax values ---------------------------------------

@pytest.mark.parametrize("gran", ["tensorwise", "rowwise", "tiles", "blocks"])
def test_zero_groups_stay_zero_and_nan_poisons_its_group(gran):
    x = torch.randn(4, 256)
    x[0] = 0.0
    q = quantize(x, E4M3, gran)
    assert torch.equal(dequantize(q)[0], torch.zeros(256))
    assert torch.isfinite(q.scale).all()
    x[2, 5] = float("nan")
    out = dequantize(quantize(x, E4M3, gran))
    assert torch.isnan(out[2, 5])
    assert torch.isnan(out).any(dim=1).tolist() == ([True] * 4 if gran in (
        "tensorwise", "blocks") else [False, False, True, False])


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_amax_gives_nan_scale_not_zero(value):
    m = amax_to_scale(torch.tensor([1.0, value]).abs(), E4M3)
    assert m[0].item() == 448.0 and math.isnan(m[1].item())
    x = torch.ones(2, 8)
    x[1, 3] = value
    out = dequantize(quantize(x, E4M3, "rowwise"))
    assert torch.equal(out[0], torch.ones(8)) and torch.isnan(out[1]).all()


def test_saturation_and_pow2_scales():
    for fmt in (E4M3, E5M2):
        q = quantize(torch.tensor([[1.0, -2.0, 4.0]]), fmt, "tensorwise")
        assert q.data.float().abs().max().item() == fmt.max  # amax maps onto the format's max
    m = amax_to_scale(torch.tensor([3.0, 1000.0, 0.0]), E4M3, pow2=True)
    assert torch.equal(m, torch.exp2(torch.round(torch.log2(m))))  # powers of two
    assert (m * torch.tensor([3.0, 1000.0, 0.0]) <= 448).all()  # rounded down: no overflow
    assert m[0].item() == 128.0  # 448/3 = 149.3 -> 128


def test_fp8_input_is_saved_not_the_high_precision_one():
    """Saved-tensor bytes of one FP8 linear: the input in 1 byte per element (+ scales),
    about half of what a bf16 F.linear saves; the weight is a parameter (no new storage)."""
    torch.manual_seed(3)
    x = torch.randn(8, 128, 512, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 512, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(fn) -> int:
        total = []

        def pack(t):
            if t.data_ptr() != w.data_ptr():
                total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(total)

    bf16 = saved_bytes(lambda: torch.nn.functional.linear(x, w))
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        fp8 = saved_bytes(lambda r=recipe: fp8_linear(x, w, None, FP8Recipe.from_name(r)))
        assert bf16 == x.numel() * 2
        assert 0.5 <= fp8 / bf16 < 0.52, (recipe, fp8 / bf16)
    # rowwise_gw_hp's weight gradient takes the input in bf16: it saves what bf16 saves
    gw_hp = saved_bytes(lambda: fp8_linear(x, w, None, FP8Recipe.from_name("rowwise_gw_hp")))
    assert gw_hp == bf16


def test_rowwise_gw_hp_with_outlier_channels_is_bit_equal_to_torchao():
    """rowwise_gw_hp on channels over six decades: the forward and the input gradient in
    FP8 (Wᵀ with one power-of-two scale), the weight gradient torch.mm(∂yᵀ, x) in bf16."""
    torch.manual_seed(5)
    lin = nn.Linear(256, 128, bias=True).bfloat16()
    ref = _torchao_linear(lin, "rowwise_gw_hp")
    x = (torch.randn(192, 256) * torch.logspace(-3, 3, 256)).bfloat16()
    g = (torch.randn(192, 128) * 1e-3).bfloat16()
    y_ref, gx_ref = _run(ref, x, g)
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    y, gx = _run(lambda v: fp8_linear(v, w, b, FP8Recipe.from_name("rowwise_gw_hp")), x, g)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert torch.equal(w.grad, ref.weight.grad) and torch.equal(b.grad, ref.bias.grad)
    assert torch.equal(w.grad, (g.t() @ x))  # the weight gradient in bf16, no FP8 in it


def test_rowwise_wgrad_with_outlier_channels_is_bit_equal_to_torchao():
    """Channels over six decades: under its row's scale a small channel's values fall into
    e4m3's subnormals, so re-quantising the dequantised forward copy along the tokens (as
    the wgrad operand once was) loses bits torchao's Float8Linear, which quantises its saved
    high-precision input, keeps. The FP8 linear now quantises the original input: equal."""
    torch.manual_seed(4)
    t, k, n = 256, 256, 256
    lin = nn.Linear(k, n, bias=False).bfloat16()
    ref = _torchao_linear(lin, "rowwise")
    x = (torch.randn(t, k) * torch.logspace(-3, 3, k)).bfloat16()
    g = (torch.randn(t, n) * 1e-3).bfloat16()
    y_ref, gx_ref = _run(ref, x, g)
    w = lin.weight.detach().clone().requires_grad_()
    recipe = FP8Recipe.from_name("rowwise")
    y, gx = _run(lambda v: fp8_linear(v, w, None, recipe), x, g)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert torch.equal(w.grad, ref.weight.grad)
    # the old operand: the forward's row-quantised copy, dequantised and quantised again
    requantised = recipe.quantize_act(dequantize(recipe.quantize_act(x)).t())
    old = fp8_mm(recipe.quantize_act(g.t(), recipe.grad_format), requantised,
                 out_dtype=torch.bfloat16)
    differing = (old != ref.weight.grad).sum().item()
    print(f"re-quantised wgrad: {differing} of {old.numel()} elements differ from torchao")
    assert differing > old.numel() // 10  # the case really exercises the difference
