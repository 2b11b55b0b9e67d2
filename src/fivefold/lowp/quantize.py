"""The FP8 linear's quantiser: numerics.fp8.quantize's bytes in fewer passes over the tensor.

`numerics.fp8.quantize` is the reference, written step by step; on a 8192x4096 bf16 operand
each of its steps is one pass over 64 MB (abs, float, amax, isnan, any; float, expand,
mul, clamp, cast, contiguous), and on an H100 those passes took 6.6x the time of the FP8
GEMMs they feed. This module computes the same FP8Tensor, bit for bit
(tests/test_fp8_quantize.py compares every byte and scale with the reference), in three
passes. One exception: the sign bit of a NaN. A group holding a NaN or an inf has a NaN
multiplier, each of its elements is x · NaN, and which NaN a CPU returns when x is a NaN
too (x's, perhaps negative, or m's) depends on the kernel's operand order and vector
width; CUDA returns its one canonical NaN whatever the operands. Either byte is FP8's NaN.

  1. amax: one reduction, `torch.linalg.vector_norm(x, inf)` over views of the scaling
     groups (no stored |x|, no fp32 copy, no padded copy when the shape is whole groups);
     for one tensor-wide group max(-min, max) of `torch.aminmax(x)`, also one pass. On CPU
     the groups take max(-amin, amax) instead, two reads: CPU's vector_norm(inf) is not
     vectorised and was ~6x slower on bf16 than both (a 2-core machine). Each propagates
     NaN on CPU and CUDA (ATen/native/SharedReduceOps.h: AbsMaxOps uses `MAX`, which is
     `max_propagate_nan` on CUDA and `max_impl`, NaN if either is, on CPU; MinMaxOps keeps
     a NaN on either side; amax/amin propagate NaN as documented; tests/test_fp8_quantize.py
     checks both group paths on CPU at every vector position): a group holding a NaN has a
     NaN amax, one holding an inf an inf amax, so the reference's separate isnan/any pass
     is not needed; `multiplier` (amax_to_scale's numbers) turns both into a NaN
     multiplier. The maximum of |x| is one of the |x|, so it is exact in x's own dtype.
  2. scale: one `torch.mul(x, m, out=buffer)` into a row-major float32 buffer. m is a
     float32 tensor with dimensions (a 0-d tensor would leave a bf16 result: type
     promotion), so each element is float32(x) · m, as in the reference; a transposed x is
     read strided here and the buffer is written row-major, so no `.contiguous()` copy of
     the result is needed.
  3. cast: `buffer.to(fp8)`.

With power-of-two multipliers (the rowwise recipe) and a bf16 x the buffer is bf16, half
the bytes: m = 2^e is exact in bf16 (bf16 has float32's exponent range, and here
2^-126 < F / (2 · bf16's max) <= m <= F / EPS < 2^56), and x · 2^e is exact in bf16 as in
float32 (the same 8-bit significand, |x · m| <= F (1 + 2^-22), no overflow) except below
2^-126, where bf16 keeps fewer subnormal bits than float32; but every value below 2^-126
casts to a zero of its sign in both FP8 formats (their smallest subnormals are 2^-9 and
2^-16), and rounding keeps a value below 2^-126 at most 2^-126.

No clamp: the reference saturates x · m to ±fmt.max before the cast, and that clamp never
changes a value. With F = fmt.max, a = max(amax, EPS) >= |x| and u = 2^-24 (float32's unit
roundoff), m = fl32(fl64(F / a)) <= (F / a)(1 + 2^-53)(1 + u), so fl32(|x| · m) <=
F (1 + 2^-53)(1 + u)^2 < F (1 + 2^-22); a power-of-two m is rounded down, smaller still.
That is far below the midpoint between F and the next step above it (464 for E4M3's 448,
61440 for E5M2's 57344), so the cast rounds it to F, as it rounds the clamped F. A NaN
stays NaN either way. tests/test_fp8_quantize.py casts amax · m for every positive finite
bf16 amax and gets F.
"""

