"""Triton kernels of the fused FP8 casts (numerics/fp8_cast.py registers them as ops).

Each kernel computes numerics.fp8.quantize's bytes for its groups: amax of |x| (a NaN
counts as inf: both make the multiplier NaN, numerics/scaling.py), the multiplier
m = fl32(F / max(amax, EPS)) in float64 (and, for rowwise, 2^floor(log2 m), the exponent
bits of m), the dequantisation scale fl32(1 / m) (in float64 then rounded: double rounding
of a quotient to float32 from 53 bits is innocuous, Figueroa 1995, so it equals float32's
correctly rounded reciprocal), y = fl32(float32(x) · m), and the FP8 code of y.

The code is made here from y's bits, round to nearest even, not by Triton's cast: Triton's
interpreter rounds a value up across a power of two without raising its exponent (31.6 to
e4m3 gives 16, not 32; triton 3.9), and a code made by integer arithmetic is the same on
any backend. No saturation is needed: |y| <= F (1 + 2^-22), which rounds to F
(lowp/quantize.py's module docstring proves it), and a NaN gets the code 0x7F with x's sign
(NaN in both formats; the reference's NaN byte may differ in its sign bit only).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _multiplier(amax, FMAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """(m, 1/m) in float32 for a float32 amax >= 0 (inf for a group with NaN or inf)."""
    a64 = amax.to(tl.float64)
    eps = tl.full(a64.shape, EPS, tl.float64)
    m = (tl.full(a64.shape, FMAX, tl.float64) / tl.maximum(a64, eps)).to(tl.float32)
    if POW2:
        m = (m.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    m = tl.where(a64 < float("inf"), m, float("nan"))
    inv = (tl.full(a64.shape, 1.0, tl.float64) / m.to(tl.float64)).to(tl.float32)
    return m, inv


@triton.jit
def _abs_or_inf(x):
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def _encode(y, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 byte (E = 8 - 1 - MBITS exponent bits, bias BIAS) of float32 y, RNE."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    # normal range: drop SHIFT mantissa bits, rounding half to even; a carry raises the
    # exponent as it should; then rebias the exponent from 127 to BIAS
    rounded = (mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT
    normal = rounded - ((127 - BIAS) << MBITS)
    # subnormal range (|y| < 2^(1-BIAS)): the significand in units of 2^(1-BIAS-MBITS),
    # shifted right by 23 + (1 - BIAS - MBITS) - e, rounding half to even
    exp = (mag >> 23) & 0xFF
    sig = (mag & 0x7FFFFF) | 0x800000
    sh = tl.minimum(23 + (1 - BIAS - MBITS) - (exp - 127), 31)
    sh = tl.maximum(sh, 1)
    half = (tl.full(sh.shape, 1, tl.int32) << (sh - 1)) - 1
    sub = (sig + half + ((sig >> sh) & 1)) >> sh
    sub = tl.where(exp == 0, 0, sub)  # float32 subnormals: far below FP8's smallest
    code = tl.where(exp - 127 < 1 - BIAS, sub, normal)
    code = tl.where(y != y, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _decode_e4m3(code):
    """The float32 value of an E4M3 byte (finite codes; 0x7F/0xFF give NaN)."""
    c = code.to(tl.int32)
    exp = (c >> 3) & 0xF
    man = c & 0x7
    normal = (((exp - 7 + 127) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # man · 2^-9
    value = tl.where((c & 0x7F) == 0x7F, float("nan"), value)
    return tl.where((c & 0x80) != 0, -value, value)


@triton.jit
def _rows_amax(x_ptr, sxm, sxk, rows, M, K, ROWS: tl.constexpr, BK: tl.constexpr):
    """max |x| of each of `rows` of a (M, K) x, swept BK columns at a time (NaN as inf)."""
    acc = tl.zeros([ROWS, BK], tl.float32)
    for k0 in range(0, K, BK):
        cols = (k0 + tl.arange(0, BK)).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
        acc = tl.maximum(acc, _abs_or_inf(x.to(tl.float32)))
    return tl.max(acc, axis=1)


@triton.jit
def amax_partials_kernel(x_ptr, sxm, sxk, part_ptr, M, K, ROWS: tl.constexpr,
                         BK: tl.constexpr):
    """part[p] = max |x| over rows [p·ROWS, (p+1)·ROWS) of a (M, K) x (NaN as inf)."""
    p = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements stay exact
    rows = p * ROWS + tl.arange(0, ROWS)
    amax = _rows_amax(x_ptr, sxm, sxk, rows, M, K, ROWS, BK)
    tl.store(part_ptr + p, tl.max(amax, axis=0))


@triton.jit
def tensorwise_cast_kernel(x_ptr, sxm, sxk, part_ptr, P, codes_ptr, codes_t_ptr, scale_ptr,
                           amax_ptr, M, K, FMAX: tl.constexpr, EPS: tl.constexpr,
                           MBITS: tl.constexpr, BIAS: tl.constexpr, POW2: tl.constexpr,
                           WRITE: tl.constexpr, WRITE_T: tl.constexpr, SATURATE: tl.constexpr,
                           RECORD: tl.constexpr, PB: tl.constexpr, BLOCK: tl.constexpr):
    """One tile of the tensorwise cast: the codes (M, K) and/or their transpose (K, M), with
    the multiplier from max(part[:P]): this tensor's partial amaxes (dynamic scaling) or an
    amax history (delayed scaling, whose scale may be below this tensor's amax: SATURATE
    clamps x · m to ±FMAX as the reference does). RECORD writes the tile's own amax to
    amax[program] (NaN as inf), the value delayed scaling records."""
    pm, pk = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    parts = tl.load(part_ptr + tl.arange(0, PB), mask=tl.arange(0, PB) < P, other=0.0)
    amax = tl.max(parts, axis=0)
    m, inv = _multiplier(amax, FMAX, EPS, POW2)
    if (pm == 0) & (pk == 0):
        tl.store(scale_ptr, inv)
    rows = pm * BLOCK + tl.arange(0, BLOCK)
    cols = pk * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                other=0.0).to(tl.float32)
    y = x * m
    if SATURATE:  # a NaN fails both comparisons and stays NaN
        y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
    code = _encode(y, MBITS, BIAS)
    if WRITE:
        tl.store(codes_ptr + rows[:, None] * K + cols[None, :], code, mask=mask)
    if WRITE_T:
        tl.store(codes_t_ptr + cols[None, :] * M + rows[:, None], code, mask=mask)
    if RECORD:
        tile = tl.max(tl.max(_abs_or_inf(x), axis=1), axis=0)
        tl.store(amax_ptr + pm * tl.num_programs(1) + pk, tile)


@triton.jit
def history_push_kernel(hist_ptr, H, amax_ptr, P, HB: tl.constexpr, PB: tl.constexpr):
    """One program: hist[1:] = hist[:-1], hist[0] = max(amax[:P]) (the newest amax first,
    Transformer Engine's amax_history order); all reads happen before the writes."""
    acc = tl.zeros([PB], tl.float32)
    for p0 in range(0, P, PB):
        idx = p0 + tl.arange(0, PB)
        acc = tl.maximum(acc, tl.load(amax_ptr + idx, mask=idx < P, other=0.0))
    newest = tl.max(acc, axis=0)
    h = tl.arange(0, HB)
    old = tl.load(hist_ptr + h - 1, mask=(h >= 1) & (h < H), other=0.0)
    tl.debug_barrier()
    tl.store(hist_ptr + h, tl.where(h == 0, newest, old), mask=h < H)


@triton.jit
def amax_fold_kernel(pending_ptr, amax_ptr, P, PB: tl.constexpr):
    """One program: pending[0] = max(pending[0], max(amax[:P])) (the step's record)."""
    acc = tl.zeros([PB], tl.float32)
    for p0 in range(0, P, PB):
        idx = p0 + tl.arange(0, PB)
        acc = tl.maximum(acc, tl.load(amax_ptr + idx, mask=idx < P, other=0.0))
    tl.store(pending_ptr, tl.maximum(tl.load(pending_ptr), tl.max(acc, axis=0)))


@triton.jit
def rows_cast_kernel(x_ptr, sxm, sxk, codes_ptr, scale_ptr, colpart_ptr, M, K,
                     FMAX: tl.constexpr, EPS: tl.constexpr, MBITS: tl.constexpr,
                     BIAS: tl.constexpr, POW2: tl.constexpr, COLS: tl.constexpr,
                     ROWS: tl.constexpr, BK: tl.constexpr):
    """ROWS rows of x cast with one scale per row; with COLS also each column's amax over
    these rows (colpart, (cdiv(M, ROWS), K)) for the column cast. Two sweeps over the rows:
    the amax, then the cast (the rows are read again, from cache)."""
    p = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements stay exact
    rows = p * ROWS + tl.arange(0, ROWS)
    amax = _rows_amax(x_ptr, sxm, sxk, rows, M, K, ROWS, BK)
    m, inv = _multiplier(amax, FMAX, EPS, POW2)
    tl.store(scale_ptr + rows, inv, mask=rows < M)
    for k0 in range(0, K, BK):
        cols = (k0 + tl.arange(0, BK)).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                    other=0.0).to(tl.float32)
        tl.store(codes_ptr + rows[:, None] * K + cols[None, :],
                 _encode(x * m[:, None], MBITS, BIAS), mask=mask)
        if COLS:
            tl.store(colpart_ptr + p * K + cols, tl.max(_abs_or_inf(x), axis=0), mask=cols < K)


