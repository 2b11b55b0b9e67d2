"""The FP8 linear's operands from the fused casts (numerics/fp8_cast.py), on a GPU.

Each function returns the same FP8Tensors as the FP8 linear's step-by-step path
(lowp/quantize.py, the CPU's), byte for byte, in one or two kernels per operand:

    operand            tensorwise              rowwise                 blockwise
    x (forward)        amax + cast: x, xᵀ      rows (+ column amax)    tiles: x, and xᵀ
                                               + columns: x, xᵀ        from x's codes
    W (forward)        amax + cast: W          rows: W                 blocks: W
    W (backward)       amax + cast: Wᵀ         rows of the view Wᵀ     blocks of the view Wᵀ
    ∂y (backward)      amax + cast: ∂y, ∂yᵀ    rows + columns          tiles: ∂y, ∂yᵀ

rowwise_gw_hp casts x, W and ∂y by rows only (no column copies: its weight gradient is a
high-precision GEMM of ∂yᵀ and the saved input), and Wᵀ tensorwise with a power-of-two
scale (`weight_t_tensorwise`). Delayed tensorwise scaling casts with one kernel per
operand, its scale from an amax history (lowp/delayed.py).

The copy of x saved for backward is the weight gradient's operand as it is (xᵀ quantised
along the tokens), so the backward makes no copy of it. The weight is quantised again in
backward rather than saved in FP8 (lowp/linear.py says why).
"""

from __future__ import annotations

import torch

from fivefold.lowp.quantize import quantize
from fivefold.numerics import fp8_cast
from fivefold.numerics.formats import E4M3, FloatFormat
from fivefold.numerics.fp8 import FP8Tensor

FUSED_ON_DEVICE = True  # the fused casts on a GPU (and on meta, a trace of one)


def fused(t: torch.Tensor) -> bool:
    """Whether tensors of t's device take the fused casts: a GPU, or meta (a trace)."""
    return FUSED_ON_DEVICE and t.device.type != "cpu"


def _tensor(data, scale, granularity, fmt, recipe) -> FP8Tensor:
    return FP8Tensor(data, scale, granularity, fmt, recipe.block)


def _tensorwise(x: torch.Tensor, fmt: FloatFormat, write: bool, write_t: bool,
                pow2: bool = False):
    partials = fp8_cast.fp8_amax_partials(x)
    return fp8_cast.fp8_cast_tensorwise(x, partials, fmt.name, write, write_t, pow2)


def _both(x: torch.Tensor, recipe, fmt: FloatFormat, requant: bool, want: bool = True,
          want_t: bool = True) -> tuple[FP8Tensor | None, FP8Tensor | None]:
    """(x along its last dim, xᵀ along x's first dim) as the recipe quantises them."""
    kind = recipe.act_granularity
    if recipe.name == "tensorwise":
        codes, codes_t, scale = _tensorwise(x, fmt, want, want_t)
        return ((_tensor(codes, scale, kind, fmt, recipe) if want else None),
                (_tensor(codes_t, scale, kind, fmt, recipe) if want_t else None))
    if recipe.name.startswith("rowwise"):
        codes, scale, colpart = fp8_cast.fp8_cast_rows(x, fmt.name, recipe.pow2, want_t)
        xq = _tensor(codes, scale, kind, fmt, recipe)
        if not want_t:
            return xq, None
        codes_t, scale_t = fp8_cast.fp8_cast_cols(x, colpart, fmt.name, recipe.pow2)
        return xq, _tensor(codes_t, scale_t, kind, fmt, recipe)
    codes, scale, codes_t, scale_t = fp8_cast.fp8_cast_tiles(x, fmt.name, requant)
    return _tensor(codes, scale, kind, fmt, recipe), _tensor(codes_t, scale_t, kind, fmt,
                                                             recipe)


def input_pair(x2: torch.Tensor, recipe) -> tuple[FP8Tensor, FP8Tensor | None]:
    """(the forward's x, the weight gradient's xᵀ): blockwise re-quantises the forward's
    tiles (DeepSeek-V3 §3.3.4), the others quantise x itself; rowwise_gw_hp has no xᵀ
    (its weight gradient takes the high-precision x)."""
    return _both(x2, recipe, E4M3, requant=recipe.name == "blockwise",
                 want_t=not recipe.hp_wgrad)


def grad_pair(g2: torch.Tensor, recipe, dgrad: bool,
              wgrad: bool) -> tuple[FP8Tensor | None, FP8Tensor | None]:
    """(∂y along N for the input gradient, ∂yᵀ along the tokens for the weight gradient)."""
    return _both(g2, recipe, recipe.grad_format, requant=False, want=dgrad or
                 recipe.name != "tensorwise", want_t=wgrad)


def weight(w: torch.Tensor, recipe, transposed: bool = False) -> FP8Tensor:
    """W quantised along K (forward) or, `transposed`, Wᵀ along N (the input gradient)."""
    kind = recipe.weight_granularity
    if recipe.name == "tensorwise":
        codes, codes_t, scale = _tensorwise(w, E4M3, not transposed, transposed)
        return _tensor(codes_t if transposed else codes, scale, kind, E4M3, recipe)
    view = w.t() if transposed else w
    if recipe.name.startswith("rowwise"):
        codes, scale, _ = fp8_cast.fp8_cast_rows(view, E4M3.name, recipe.pow2, False)
    else:
        codes, scale = fp8_cast.fp8_cast_blocks(view, E4M3.name)
    return _tensor(codes, scale, kind, E4M3, recipe)


def weight_t_tensorwise(w: torch.Tensor) -> FP8Tensor:
    """Wᵀ (K, N) in E4M3 with one power-of-two scale: rowwise_gw_hp's input-gradient
    operand (torchao's `cast_config_weight_for_grad_input`, tensorwise, scales rounded
    down to powers of two); an amax pass and a cast pass writing Wᵀ on the fused path."""
    if not fused(w):
        return quantize(w.t(), E4M3, "tensorwise", pow2=True)
    _, codes_t, scale = _tensorwise(w, E4M3, False, True, pow2=True)
    return FP8Tensor(codes_t, scale, "tensorwise", E4M3)
