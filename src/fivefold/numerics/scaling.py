"""amax -> scale, for the three granularities of FP8 training.

A scaled cast stores q = saturate(x · m) in a narrow format and recovers x ≈ q / m. The
multiplier m maps the largest magnitude in a scaling group (its amax) onto the format's
largest finite value, so the group uses the whole range (Micikevicius et al. 2022 §4;
torchao `float8_utils.amax_to_scale`):

    m = fmt.max / max(amax, EPS)                    computed in float64, stored as float32

Granularities (one amax per group):

    tensorwise  the whole tensor                                       scale shape ()
    rowwise     each row along the last dim (a token, an output        (M, 1)
                channel): torchao's "rowwise"/axiswise
    tiles       1 x 128 along the last dim (DeepSeek-V3 §3.3.1 for     (M, ceil(K/128))
                activations and activation gradients)
    blocks      128 x 128 (DeepSeek-V3 for weights)                     (ceil(M/128), ceil(K/128))

Power-of-two rounding (an option; torchao's rowwise recipe uses it) rounds m *down* to a
power of two, so that scaling only moves the exponent: the mantissa rounding of x · m then
does not depend on the scale, and dequantising is exact in any wider format.

Special amax values are handled on purpose:
    amax == 0      an all-zero group: m = fmt.max / EPS (finite), q = 0, dequantises to 0;
    amax inf/NaN   the group holds a non-finite value: m is NaN, so the whole group
                   quantises to NaN. A NaN or an overflow in the input must reach the
                   trainer's bad-step guard (a NaN loss or gradient norm), never become a
                   silent zero or a saturated 448.
"""

from __future__ import annotations

import torch

from fivefold.numerics.formats import FP8_BLOCK, SCALE_EPS, FloatFormat


def amax_to_scale(amax: torch.Tensor, fmt: FloatFormat, pow2: bool = False) -> torch.Tensor:
    """The float32 multiplier m with x · m in [-fmt.max, fmt.max] for |x| <= amax."""
    amax64 = amax.detach().to(torch.float64)
    m = (fmt.max / torch.clamp(amax64, min=SCALE_EPS)).to(torch.float32)
    if pow2:
        # 2^floor(log2 m): exact for the normal float32 range m lives in here.
        m = torch.exp2(torch.floor(torch.log2(m)))
    # clamp() maps NaN to NaN but inf to fmt.max / inf = 0: make both NaN explicitly.
    return torch.where(torch.isfinite(amax64), m, torch.full_like(m, float("nan")))


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """amax of the whole tensor (a 0-d float32 tensor; NaN if x holds a NaN)."""
    return _nan_aware_amax(x.detach().abs().float().reshape(1, -1), dim=1).reshape(())


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """amax of each row along the last dim of a 2-D x: (M, 1)."""
    return _nan_aware_amax(x.detach().abs().float(), dim=1).unsqueeze(1)


def tile_amax(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """amax of each 1 x block tile along the last dim of a 2-D x: (M, ceil(K/block)).
    A last, shorter tile covers the remainder."""
    m, k = x.shape
    padded = pad_to(x.detach().abs().float(), 1, block)
    return _nan_aware_amax(padded.view(m, -1, block), dim=2)


def block_amax(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """amax of each block x block square of a 2-D x: (ceil(M/block), ceil(K/block))."""
    padded = pad_to(pad_to(x.detach().abs().float(), 0, block), 1, block)
    mb, kb = padded.shape[0] // block, padded.shape[1] // block
    squares = padded.view(mb, block, kb, block).permute(0, 2, 1, 3).reshape(mb, kb, -1)
    return _nan_aware_amax(squares, dim=2)


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], granularity: str,
                 block: int = FP8_BLOCK) -> torch.Tensor:
    """A per-group scale broadcast to one value per element of a (M, K) tensor."""
    m, k = shape
    if granularity in ("tensorwise", "rowwise"):
        return scale.expand(m, k) if scale.dim() else scale.reshape(1, 1).expand(m, k)
    if granularity == "tiles":
        return scale.repeat_interleave(block, dim=1)[:, :k]
    if granularity == "blocks":
        return scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:m, :k]
    raise ValueError(f"unknown FP8 scaling granularity '{granularity}'")


def pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """x padded with zeros along `dim` up to a multiple of `multiple` (zeros change no amax)."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _nan_aware_amax(a: torch.Tensor, dim: int) -> torch.Tensor:
    """amax along dim that returns NaN for a group holding a NaN (torch.amax propagates NaN
    on CPU and CUDA; this does not rely on it)."""
    amax = a.amax(dim=dim)
    has_nan = torch.isnan(a).any(dim=dim)
    return torch.where(has_nan, torch.full_like(amax, float("nan")), amax)