from __future__ import annotations

import torch

from fivefold.numerics.formats import FP8_BLOCK, SCALE_EPS, FloatFormat
from fivefold.numerics.fp8 import FP8Tensor

INF = float("inf")


def _spans(size: int, group: int) -> list[tuple[int, int, int]]:
    """(start, stop, group size) along one dim: whole groups, then a shorter last one."""
    whole = size - size % group
    spans = [(0, whole, group)] if whole else []
    if whole < size:
        spans.append((whole, size, size - whole))
    return spans


def _group_sizes(shape: tuple[int, int], granularity: str, block: int) -> tuple[int, int]:
    """(rows, cols) of one scaling group (numerics/scaling.py's granularities)."""
    m, k = shape
    sizes = {"tensorwise": (max(m, 1), max(k, 1)), "rowwise": (1, max(k, 1)),
             "tiles": (1, block), "blocks": (block, block)}
    if granularity not in sizes:
        raise ValueError(f"unknown FP8 scaling granularity '{granularity}'")
    return sizes[granularity]


def _regions(shape: tuple[int, int], granularity: str, block: int):
    """Yield (row slice, col slice, rows per group, cols per group, group-row slice,
    group-col slice): rectangles of x made of equal groups (at most four: whole groups,
    the short last column of groups, the short last row, the corner)."""
    gr, gc = _group_sizes(shape, granularity, block)
    for r0, r1, rg in _spans(shape[0], gr):
        for c0, c1, cg in _spans(shape[1], gc):
            yield (slice(r0, r1), slice(c0, c1), rg, cg,
                   slice(-(-r0 // gr), -(-r1 // gr)), slice(-(-c0 // gc), -(-c1 // gc)))


def _grouped(t: torch.Tensor, rg: int, cg: int) -> torch.Tensor:
    """A (r, c) tensor viewed as (r/rg, rg, c/cg, cg): splitting a dim is always a view."""
    r, c = t.shape
    return t.view(r // rg, rg, c // cg, cg)


def _scale_shape(shape: tuple[int, int], granularity: str, block: int) -> tuple[int, ...]:
    gr, gc = _group_sizes(shape, granularity, block)
    if granularity == "tensorwise":
        return ()
    return (-(-shape[0] // gr), -(-shape[1] // gc))


def one_pass_amax(device: torch.device) -> bool:
    """Whether the per-group amax is one vector_norm pass (CUDA) or an amin and an amax
    pass (CPU, whose vector_norm(inf) is not vectorised: ~6x slower on bf16 than both)."""
    return device.type != "cpu"


def _absmax(groups: torch.Tensor, one_pass: bool) -> torch.Tensor:
    """max |x| over dims 1 and 3 of a (r/rg, rg, c/cg, cg) view."""
    if one_pass:
        return torch.linalg.vector_norm(groups, INF, dim=(1, 3))
    return torch.maximum(groups.amin(dim=(1, 3)).neg(), groups.amax(dim=(1, 3)))


def group_amax(x: torch.Tensor, granularity: str, block: int = FP8_BLOCK) -> torch.Tensor:
    """The amax of each scaling group of a 2-D x, in x's dtype (exact), NaN where a group
    holds a NaN; shaped as numerics.scaling's (), (M, 1), (M, K/128) or (M/128, K/128)."""
    x = x.detach()
    shape = tuple(x.shape)
    if granularity == "tensorwise":  # aminmax: one pass, and vectorised on CPU
        low, high = torch.aminmax(x)
        return torch.maximum(low.neg(), high)
    one_pass = one_pass_amax(x.device)
    regions = list(_regions(shape, granularity, block))
    if len(regions) == 1:  # whole groups: one reduction, no copy
        rows, cols, rg, cg, _, _ = regions[0]
        amax = _absmax(_grouped(x[rows, cols], rg, cg), one_pass)
        return amax.reshape(_scale_shape(shape, granularity, block))
    amax = x.new_empty(_scale_shape(shape, granularity, block))
    for rows, cols, rg, cg, grows, gcols in regions:
        amax[grows, gcols] = _absmax(_grouped(x[rows, cols], rg, cg), one_pass)
    return amax


def multiplier(amax: torch.Tensor, fmt: FloatFormat, pow2: bool = False) -> torch.Tensor:
    """numerics.scaling.amax_to_scale(amax, fmt, pow2), bit for bit, in half the small
    kernels: an amax is >= 0 or NaN, so "not finite" is `not amax < inf`, one comparison
    (amax_to_scale's isfinite and full_like take five), and the NaN put there is the same
    canonical NaN (a NaN amax may carry a sign, and F / NaN would keep it)."""
    amax64 = amax.detach().to(torch.float64)
    m = (fmt.max / amax64.clamp(min=SCALE_EPS)).to(torch.float32)
    if pow2:
        m = torch.exp2(torch.floor(torch.log2(m)))
    return torch.where(amax64 < INF, m, float("nan"))


def _multiplier_view(m: torch.Tensor, grows: slice, gcols: slice) -> torch.Tensor:
    """A group region's multipliers shaped to broadcast over (r/rg, rg, c/cg, cg), with
    dimensions even for one tensor-wide scale (so that bf16 x · m promotes to float32)."""
    m2 = m.reshape(1, 1) if m.dim() == 0 else m
    sub = m2[grows, gcols]
    return sub.reshape(sub.shape[0], 1, sub.shape[1], 1)


def scale_and_cast(x: torch.Tensor, multiplier: torch.Tensor, fmt: FloatFormat,
                   granularity: str, block: int = FP8_BLOCK,
                   pow2: bool = False) -> torch.Tensor:
    """fp8(float32(x) · m) per group, row-major whatever x's strides (see the module
    docstring for why no clamp is needed, and when a bf16 product is the same)."""
    x = x.detach()
    dtype = torch.bfloat16 if pow2 and x.dtype == torch.bfloat16 else torch.float32
    multiplier = multiplier.to(dtype)  # a power of two is exact in bf16
    scaled = torch.empty(x.shape, dtype=dtype, device=x.device)
    if granularity in ("tensorwise", "rowwise"):  # whole rows: m broadcasts as (1 or M, 1)
        torch.mul(x, multiplier.reshape(-1, 1), out=scaled)
        return scaled.to(fmt.dtype)
    for rows, cols, rg, cg, grows, gcols in _regions(tuple(x.shape), granularity, block):
        torch.mul(_grouped(x[rows, cols], rg, cg), _multiplier_view(multiplier, grows, gcols),
                  out=_grouped(scaled[rows, cols], rg, cg))
    return scaled.to(fmt.dtype)


def quantize(x: torch.Tensor, fmt: FloatFormat, granularity: str = "tensorwise",
             pow2: bool = False, block: int = FP8_BLOCK) -> FP8Tensor:
    """numerics.fp8.quantize(x, fmt, granularity, pow2, block), bit for bit (a NaN's sign
    bit aside: see the module docstring), in three passes over x."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    m = multiplier(group_amax(x, granularity, block), fmt, pow2)
    data = scale_and_cast(x, m, fmt, granularity, block, pow2)
    return FP8Tensor(data, m.reciprocal(), granularity, fmt, block)


def dequantize(q: FP8Tensor) -> torch.Tensor:
    """numerics.fp8.dequantize(q) in float32, bit for bit, without a full-size scale: the
    FP8 values widened once, multiplied in place by their groups' scales."""
    out = q.data.to(torch.float32)
    for rows, cols, rg, cg, grows, gcols in _regions(q.shape, q.granularity, q.block):
        _grouped(out[rows, cols], rg, cg).mul_(_multiplier_view(q.scale, grows, gcols))
    return out
