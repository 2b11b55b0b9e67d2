"""Grouped rowwise FP8: one cast over all routed tokens, one GEMM for all experts.

Routed experts see their tokens sorted by expert, `sizes[g]` rows for expert g. The three
GEMMs of each projection, per expert g (numerics/fp8.py's a · bᵀ, both along K):

    forward   y_g  = x_g · W_gᵀ       x rows along K (per token), W_g rows along K
    dgrad     ∂x_g = ∂y_g · W_g       ∂y rows along N, W_gᵀ rows along N
    wgrad     ∂W_g = ∂y_gᵀ · x_g      ∂y_gᵀ and x_gᵀ rows along the tokens *of group g*

A token's row scale does not depend on its group, so x, ∂y (and W as (G·N, K)) are cast
once over all rows (numerics/fp8_cast.py's row cast). The wgrad's operands are cast per
(group, column): `fp8_cast_group_cols`, one op (one Triton kernel on a GPU) for all groups.

The GEMMs, as custom ops (a trace sees one op each; torch.compile keeps them as calls):

    fp8_grouped_mm        a (T, K) · b_g (N, K)ᵀ per group of a's rows -> (T, N)
    fp8_grouped_wgrad_mm  a (N, Tp) · b (K, Tp)ᵀ per group of columns  -> (G, N, K)

On CUDA with compute capability 9.x/10.x and a torch that has `torch._scaled_grouped_mm`
(checked once per device by a probe against the per-group path) each is one call of it:
the 2-D x 3-D form for the first, the 2-D x 2-D form for the second. Elsewhere (a CPU, an
older GPU) each runs per group on `fivefold::fp8_scaled_mm` (torch._scaled_mm), the same
calls the per-expert FP8 linear makes, so the CPU's result equals the per-expert loop's
bit for bit (tests/test_fp8_grouped.py).

Padding (aten/src/ATen/native/cuda/GroupMMCommon.cuh `prepare_grouped_gemm_data`: TMA
needs 16-byte aligned group addresses along a dynamic dimension): the 2-D x 2-D form
slices the groups along K, the contiguous dimension, so each group's token count must be a
multiple of 16 FP8 elements. The grouped column cast writes each group at a padded start
(`ALIGN` = 16) with zero codes in between; zeros add nothing to a dot product, so nothing
else is padded or copied. The 2-D x 3-D form slices rows and needs no padding.

Differences on the GPU's grouped kernel: it writes bf16 only (an fp32 caller gets a
bf16-rounded result, then widened), and its fp32 sums run in another order than torch's
per-group kernel. An expert with no tokens gets a zero weight gradient (set explicitly:
an empty group's K is 0).
"""

from __future__ import annotations

import functools

import torch

from fivefold.numerics.formats import FP8_FORMATS, SCALE_EPS
from fivefold.numerics.fp8 import quantize
from fivefold.numerics.fp8_ops import fp8_scaled_mm

try:
    from fivefold.numerics import fp8_group_triton as kernels
    from fivefold.numerics.fp8_cast import triton_usable
except ImportError:  # pragma: no cover - triton not installed
    kernels = None

    def triton_usable(device: torch.device) -> bool:
        return False

ALIGN = 16  # tokens per group in the 2-D x 2-D grouped GEMM: 16 bytes of FP8


