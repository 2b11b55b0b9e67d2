"""Fused FP8 casts: each operand's codes, scales and transposed copy in one kernel per pass.

numerics.fp8.quantize is the reference; lowp/quantize.py computes its bytes in three passes
of small torch ops (amax, scale, cast) plus a copy for each transpose, ~14-20 kernels per
operand once the scale arithmetic is counted. Here each pass over an operand is one Triton
kernel (numerics/fp8_triton.py), registered as a torch custom op so that a trace
(fivefold.trace) sees one op with its bytes (inputs read, outputs written) and
torch.compile keeps it as a call:

    op                     reads            writes                               passes
    fp8_amax_partials      x                <= 256 partial amaxes                  1
    fp8_cast_tensorwise    x, partials      codes and/or codesᵀ, scale ()          1
    fp8_cast_delayed       x, history       codes and/or codesᵀ, scale (),         1
                                            each 64x64 tile's amax
    fp8_history_push       history, amaxes  history (H floats)                     -
    fp8_amax_fold          pending, amaxes  pending (1 float): max with the amaxes  -
    fp8_cast_rows          x                codes, scale (M, 1), column partials   1 (*)
    fp8_cast_cols          x, partials      codesᵀ (K, M), scale (K, 1)            1
    fp8_cast_tiles         x                codes, (M, K/128); codesᵀ, (K, M/128)  1
    fp8_cast_blocks        x                codes, scale (M/128, K/128)            1

(*) a program sweeps its 32 rows twice, for their amax and then the cast; the second sweep
reads the 32 rows again, from the cache if they are still there (the trace counts x once).

Tensorwise needs the whole tensor's amax before the first code, so it is two kernels
(delayed scaling takes the amax from earlier steps' history instead: one, lowp/delayed.py); a
tile's or a block's amax lies within the tile, so blockwise is one. Rowwise needs each
row's amax (within a program) and, for the transposed copy, each column's: the row kernel
leaves each column's amax over its rows behind, and the column kernel reduces those.

Layouts: codes are row-major, codesᵀ row-major (K, M); the tile scales are stored column by
column (strides (1, M)), the layout cuBLASLt's blockwise GEMM reads them in
(numerics/fp8_kernel.py), so no copy is made before the GEMM.

Where these run: on a GPU with Triton (and on any device under TRITON_INTERPRET=1, for the
tests). A GPU without Triton runs the reference quantiser and copies into the same layouts.
On meta (a trace) the fake implementations give the outputs' shapes.
"""

from __future__ import annotations

import torch

from fivefold.numerics.formats import FP8_BLOCK, FP8_FORMATS, SCALE_EPS
from fivefold.numerics.fp8 import quantize, quantize_with_amax
from fivefold.numerics.kernel_support import triton_usable

try:
    import triton

    from fivefold.numerics import fp8_triton as kernels
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

MAX_PARTIALS = 256  # fp8_amax_partials' outputs: each cast program reads them all
ROWS = 32  # rows per program of the row cast (its column partials: cdiv(M, 32) x K fp32)
BLOCK = FP8_BLOCK


def _constants(fmt_name: str) -> dict:
    fmt = FP8_FORMATS[fmt_name]
    return {"FMAX": fmt.max, "EPS": SCALE_EPS, "MBITS": fmt.mantissa_bits,
            "BIAS": 2 ** (fmt.exponent_bits - 1) - 1}


