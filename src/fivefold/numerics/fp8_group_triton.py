"""Triton kernels of the grouped FP8 casts: the column cast (registered by
numerics/fp8_grouped.py, rowwise experts) and the tile cast (numerics/fp8_grouped_tiles.py,
blockwise experts; its own docstring below).

Routed experts' tokens lie sorted by expert in one (T, K) tensor, expert g's rows at
[start_g, start_g + size_g). The weight gradient of expert g reads xᵀ of its own rows,
quantised along the tokens: one scale per (group, column). One program casts BK columns of
one group: a sweep over the group's rows for each column's amax, then a sweep that writes
the codes transposed, at the group's place in the output:

    out[base_g + k · LD + (t - start_g)]     base_g = pstart_g · BASE_MUL

(LD = Tp, BASE_MUL = 1: the (K, Tp) layout of the 2-D x 2-D grouped GEMM, each group
starting at its padded start pstart_g; LD = n, BASE_MUL = K: (G, K, n) stacked blocks,
the transposed weights of the input gradient). The second sweep runs over the padded rows,
so the padding between groups gets zero codes from the kernel itself (no separate fill).
The scale arithmetic and the code are numerics/fp8_triton.py's, so the bytes equal
numerics.fp8.quantize's of each group's xᵀ.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fivefold.numerics.fp8_triton import _abs_or_inf, _decode_e4m3, _encode, _multiplier


@triton.jit
def group_cols_cast_kernel(x_ptr, sxm, sxk, start_ptr, size_ptr, pstart_ptr, psize_ptr,
                           codes_ptr, scale_ptr, K, LD, BASE_MUL,
                           FMAX: tl.constexpr, EPS: tl.constexpr, MBITS: tl.constexpr,
                           BIAS: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr,
                           BK: tl.constexpr):
    g, pk = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets past 2^31
    start = tl.load(start_ptr + g).to(tl.int64)
    size = tl.load(size_ptr + g)
    pstart = tl.load(pstart_ptr + g).to(tl.int64)
    psize = tl.load(psize_ptr + g)
    cols = pk * BK + tl.arange(0, BK)
    acc = tl.zeros([BM, BK], tl.float32)
    for m0 in range(0, size, BM):
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)
        mask = (rows < size)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + (start + rows)[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                    other=0.0)
        acc = tl.maximum(acc, _abs_or_inf(x.to(tl.float32)))
    m, inv = _multiplier(tl.max(acc, axis=0), FMAX, EPS, POW2)
    tl.store(scale_ptr + g * K + cols, inv, mask=cols < K)
    base = pstart * BASE_MUL
    for m0 in range(0, psize, BM):
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)
        load = (rows < size)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + (start + rows)[:, None] * sxm + cols[None, :] * sxk, mask=load,
                    other=0.0)
        store = (rows < psize)[:, None] & (cols < K)[None, :]
        code = _encode(x.to(tl.float32) * m[None, :], MBITS, BIAS)
        code = tl.where(load, code, 0)  # the padding: zero codes even where m is NaN
        tl.store(codes_ptr + base + cols[None, :] * LD + rows[:, None], code, mask=store)


@triton.jit
def group_tiles_cast_kernel(x_ptr, sxm, sxk, tile_ptr, codes_ptr, scale_ptr, codes_t_ptr,
                            scale_t_ptr, T, K, NT, FMAX: tl.constexpr, EPS: tl.constexpr,
                            MBITS: tl.constexpr, BIAS: tl.constexpr, REQUANT: tl.constexpr,
                            BLOCK: tl.constexpr):
    """numerics/fp8_triton.py's tiles_cast_kernel with the token tiles of the transpose
    starting at each group's first row: program (p, pk) casts rows [row0, row0 + n) of
    token tile p (tile_ptr: row0, n, and its column in scale_t, NT apart) and columns
    [pk·BLOCK, +BLOCK). Row tiles along K do not depend on the groups. codes_t is flat:
    group g's xᵀ (K, size_g) row-major at g's first row times K (tile_ptr: gstart, gsize)."""
    p, pk = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets past 2^31
    row0 = tl.load(tile_ptr + p).to(tl.int64)
    n = tl.load(tile_ptr + NT + p)
    tcol = tl.load(tile_ptr + 2 * NT + p).to(tl.int64)
    gstart = tl.load(tile_ptr + 3 * NT + p).to(tl.int64)
    gsize = tl.load(tile_ptr + 4 * NT + p)
    rows = row0 + tl.arange(0, BLOCK)
    cols = pk * BLOCK + tl.arange(0, BLOCK)
    live = tl.arange(0, BLOCK) < n
    mask = live[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                other=0.0).to(tl.float32)
    m, inv = _multiplier(tl.max(_abs_or_inf(x), axis=1), FMAX, EPS, False)
    code = _encode(x * m[:, None], MBITS, BIAS)
    tl.store(codes_ptr + rows[:, None] * K + cols[None, :], code, mask=mask)
    tl.store(scale_ptr + pk * T + rows, inv, mask=live)
    if REQUANT:
        src = tl.where(mask, _decode_e4m3(code) * inv[:, None], 0.0)
    else:
        src = x
    m_t, inv_t = _multiplier(tl.max(_abs_or_inf(src), axis=0), FMAX, EPS, False)
    tl.store(codes_t_ptr + gstart * K + cols[None, :] * gsize + (rows - gstart)[:, None],
             _encode(src * m_t[None, :], MBITS, BIAS), mask=mask)
    tl.store(scale_t_ptr + tcol * K + cols, inv_t, mask=cols < K)
