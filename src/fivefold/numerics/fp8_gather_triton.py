"""Triton kernels of ZeRO-3's FP8 gather (numerics/fp8_gather.py registers them as ops).

A unit's gather is cut into pieces (parallel/zero3_fp8.py `FP8UnitGather`): runs of
elements that are either one weight's (cast to E4M3 with that weight's multiplier, scale
index k >= 0) or other parameters' (norms, padding: raw bytes of their dtype, k = -1).
Each kernel takes a table of its pieces, one int64 row each:

    (first block, source offset, destination offset, elements, k)

where the offsets count bytes for an FP8 piece's codes and elements of the dtype for a raw
piece's (a raw piece lies at an offset aligned to its dtype). Program p does BLOCK
elements of the piece whose first block is the last one <= p, so one launch covers all
pieces however uneven their lengths; the table is a few rows per rank.

The codes are numerics/fp8_triton.py's `_encode` of y = clamp(fl32(x) · m, ±F) (round to
nearest even, from y's bits), the bytes of torch's `(x.float() * m).clamp(-F, F)
.to(float8_e4m3fn)`; the unpack decodes a code exactly (`_decode_e4m3`), multiplies by
the weight's scale in float32 and rounds to the buffer's dtype, the bytes of torch's
`(codes.float() * scale).to(dtype)`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fivefold.numerics.fp8_triton import _decode_e4m3, _encode

ROW = tl.constexpr(5)  # int64 fields per table row (a constexpr: kernels read it)


@triton.jit
def _piece(table_ptr, P, p, PB: tl.constexpr):
    """Program p's piece: (elements' offsets within it, mask, source, destination, k)."""
    rows = tl.arange(0, PB)
    firsts = tl.load(table_ptr + rows * ROW, mask=rows < P, other=9223372036854775807)
    piece = (tl.sum((firsts <= p).to(tl.int32), axis=0) - 1).to(tl.int64)
    base = table_ptr + piece * ROW
    first, src, dst = tl.load(base), tl.load(base + 1), tl.load(base + 2)
    n, k = tl.load(base + 3), tl.load(base + 4)
    return first, src, dst, n, k


@triton.jit
def gather_pack_kernel(local_ptr, table_ptr, P, mult_ptr, send_ptr, send_typed_ptr,
                       FMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                       PB: tl.constexpr, BLOCK: tl.constexpr):
    """One block of a rank's message: an FP8 piece's codes (send, bytes) or a raw piece
    copied as it is (send_typed: the same message viewed as the shard's dtype)."""
    p = tl.program_id(0).to(tl.int64)
    first, src, dst, n, k = _piece(table_ptr, P, p, PB)
    idx = (p - first) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(local_ptr + src + idx, mask=mask, other=0.0)
    m = tl.load(mult_ptr + tl.maximum(k, 0))
    y = x.to(tl.float32) * m
    y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))  # NaN stays NaN
    fp8 = (k + tl.zeros([BLOCK], tl.int64)) >= 0  # a block mask (a scalar & a block is not)
    tl.store(send_ptr + dst + idx, _encode(y, MBITS, BIAS), mask=mask & fp8)
    tl.store(send_typed_ptr + dst + idx, x, mask=mask & ~fp8)


@triton.jit
def gather_unpack_kernel(out_ptr, out_typed_ptr, table_ptr, P, scale_ptr, codes_ptr,
                         full_ptr, PB: tl.constexpr, BLOCK: tl.constexpr):
    """One block of the gathered messages: an FP8 piece's codes into the unit's byte
    buffer and their dequantised values into its `full` buffer, in one pass; a raw piece
    (out_typed: the messages viewed as full's dtype) into `full` as it is."""
    p = tl.program_id(0).to(tl.int64)
    first, src, dst, n, k = _piece(table_ptr, P, p, PB)
    idx = (p - first) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    fp8 = (k + tl.zeros([BLOCK], tl.int64)) >= 0
    code = tl.load(out_ptr + src + idx, mask=mask & fp8, other=0)
    tl.store(codes_ptr + dst + idx, code, mask=mask & fp8)
    value = (_decode_e4m3(code) * tl.load(scale_ptr + tl.maximum(k, 0))).to(
        full_ptr.dtype.element_ty)
    raw = tl.load(out_typed_ptr + src + idx, mask=mask & ~fp8, other=0.0)
    tl.store(full_ptr + dst + idx, tl.where(fp8, value, raw), mask=mask)