def _bytes_view(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


def _rows_per_partial(m: int) -> int:
    """Rows per partial amax: a power of two >= 16, so that there are <= MAX_PARTIALS."""
    return max(16, 1 << max(0, (_cdiv(m, MAX_PARTIALS) - 1).bit_length()))


def _num_partials(m: int) -> int:
    return max(1, _cdiv(m, _rows_per_partial(m)))


def _m_major(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    return torch.empty_strided((rows, cols), (1, rows), dtype=torch.float32, device=device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- tensorwise: the amax partials, then the cast --------------------------------------

@torch.library.custom_op("fivefold::fp8_amax_partials", mutates_args=())
def fp8_amax_partials(x: torch.Tensor) -> torch.Tensor:
    """Partial amaxes of a 2-D x (NaN counted as inf), <= 256 of them, fp32."""
    m, k = x.shape
    out = torch.empty(_num_partials(m), dtype=torch.float32, device=x.device)
    if triton_usable(x.device):
        rows = _rows_per_partial(m)
        kernels.amax_partials_kernel[(out.numel(),)](x, x.stride(0), x.stride(1), out, m, k,
                                                    ROWS=rows, BK=max(16, 4096 // rows))
        return out
    a = x.detach().float().abs().nan_to_num(nan=float("inf"))
    out.fill_(0.0)
    out[0] = a.max() if a.numel() else 0.0
    return out


@fp8_amax_partials.register_fake
def _(x):
    return x.new_empty((_num_partials(x.shape[0]),), dtype=torch.float32)


def _tensorwise_shapes(x, write, write_t):
    m, k = x.shape
    return (m, k) if write else (0, 0), (k, m) if write_t else (0, 0)


def _launch_tensorwise(x, source, fmt, write, write_t, codes, codes_t, scale, amax,
                       pow2=False, saturate=False):
    """The tensorwise cast kernel with its multiplier from max(source) (Triton)."""
    m, k = x.shape
    grid = (_cdiv(m, 64), _cdiv(k, 64))
    kernels.tensorwise_cast_kernel[grid](
        # an output not written passes another tensor's pointer (an empty tensor may
        # have none); the WRITE/RECORD flags remove its stores at compile time
        x, x.stride(0), x.stride(1), source, source.numel(),
        _bytes_view(codes) if write else scale, _bytes_view(codes_t) if write_t else scale,
        scale, amax if amax is not None else scale, m, k, **_constants(fmt), POW2=pow2,
        WRITE=write, WRITE_T=write_t, SATURATE=saturate, RECORD=amax is not None,
        PB=triton.next_power_of_2(source.numel()), BLOCK=64)


@torch.library.custom_op("fivefold::fp8_cast_tensorwise", mutates_args=())
def fp8_cast_tensorwise(x: torch.Tensor, partials: torch.Tensor, fmt: str, write: bool,
                        write_t: bool, pow2: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (M, K) if `write`, codesᵀ (K, M) if `write_t`, the scale ()) of x; `pow2`
    rounds the multiplier down to a power of two (the rowwise_gw_hp recipe's Wᵀ)."""
    dtype = FP8_FORMATS[fmt].dtype
    shape, shape_t = _tensorwise_shapes(x, write, write_t)
    codes = torch.empty(shape, dtype=dtype, device=x.device)
    codes_t = torch.empty(shape_t, dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    if triton_usable(x.device):
        _launch_tensorwise(x, partials, fmt, write, write_t, codes, codes_t, scale, None, pow2)
        return codes, codes_t, scale
    q = quantize(x, FP8_FORMATS[fmt], "tensorwise", pow2)
    if write:
        codes.copy_(q.data)
    if write_t:
        codes_t.copy_(q.data.t())
    return codes, codes_t, scale.copy_(q.scale)


@fp8_cast_tensorwise.register_fake
def _(x, partials, fmt, write, write_t, pow2=False):
    dtype = FP8_FORMATS[fmt].dtype
    shape, shape_t = _tensorwise_shapes(x, write, write_t)
    return (x.new_empty(shape, dtype=dtype), x.new_empty(shape_t, dtype=dtype),
            x.new_empty((), dtype=torch.float32))


# ---- delayed tensorwise: the cast with a scale from the amax history, then its record ---

def _tiles64(x) -> int:
    return _cdiv(x.shape[0], 64) * _cdiv(x.shape[1], 64)


@torch.library.custom_op("fivefold::fp8_cast_delayed", mutates_args=())
def fp8_cast_delayed(x: torch.Tensor, history: torch.Tensor, fmt: str, write: bool,
                     write_t: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes if `write`, codesᵀ if `write_t`, the scale (), each 64x64 tile's amax) of x,
    cast with the multiplier of amax = max(history) and saturated to the format's range
    (numerics.fp8.quantize_with_amax's bytes), in one pass that also records x's amax."""
    dtype = FP8_FORMATS[fmt].dtype
    shape, shape_t = _tensorwise_shapes(x, write, write_t)
    codes = torch.empty(shape, dtype=dtype, device=x.device)
    codes_t = torch.empty(shape_t, dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    amax = torch.empty(_tiles64(x), dtype=torch.float32, device=x.device)
    if triton_usable(x.device):
        _launch_tensorwise(x, history, fmt, write, write_t, codes, codes_t, scale, amax,
                           saturate=True)
        return codes, codes_t, scale, amax
    q = quantize_with_amax(x, history.max(), FP8_FORMATS[fmt])
    if write:
        codes.copy_(q.data)
    if write_t:
        codes_t.copy_(q.data.t())
    amax.fill_(0.0)
    amax[0] = x.detach().float().abs().nan_to_num(nan=float("inf")).max()
    return codes, codes_t, scale.copy_(q.scale), amax


@fp8_cast_delayed.register_fake
def _(x, history, fmt, write, write_t):
    dtype = FP8_FORMATS[fmt].dtype
    shape, shape_t = _tensorwise_shapes(x, write, write_t)
    return (x.new_empty(shape, dtype=dtype), x.new_empty(shape_t, dtype=dtype),
            x.new_empty((), dtype=torch.float32), x.new_empty((_tiles64(x),),
                                                              dtype=torch.float32))


@torch.library.custom_op("fivefold::fp8_history_push", mutates_args=("history",))
def fp8_history_push(history: torch.Tensor, amax: torch.Tensor) -> None:
    """history[1:] = history[:-1]; history[0] = max(amax): one amax history row (H,) takes
    the newest amax, the oldest falls out."""
    if triton_usable(history.device):
        kernels.history_push_kernel[(1,)](history, history.numel(), amax, amax.numel(),
                                          HB=triton.next_power_of_2(history.numel()),
                                          PB=min(1024, triton.next_power_of_2(amax.numel())))
        return
    newest = amax.max().reshape(1)
    history.copy_(torch.cat([newest, history[:-1]]))


@fp8_history_push.register_fake
def _(history, amax):
    return None


@torch.library.custom_op("fivefold::fp8_amax_fold", mutates_args=("pending",))
def fp8_amax_fold(pending: torch.Tensor, amax: torch.Tensor) -> None:
    """pending[0] = max(pending[0], max(amax)): a step's pending amax record (1,) takes one
    more cast's tile amaxes (delayed scaling folds every cast of a step, lowp/delayed.py)."""
    if triton_usable(pending.device):
        kernels.amax_fold_kernel[(1,)](pending, amax, amax.numel(),
                                       PB=min(1024, triton.next_power_of_2(amax.numel())))
        return
    pending.copy_(torch.maximum(pending, amax.max().reshape(1)))


@fp8_amax_fold.register_fake
def _(pending, amax):
    return None


# ---- rowwise: the row cast (with column partials), then the column cast ----------------

def _rows_shapes(x, cols):
    m, k = x.shape
    return (_cdiv(m, ROWS) if cols else 0, k)


@torch.library.custom_op("fivefold::fp8_cast_rows", mutates_args=())
def fp8_cast_rows(x: torch.Tensor, fmt: str, pow2: bool,
                  cols: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (M, K), scale (M, 1), each column's amax per 32 rows if `cols`) of x."""
    m, k = x.shape
    codes = torch.empty((m, k), dtype=FP8_FORMATS[fmt].dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    colpart = torch.empty(_rows_shapes(x, cols), dtype=torch.float32, device=x.device)
    if triton_usable(x.device):
        kernels.rows_cast_kernel[(_cdiv(m, ROWS),)](
            x, x.stride(0), x.stride(1), _bytes_view(codes), scale,
            colpart if cols else scale, m, k,
            **_constants(fmt), POW2=pow2, COLS=cols, ROWS=ROWS, BK=64)
        return codes, scale, colpart
    q = quantize(x, FP8_FORMATS[fmt], "rowwise", pow2)
    if cols:
        a = x.detach().float().abs().nan_to_num(nan=float("inf"))
        pad = torch.zeros(colpart.shape[0] * ROWS - m, k, dtype=a.dtype, device=a.device)
        colpart.copy_(torch.cat([a, pad]).view(-1, ROWS, k).amax(dim=1))
    return codes.copy_(q.data), scale.copy_(q.scale), colpart


@fp8_cast_rows.register_fake
def _(x, fmt, pow2, cols):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=FP8_FORMATS[fmt].dtype),
            x.new_empty((m, 1), dtype=torch.float32),
            x.new_empty(_rows_shapes(x, cols), dtype=torch.float32))


@torch.library.custom_op("fivefold::fp8_cast_cols", mutates_args=())
def fp8_cast_cols(x: torch.Tensor, colpart: torch.Tensor, fmt: str,
                  pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codesᵀ (K, M), scaleᵀ (K, 1)): xᵀ cast one scale per row of xᵀ (column of x)."""
    m, k = x.shape
    codes_t = torch.empty((k, m), dtype=FP8_FORMATS[fmt].dtype, device=x.device)
    scale_t = torch.empty((k, 1), dtype=torch.float32, device=x.device)
    if triton_usable(x.device):
        kernels.cols_cast_kernel[(_cdiv(k, 32),)](
            x, x.stride(0), x.stride(1), colpart, colpart.shape[0], _bytes_view(codes_t),
            scale_t, m, k, **_constants(fmt), POW2=pow2, BM=64, BK=32)
        return codes_t, scale_t
    q = quantize(x.t(), FP8_FORMATS[fmt], "rowwise", pow2)
    return codes_t.copy_(q.data), scale_t.copy_(q.scale)


@fp8_cast_cols.register_fake
def _(x, colpart, fmt, pow2):
    m, k = x.shape
    return (x.new_empty((k, m), dtype=FP8_FORMATS[fmt].dtype),
            x.new_empty((k, 1), dtype=torch.float32))


# ---- blockwise: 1x128 tiles both ways, 128x128 blocks ----------------------------------

@torch.library.custom_op("fivefold::fp8_cast_tiles", mutates_args=())
def fp8_cast_tiles(x: torch.Tensor, fmt: str, requant: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (M, K), scale (M, K/128), codesᵀ (K, M), scaleᵀ (K, M/128)): x in 1x128
    tiles along K, and xᵀ in 1x128 tiles along M, from x or (`requant`) from the
    dequantised first cast; scales stored column by column."""
    if requant and fmt != "e4m3":
        raise ValueError("fp8_cast_tiles re-quantises E4M3 codes only (the saved input's)")
    m, k = x.shape
    dtype = FP8_FORMATS[fmt].dtype
    codes = torch.empty((m, k), dtype=dtype, device=x.device)
    codes_t = torch.empty((k, m), dtype=dtype, device=x.device)
    scale, scale_t = _m_major(m, _cdiv(k, BLOCK), x.device), _m_major(k, _cdiv(m, BLOCK),
                                                                      x.device)
    if triton_usable(x.device):
        kernels.tiles_cast_kernel[(_cdiv(m, BLOCK), _cdiv(k, BLOCK))](
            x, x.stride(0), x.stride(1), _bytes_view(codes), scale, _bytes_view(codes_t),
            scale_t, m, k, **_constants(fmt), REQUANT=requant, BLOCK=BLOCK, num_warps=8)
        return codes, scale, codes_t, scale_t
    fmt_ = FP8_FORMATS[fmt]
    q = quantize(x, fmt_, "tiles")
    source = (q.data.float() * q.scale.repeat_interleave(BLOCK, 1)[:, :k]) if requant else x
    qt = quantize(source.t(), fmt_, "tiles")
    return codes.copy_(q.data), scale.copy_(q.scale), codes_t.copy_(qt.data), scale_t.copy_(
        qt.scale)


@fp8_cast_tiles.register_fake
def _(x, fmt, requant):
    m, k = x.shape
    dtype = FP8_FORMATS[fmt].dtype
    return (x.new_empty((m, k), dtype=dtype), _m_major(m, _cdiv(k, BLOCK), x.device),
            x.new_empty((k, m), dtype=dtype), _m_major(k, _cdiv(m, BLOCK), x.device))


@torch.library.custom_op("fivefold::fp8_cast_blocks", mutates_args=())
def fp8_cast_blocks(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (M, K), scale (M/128, K/128)): x in 128x128 blocks (a transposed view gives
    the transposed blocks, each with its block's scale)."""
    m, k = x.shape
    codes = torch.empty((m, k), dtype=FP8_FORMATS[fmt].dtype, device=x.device)
    scale = torch.empty((_cdiv(m, BLOCK), _cdiv(k, BLOCK)), dtype=torch.float32,
                        device=x.device)
    if triton_usable(x.device):
        kernels.blocks_cast_kernel[(_cdiv(m, BLOCK), _cdiv(k, BLOCK))](
            x, x.stride(0), x.stride(1), _bytes_view(codes), scale, m, k, scale.shape[1],
            **_constants(fmt), BLOCK=BLOCK, num_warps=8)
        return codes, scale
    q = quantize(x, FP8_FORMATS[fmt], "blocks")
    return codes.copy_(q.data), scale.copy_(q.scale)


@fp8_cast_blocks.register_fake
def _(x, fmt):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=FP8_FORMATS[fmt].dtype),
            x.new_empty((_cdiv(m, BLOCK), _cdiv(k, BLOCK)), dtype=torch.float32))
