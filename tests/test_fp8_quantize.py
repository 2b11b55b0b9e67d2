"""The FP8 linear's quantiser (lowp/quantize.py) against the reference numerics.fp8.quantize:
the same bytes and scales in fewer passes, and the facts its shortcuts rest on (the amax
reduction keeps NaN; the saturating clamp it drops never changes a value)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fivefold.lowp import linear as lowp_linear
from fivefold.lowp import quantize as fast
from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.numerics import fp8 as reference
from fivefold.numerics.formats import E4M3, E5M2
from fivefold.numerics.scaling import amax_to_scale, expand_scale

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops: conftest.py says why

GRANULARITIES = ("tensorwise", "rowwise", "tiles", "blocks")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (a NaN's sign: quantize.py)."""
    a, b = a.float(), b.float()
    nan = a.isnan()
    return (a.shape == b.shape and torch.equal(nan, b.isnan())
            and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def _operand(shape, dtype, transposed, seed):
    """Values over 12 decades (subnormal FP8 codes, zeros after scaling), an all-zero run,
    a NaN, an inf and a negative NaN in different groups (most groups stay finite);
    `transposed`: a transposed view, as the linear quantises xᵀ and ∂yᵀ."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape[::-1] if transposed else shape
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-8, 4, cols)
    x[0, : cols // 3] = 0.0
    x = x.to(dtype)
    if x.numel() > 8:
        x[1, 2], x[-1, -1], x[-1, 0] = float("nan"), float("inf"), -float("nan")
    return x.t() if transposed else x


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_bytes_and_scales_equal_the_reference(granularity):
    """Whole and ragged groups (130x300: a short last tile and block), a transposed view,
    bf16/fp32/fp16 inputs, both formats, float32 and power-of-two multipliers."""
    seed = 0
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for shape in ((256, 384), (130, 300), (5, 7), (1, 1)):
            for transposed in (False, True):
                seed += 1
                x = _operand(shape, dtype, transposed, seed)
                for fmt, pow2 in ((E4M3, False), (E5M2, True), (E4M3, True)):
                    case = (dtype, shape, transposed, fmt.name, pow2)
                    want = reference.quantize(x, fmt, granularity, pow2)
                    got = fast.quantize(x, fmt, granularity, pow2)
                    assert got.data.dtype == fmt.dtype and got.data.is_contiguous()
                    assert _same(want.data, got.data), case
                    assert _same(want.scale, got.scale), case
                    assert _same(reference.dequantize(want), fast.dequantize(got)), case


@pytest.mark.parametrize("one_pass", [True, False], ids=["cuda-path", "cpu-path"])
def test_the_amax_reduction_keeps_nan_and_inf_at_every_position(one_pass, monkeypatch):
    """Both group amax paths (CUDA's one vector_norm pass, CPU's amin and amax; the
    tensor-wide aminmax) equal the reference's (abs, amax, and an isnan/any pass that forces
    NaN) with a NaN or an inf at every column position (vector lanes, loop tails): NaN
    exactly in the groups holding a NaN, inf in those holding an inf."""
    monkeypatch.setattr(fast, "one_pass_amax", lambda device: one_pass)
    for dtype in (torch.bfloat16, torch.float32):
        for rows, cols in ((300, 7), (300, 300)):
            for value in (float("nan"), -float("nan"), float("inf"), -float("inf")):
                x = torch.randn(rows, cols).to(dtype)
                x[torch.arange(0, rows, 2), torch.arange(0, rows, 2) % cols] = value
                for gran in GRANULARITIES:
                    want = reference._amax(x, gran, 128)
                    got = fast.group_amax(x, gran)
                    assert got.float().isnan().any() or got.float().isinf().any()
                    assert _same(want, got), (dtype, cols, value, gran)


def test_power_of_two_scaling_in_bf16_equals_float32_down_to_the_subnormals():
    """bf16 x · 2^e is computed in bf16 (half the buffer): bytes equal the float32 path's,
    also where the products fall below 2^-126 and bf16 rounds them differently."""
    # each row: an amax near 1e38 (m near 2^-118), so that values of 2^-31 .. 2^-8 scale
    # into [2^-149, 2^-126), and bf16 subnormals, zeros, a normal middle
    vals = torch.tensor([1e38, 1.0078125 * 2.0**-20, -1.5 * 2.0**-25, 1.25 * 2.0**-28,
                         2.0**-130, -2.0**-133, 1.5 * 2.0**-126, 1e20, -0.0, 1.9 * 2.0**-12])
    gen = torch.Generator().manual_seed(2)
    x = vals.repeat(64, 24) * torch.randint(-3, 1, (64, 240), generator=gen).exp2()
    x = x.to(torch.bfloat16)
    differ = 0
    for t in (x, x.t()):
        for fmt in (E4M3, E5M2):
            for gran in ("rowwise", "tiles"):
                want = reference.quantize(t, fmt, gran, pow2=True)
                got = fast.quantize(t, fmt, gran, pow2=True)
                assert torch.equal(want.data.view(torch.uint8), got.data.view(torch.uint8))
                assert torch.equal(want.scale, got.scale)
                m = expand_scale(want.scale.reciprocal(), tuple(t.shape), gran)
                differ += int(((t.float() * m) != (t * m.to(t.dtype)).float()).sum())
    assert differ > 0  # the subnormal products did round differently in bf16


def test_multiplier_equals_amax_to_scale_bit_for_bit():
    """Every non-negative bf16 amax, 10^5 float32 ones over 2^-150 .. 2^110, and the
    special ones (zeros, below and at EPS, inf, NaNs of both signs), both formats, with and
    without power-of-two rounding: the same float32 bits, NaNs included."""
    special = torch.tensor([0.0, -0.0, 1e-45, 1e-13, 1e-12, 1.1e-12, 448.0, 3e38,
                            float("inf"), float("nan"), -float("nan")])
    every_bf16 = torch.arange(0, 0x7F81, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16)
    spread = torch.rand(10**5, generator=torch.Generator().manual_seed(3)).mul(260).sub(150)
    for amax in (special, special.reshape(1, -1, 1), every_bf16, spread.exp2()):
        for fmt in (E4M3, E5M2):
            for pow2 in (False, True):
                want, got = amax_to_scale(amax, fmt, pow2), fast.multiplier(amax, fmt, pow2)
                assert want.shape == got.shape and got.dtype == torch.float32
                assert torch.equal(want.view(torch.int32), got.view(torch.int32))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_no_clamp_needed_for_any_bf16_amax(fmt):
    """For every positive finite bf16 value a as amax (and 10^5 float32 ones), a · m rounds
    to exactly fmt.max in the cast: the largest scaled element never needs the clamp."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)  # +subnormal .. +max
    amaxes = torch.cat([bits.view(torch.bfloat16).float(),
                        torch.rand(10**5, generator=torch.Generator().manual_seed(0))
                        .mul(80).sub(40).exp2()])
    for pow2 in (False, True):
        m = amax_to_scale(amaxes, fmt, pow2)
        scaled = amaxes * m
        big = amaxes >= 1e-12  # below SCALE_EPS the scaled amax is below fmt.max
        assert scaled.max() <= fmt.max * (1 + 2.0**-22)
        cast = scaled.to(fmt.dtype).float()
        assert torch.equal(cast, scaled.clamp(max=fmt.max).to(fmt.dtype).float())
        if not pow2:
            assert (cast[big] == fmt.max).all()