@triton.jit
def cols_cast_kernel(x_ptr, sxm, sxk, colpart_ptr, P, codes_t_ptr, scale_t_ptr, M, K,
                     FMAX: tl.constexpr, EPS: tl.constexpr, MBITS: tl.constexpr,
                     BIAS: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr,
                     BK: tl.constexpr):
    """BK columns of x cast with one scale per column (their amax from the row kernel's
    partials), written transposed: codes_t (K, M), scale_t (K, 1)."""
    pk = tl.program_id(0).to(tl.int64)
    cols = pk * BK + tl.arange(0, BK)
    acc = tl.zeros([BM, BK], tl.float32)
    for p0 in range(0, P, BM):
        prow = p0 + tl.arange(0, BM)
        mask = (prow < P)[:, None] & (cols < K)[None, :]
        acc = tl.maximum(acc, tl.load(colpart_ptr + prow[:, None] * K + cols[None, :],
                                      mask=mask, other=0.0))
    m, inv = _multiplier(tl.max(acc, axis=0), FMAX, EPS, POW2)
    tl.store(scale_t_ptr + cols, inv, mask=cols < K)
    for m0 in range(0, M, BM):
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
        tl.store(codes_t_ptr + cols[None, :] * M + rows[:, None],
                 _encode(x.to(tl.float32) * m[None, :], MBITS, BIAS), mask=mask)


