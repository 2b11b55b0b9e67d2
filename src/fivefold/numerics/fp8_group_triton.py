"""The Triton kernel of the grouped column cast (numerics/fp8_grouped.py registers it).

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

from fivefold.numerics.fp8_triton import _abs_or_inf, _encode, _multiplier


@triton.jit
def group_cols_cast_kernel(x_ptr, sxm, sxk, start_ptr, size_ptr, pstart_ptr, psize_ptr,
                           codes_ptr, scale_ptr, K, LD, BASE_MUL,
                           FMAX: tl.constexpr, EPS: tl.constexpr, MBITS: tl.constexpr,
                           BIAS: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr,
                           BK: tl.constexpr):
    g, pk = tl.program_id(0), tl.program_id(1)
    start = tl.load(start_ptr + g)
    size = tl.load(size_ptr + g)
    pstart = tl.load(pstart_ptr + g)
    psize = tl.load(psize_ptr + g)
    cols = pk * BK + tl.arange(0, BK)
    acc = tl.zeros([BM, BK], tl.float32)
    for m0 in range(0, size, BM):
        rows = m0 + tl.arange(0, BM)
        mask = (rows < size)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + (start + rows)[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                    other=0.0)
        acc = tl.maximum(acc, _abs_or_inf(x.to(tl.float32)))
    m, inv = _multiplier(tl.max(acc, axis=0), FMAX, EPS, POW2)
    tl.store(scale_ptr + g * K + cols, inv, mask=cols < K)
    base = pstart * BASE_MUL
    for m0 in range(0, psize, BM):
        rows = m0 + tl.arange(0, BM)
        load = (rows < size)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + (start + rows)[:, None] * sxm + cols[None, :] * sxk, mask=load,
                    other=0.0)
        store = (rows < psize)[:, None] & (cols < K)[None, :]
        code = _encode(x.to(tl.float32) * m[None, :], MBITS, BIAS)
        code = tl.where(load, code, 0)  # the padding: zero codes even where m is NaN
        tl.store(codes_ptr + base + cols[None, :] * LD + rows[:, None], code, mask=store)