class _Passes(TorchDispatchMode):
    """Ops outside fp8_mm that read or write a tensor of at least `big` elements."""

    def __init__(self, big):
        super().__init__()
        self.big, self.paused, self.passes = big, False, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or func.is_view or name.startswith("empty") or name == "_unsafe_view":
            return out
        if any(isinstance(t, torch.Tensor) and t.numel() >= self.big
               for t in tree_leaves((args, kwargs, out))):
            self.passes[name] += 1
        return out


# Per forward + backward of one linear on CUDA's path, each a pass over x, W or ∂y (or its
# FP8 copy): amaxes (aminmax, linalg_vector_norm), scale (mul), cast (_to_copy), FP8
# transposes (clone), the blockwise dequantisation (_to_copy and an in-place mul_). On
# CPU's path each linalg_vector_norm is an amin and an amax.
PASSES = {
    # x, W, ∂y and Wᵀ cast; ∂yᵀ and xᵀ are their FP8 copies transposed
    "tensorwise": {"aminmax": 4, "mul": 4, "_to_copy": 4, "clone": 2},
    # x along K and along the tokens, W, ∂y along N and along the tokens, Wᵀ
    "rowwise": {"linalg_vector_norm": 6, "mul": 6, "_to_copy": 6},
    # x, W, ∂y, Wᵀ, ∂yᵀ, and xᵀ from the dequantised saved x
    "blockwise": {"linalg_vector_norm": 6, "mul": 6, "_to_copy": 7, "mul_": 1},
}


def _cpu_path(passes: dict) -> dict:
    out = {k: v for k, v in passes.items() if k != "linalg_vector_norm"}
    if "linalg_vector_norm" in passes:
        out["amin"] = out["amax"] = passes["linalg_vector_norm"]
    return out


@pytest.mark.parametrize("one_pass", [True, False], ids=["cuda-path", "cpu-path"])
@pytest.mark.parametrize("name", sorted(PASSES))
def test_passes_of_a_linear_step_and_its_result_equal_the_reference(name, one_pass,
                                                                    monkeypatch):
    """The full-size passes of one FP8 forward + backward, counted (the reference took 5 to
    6 amaxes with their abs, float, isnan and any, and a mul, clamp and cast per operand);
    and y, ∂x, ∂W bit-equal to the same linear quantising with numerics.fp8."""
    monkeypatch.setattr(fast, "one_pass_amax", lambda device: one_pass)
    tokens, k, n = 128, 256, 128
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, k)).to(torch.bfloat16)
    g = torch.randn(tokens, n, generator=gen).to(torch.bfloat16)
    recipe = FP8Recipe.from_name(name)

    def step(xr, wr):
        y = fp8_linear(xr, wr, None, recipe)
        y.backward(g)
        return y, xr.grad, wr.grad

    def leaves():
        return x.clone().requires_grad_(), w.clone().requires_grad_()

    counter = _Passes(big=n * k // 4)
    inner = lowp_linear.fp8_mm

    def gemm(*args, **kwargs):  # the GEMM's own work is not the quantiser's
        counter.paused = True
        try:
            return inner(*args, **kwargs)
        finally:
            counter.paused = False

    monkeypatch.setattr(lowp_linear, "fp8_mm", gemm)
    xr, wr = leaves()
    with counter:
        fast_out = step(xr, wr)
    assert dict(counter.passes) == (PASSES[name] if one_pass else _cpu_path(PASSES[name]))
    monkeypatch.setattr(lowp_linear, "quantize", reference.quantize)
    monkeypatch.setattr(lowp_linear, "dequantize", reference.dequantize)
    for got, want in zip(fast_out, step(*leaves())):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
