"""The blockwise recipe's tile cast over all routed tokens at once (`fp8_cast_group_tiles`).

For the FP8 linear, `fp8_cast_tiles` (numerics/fp8_cast.py) casts x in 1x128 tiles along K
(the forward's operand) and xᵀ in 1x128 tiles along the tokens (the weight gradient's). For
routed experts the second tiling restarts at each expert's first token: expert g's weight
gradient reduces over its own tokens only, and a tile straddling two experts would give
both a scale neither has alone. This op casts every expert's tokens in one call:

    codes   (T, K)    x in 1x128 tiles along K, as fp8_cast_tiles (a row's tiles do not
    scale   (T, KB)   depend on its expert); stored column by column
    codes_t (T·K,)    each expert's xᵀ (K, size_g) in 1x128 tiles along its own tokens,
                      row-major at offset start_g · K (`group_t` views it; no copy)
    scale_t (K, TB)   TB = Σ_g ceil(size_g / 128): expert g's tile scales at columns
                      [Σ_{h<g} ceil(size_h / 128), ...), stored column by column

from x, or (`requant`) from the dequantised row codes (DeepSeek-V3 §3.3.4, as the FP8
linear's saved input). Each expert's slices are byte-equal to fp8_cast_tiles of that
expert's rows alone (tests/test_fp8_experts_blockwise.py). One Triton kernel on a GPU
(numerics/fp8_group_triton.py); elsewhere the reference quantiser per expert.
"""

from __future__ import annotations

import torch

from fivefold.numerics.formats import FP8_BLOCK, FP8_FORMATS, SCALE_EPS
from fivefold.numerics.fp8 import quantize

try:
    from fivefold.numerics import fp8_group_triton as kernels
    from fivefold.numerics.fp8_cast import triton_usable
except ImportError:  # pragma: no cover - triton not installed
    kernels = None

    def triton_usable(device: torch.device) -> bool:
        return False

BLOCK = FP8_BLOCK


def tile_starts(sizes: list[int]) -> tuple[list[int], int]:
    """(each group's first column in scale_t, TB): ceil(size / 128) tiles per group."""
    starts, total = [], 0
    for s in sizes:
        starts.append(total)
        total += -(-s // BLOCK)
    return starts, total


def _m_major(rows: int, cols: int, device) -> torch.Tensor:
    return torch.empty_strided((rows, cols), (1, rows), dtype=torch.float32, device=device)


def group_t(codes_t: torch.Tensor, k: int, start: int, size: int) -> torch.Tensor:
    """Expert g's (K, size) block of the flat codes_t, a contiguous view."""
    return codes_t[start * k:(start + size) * k].view(k, size)


def _tile_table(sizes: list[int]) -> list[list[int]]:
    """[row0, rows, scale_t column, group start, group size] of every token tile."""
    table, start = [[], [], [], [], []], 0
    for size in sizes:
        for j in range(0, size, BLOCK):
            for column, value in zip(table, (start + j, min(BLOCK, size - j), len(table[2]),
                                             start, size)):
                column.append(value)
        start += size
    return table


@torch.library.custom_op("fivefold::fp8_cast_group_tiles", mutates_args=())
def fp8_cast_group_tiles(x: torch.Tensor, sizes: list[int], fmt: str, requant: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (T, K), scale (T, KB), codes_t (T·K,), scale_t (K, TB)): the module docstring."""
    if requant and fmt != "e4m3":
        raise ValueError("fp8_cast_group_tiles re-quantises E4M3 codes only")
    t, k = x.shape
    fmt_ = FP8_FORMATS[fmt]
    kb, (tstarts, tb) = -(-k // BLOCK), tile_starts(sizes)
    codes = torch.empty((t, k), dtype=fmt_.dtype, device=x.device)
    codes_t = torch.empty((t * k,), dtype=fmt_.dtype, device=x.device)
    scale, scale_t = _m_major(t, kb, x.device), _m_major(k, tb, x.device)
    if kernels is not None and triton_usable(x.device) and tb:
        table = torch.tensor(_tile_table(sizes), dtype=torch.int64, device=x.device)
        kernels.group_tiles_cast_kernel[(tb, kb)](
            x, x.stride(0), x.stride(1), table, codes.view(torch.uint8), scale,
            codes_t.view(torch.uint8), scale_t, t, k, tb, FMAX=fmt_.max, EPS=SCALE_EPS,
            MBITS=fmt_.mantissa_bits, BIAS=2 ** (fmt_.exponent_bits - 1) - 1,
            REQUANT=requant, BLOCK=BLOCK, num_warps=8)
        return codes, scale, codes_t, scale_t
    if t:
        q = quantize(x, fmt_, "tiles")
        codes.copy_(q.data)
        scale.copy_(q.scale)
    start = 0
    for size, ts in zip(sizes, tstarts):
        if size:
            rows = slice(start, start + size)
            source = (codes[rows].float() * scale[rows].repeat_interleave(BLOCK, 1)[:, :k]
                      if requant else x[rows])
            qt = quantize(source.t(), fmt_, "tiles")
            group_t(codes_t, k, start, size).copy_(qt.data)
            scale_t[:, ts:ts + qt.scale.shape[1]] = qt.scale
        start += size
    return codes, scale, codes_t, scale_t


@fp8_cast_group_tiles.register_fake
def _(x, sizes, fmt, requant):
    t, k = x.shape
    dtype = FP8_FORMATS[fmt].dtype
    return (x.new_empty((t, k), dtype=dtype), _m_major(t, -(-k // BLOCK), x.device),
            x.new_empty((t * k,), dtype=dtype), _m_major(k, tile_starts(sizes)[1], x.device))