@triton.jit
def tiles_cast_kernel(x_ptr, sxm, sxk, codes_ptr, scale_ptr, codes_t_ptr, scale_t_ptr, M, K,
                      FMAX: tl.constexpr, EPS: tl.constexpr, MBITS: tl.constexpr,
                      BIAS: tl.constexpr, REQUANT: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK x BLOCK tile: its rows cast in 1xBLOCK tiles (codes (M, K), scale (M, KB)
    stored column by column), and its columns cast in 1xBLOCK tiles of the transpose
    (codes_t (K, M), scale_t (K, MB) column by column), from x itself or, with REQUANT,
    from the dequantised row codes (DeepSeek-V3's re-quantisation; E4M3 only)."""
    pm, pk = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rows = pm * BLOCK + tl.arange(0, BLOCK)
    cols = pk * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                other=0.0).to(tl.float32)
    m, inv = _multiplier(tl.max(_abs_or_inf(x), axis=1), FMAX, EPS, False)
    code = _encode(x * m[:, None], MBITS, BIAS)
    tl.store(codes_ptr + rows[:, None] * K + cols[None, :], code, mask=mask)
    tl.store(scale_ptr + pk * M + rows, inv, mask=rows < M)
    if REQUANT:
        src = _decode_e4m3(code) * inv[:, None]
    else:
        src = x
    m_t, inv_t = _multiplier(tl.max(_abs_or_inf(src), axis=0), FMAX, EPS, False)
    tl.store(codes_t_ptr + cols[None, :] * M + rows[:, None],
             _encode(src * m_t[None, :], MBITS, BIAS), mask=mask)
    tl.store(scale_t_ptr + pm * K + cols, inv_t, mask=cols < K)


@triton.jit
def blocks_cast_kernel(x_ptr, sxm, sxk, codes_ptr, scale_ptr, M, K, KB,
                       FMAX: tl.constexpr, EPS: tl.constexpr, MBITS: tl.constexpr,
                       BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK x BLOCK block with one scale: codes (M, K), scale (MB, KB) row-major."""
    pm, pk = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rows = pm * BLOCK + tl.arange(0, BLOCK)
    cols = pk * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                other=0.0).to(tl.float32)
    amax = tl.max(tl.max(_abs_or_inf(x), axis=1), axis=0)
    m, inv = _multiplier(amax, FMAX, EPS, False)
    tl.store(codes_ptr + rows[:, None] * K + cols[None, :], _encode(x * m, MBITS, BIAS),
             mask=mask)
    tl.store(scale_ptr + pm * KB + pk, inv)