def padded_layout(sizes: list[int], align: int) -> tuple[list[int], list[int], int]:
    """(padded sizes, padded starts, total) with each size rounded up to `align`."""
    psizes = [-(-s // align) * align for s in sizes]
    starts, total = [], 0
    for p in psizes:
        starts.append(total)
        total += p
    return psizes, starts, total


def _starts(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


# ---- the grouped column cast ----------------------------------------------------------

def _group_cols_shape(x, sizes, align, stacked):
    k = x.shape[1]
    if stacked:
        return (len(sizes), k, sizes[0] if sizes else 0)
    return (k, padded_layout(sizes, align)[2])


@torch.library.custom_op("fivefold::fp8_cast_group_cols", mutates_args=())
def fp8_cast_group_cols(x: torch.Tensor, sizes: list[int], align: int, stacked: bool,
                        fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K), rows grouped by `sizes`: each group's xᵀ cast along its rows (one scale
    per group and column). codes: (K, Tp) with group g at its start padded to `align`
    and zero codes in the padding, or (`stacked`, all sizes equal) (G, K, n); scale (G, K)."""
    k = x.shape[1]
    fmt_ = FP8_FORMATS[fmt]
    shape = _group_cols_shape(x, sizes, align, stacked)
    scale = torch.empty((len(sizes), k), dtype=torch.float32, device=x.device)
    psizes, pstarts, _ = padded_layout(sizes, 1 if stacked else align)
    if kernels is not None and triton_usable(x.device) and sizes:
        codes = torch.empty(shape, dtype=fmt_.dtype, device=x.device)
        meta = torch.tensor([_starts(sizes), sizes, pstarts, psizes], dtype=torch.int64,
                            device=x.device)
        ld, mul = (shape[2], k) if stacked else (shape[1], 1)
        kernels.group_cols_cast_kernel[(len(sizes), -(-k // 32))](
            x, x.stride(0), x.stride(1), meta[0], meta[1], meta[2], meta[3],
            codes.view(torch.uint8), scale, k, ld, mul, FMAX=fmt_.max, EPS=SCALE_EPS,
            MBITS=fmt_.mantissa_bits, BIAS=2 ** (fmt_.exponent_bits - 1) - 1, POW2=pow2,
            BM=64, BK=32)
        return codes, scale
    codes = torch.zeros(shape, dtype=fmt_.dtype, device=x.device)
    for g, (start, size) in enumerate(zip(_starts(sizes), sizes)):
        rows = x[start:start + size] if size else x.new_zeros(1, k)  # empty: amax 0
        q = quantize(rows.t(), fmt_, "rowwise", pow2)
        scale[g] = q.scale.reshape(-1)
        if size and stacked:
            codes[g] = q.data
        elif size:
            codes[:, pstarts[g]:pstarts[g] + size] = q.data
    return codes, scale


@fp8_cast_group_cols.register_fake
def _(x, sizes, align, stacked, fmt, pow2):
    return (x.new_empty(_group_cols_shape(x, sizes, align, stacked), dtype=FP8_FORMATS[fmt].dtype),
            x.new_empty((len(sizes), x.shape[1]), dtype=torch.float32))


# ---- the grouped GEMMs -----------------------------------------------------------------

@functools.cache
def _grouped_probe(device: torch.device) -> tuple[bool, str]:
    """Run both grouped forms once on uneven groups (an empty one too) against the
    per-group path; any error or a wrong result says "not here"."""
    gen = torch.Generator(device=device).manual_seed(0)
    sizes, k, n = [5, 0, 27], 32, 48

    def codes(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.float8_e4m3fn)

    def scales(*shape):
        return torch.rand(*shape, device=device, generator=gen) + 0.5

    t = sum(sizes)
    a, b, sa, sb = codes(t, k), codes(3, n, k), scales(t, 1), scales(3, n)
    _, pstarts, tp = padded_layout(sizes, ALIGN)
    at, bt, sat, sbt = codes(n, tp), codes(k, tp), scales(3, n), scales(3, k)
    try:
        got = (_scaled_grouped(a, b, sa, sb, sizes), _scaled_grouped_wgrad(at, bt, sat, sbt,
                                                                           sizes))
        want = (_per_group_mm(a, b, sa, sb, sizes, torch.bfloat16),
                _per_group_wgrad(at, bt, sat, sbt, sizes, torch.bfloat16))
    except Exception as e:  # noqa: BLE001  any failure (a changed signature too) says "no"
        text = str(e).strip().splitlines()
        return False, (f"the _scaled_grouped_mm probe failed: {type(e).__name__}: "
                       f"{text[0] if text else ''}")
    for g, w in zip(got, want):
        rel = ((g.double() - w.double()).norm() / w.double().norm()).item()
        if not rel < 2.0**-7:  # both round to bf16; the sums' order differs
            return False, f"the _scaled_grouped_mm probe is off by {rel:.1e} (relative)"
    return True, "torch._scaled_grouped_mm"


def grouped_support(device: torch.device) -> tuple[bool, str]:
    """(True, what) where `torch._scaled_grouped_mm` runs on `device`, else (False, why)."""
    if device.type != "cuda":
        return False, f"device {device.type}: torch._scaled_grouped_mm is CUDA-only"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False, f"torch {torch.__version__} has no _scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return False, (f"compute capability {major}.{minor}: torch._scaled_grouped_mm "
                       f"needs 9.x or 10.x")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _grouped_probe(torch.device("cuda", index))


def _aligned(*dims: int) -> bool:
    """The grouped kernel takes K and N in multiples of 16 only (GroupedBlas.cpp's checks);
    other widths run per group, where fp8_ops.py pads them."""
    return all(d % ALIGN == 0 for d in dims)


def _offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    ends, total = [], 0
    for s in sizes:
        total += s
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _scaled_grouped(a, b, scale_a, scale_b, sizes):
    """2-D x 3-D: b (G, N, K) row-major, passed as its column-major transpose."""
    return torch._scaled_grouped_mm(a, b.transpose(-2, -1), scale_a.reshape(-1),
                                    scale_b, _offsets(sizes, a.device),
                                    out_dtype=torch.bfloat16)


def _scaled_grouped_wgrad(a, b, scale_a, scale_b, sizes):
    """2-D x 2-D: groups along Tp at their padded starts (zero codes between)."""
    psizes, _, _ = padded_layout(sizes, ALIGN)
    out = torch._scaled_grouped_mm(a, b.t(), scale_a.reshape(-1), scale_b.reshape(-1),
                                   _offsets(psizes, a.device), out_dtype=torch.bfloat16)
    empty = [g for g, s in enumerate(sizes) if s == 0]
    if empty:  # K = 0: the kernel need not write these groups
        out[empty] = 0
    return out


def _per_group_mm(a, b, scale_a, scale_b, sizes, out_dtype):
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    for g, (start, size) in enumerate(zip(_starts(sizes), sizes)):
        if size:
            out[start:start + size] = fp8_scaled_mm(a[start:start + size], b[g],
                                                    scale_a[start:start + size],
                                                    scale_b[g].reshape(1, -1), out_dtype)
    return out


def _per_group_wgrad(a, b, scale_a, scale_b, sizes, out_dtype):
    _, pstarts, _ = padded_layout(sizes, ALIGN)
    out = torch.zeros(len(sizes), a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    for g, (start, size) in enumerate(zip(pstarts, sizes)):
        if size:
            out[g] = fp8_scaled_mm(a[:, start:start + size], b[:, start:start + size],
                                   scale_a[g].reshape(-1, 1), scale_b[g].reshape(1, -1),
                                   out_dtype)
    return out


@torch.library.custom_op("fivefold::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, sizes: list[int],
                   out_dtype: torch.dtype) -> torch.Tensor:
    """a (T, K) rows grouped by `sizes`, b (G, N, K): a_g · b_gᵀ per group -> (T, N);
    scale_a (T, 1) per row of a, scale_b (G, N) per row of b_g."""
    if _aligned(a.shape[1], b.shape[1]) and grouped_support(a.device)[0]:
        return _scaled_grouped(a, b.contiguous(), scale_a, scale_b, sizes).to(out_dtype)
    return _per_group_mm(a, b, scale_a, scale_b, sizes, out_dtype)


@fp8_grouped_mm.register_fake
def _(a, b, scale_a, scale_b, sizes, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("fivefold::fp8_grouped_wgrad_mm", mutates_args=())
def fp8_grouped_wgrad_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                         scale_b: torch.Tensor, sizes: list[int],
                         out_dtype: torch.dtype) -> torch.Tensor:
    """a (N, Tp), b (K, Tp), group g's `sizes[g]` columns at its start padded to ALIGN
    (fp8_cast_group_cols' layout); scale_a (G, N), scale_b (G, K): a_g · b_gᵀ per group
    -> (G, N, K), zero for an empty group."""
    if _aligned(a.shape[0], b.shape[0]) and grouped_support(a.device)[0]:
        return _scaled_grouped_wgrad(a, b, scale_a, scale_b, sizes).to(out_dtype)
    return _per_group_wgrad(a, b, scale_a, scale_b, sizes, out_dtype)


@fp8_grouped_wgrad_mm.register_fake
def _(a, b, scale_a, scale_b, sizes, out_dtype):
    return a.new_empty((len(sizes), a.shape[0], b.shape[0]), dtype=out_dtype)


def _register_flops() -> None:
    """2·(rows)·K·N for each (the padding's zero columns count in the wgrad's)."""
    try:
        from torch.utils.flop_counter import register_flop_formula
    except ImportError:  # pragma: no cover
        return

    def forward_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    def wgrad_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[0]

    register_flop_formula(torch.ops.fivefold.fp8_grouped_mm)(forward_flops)
    register_flop_formula(torch.ops.fivefold.fp8_grouped_wgrad_mm)(wgrad_flops)


_register_flops()
