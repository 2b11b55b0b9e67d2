"""Integer weight formats: int8 per output channel and int4 groupwise, with nibble packing.

int8 (LLM.int8()'s vector-wise weight scaling without the outlier split; Dettmers et al.
2022 §3.1): one fp32 scale per output row, `scale = absmax / 127`, codes in [-127, 127]
(symmetric, so -128 is never used and 0 is exact).

int4 groupwise (the weight-only layout of AWQ, Lin et al. 2024, and GPTQ, Frantar et al.
2023): the input dimension K of each row is cut into groups of `group_size` (128 by
default) with one scale per (row, group).

- asymmetric (AWQ's default, its `pseudo_quantize_tensor` with zero_point=True):
  `scale = (max - min) / 15`, `zero = clamp(round(-min / scale), 0, 15)`,
  `code = clamp(round(w / scale) + zero, 0, 15)`, `w ≈ (code - zero) · scale`;
- symmetric: `scale = absmax / 7`, `code = clamp(round(w / scale), -8, 7)`, stored as
  `code + 8` so that every nibble is unsigned (the zero point is then the constant 8).

Two codes share a byte, the first of a pair in the high nibble (`pack_nibbles`, the order
NF4 uses too). Everything here is torch only; no nn.Module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.numerics.formats import INT4_GROUP, INT4_LEVELS, INT4_SYM_OFFSET, INT8_MAX

DEFAULT_GROUP_SIZE = INT4_GROUP
# Smallest scale a group may get: a constant group (max == min) would otherwise divide by 0.
# AWQ clamps (max - min) at 1e-5 for the same reason.
MIN_RANGE = 1e-5


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes < 16 of shape (..., n) -> uint8 (..., n/2): [a, b] -> a<<4 | b. n must be even."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 (..., m) -> uint8 codes (..., 2m)."""
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).flatten(-2)


@dataclass
class Int8:
    """Per-output-channel symmetric int8: w[i, :] ≈ data[i, :] · scale[i]."""

    data: torch.Tensor     # int8, (out, in)
    scale: torch.Tensor    # float32, (out,)

    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()


def quantize_int8(w: torch.Tensor) -> Int8:
    """Round each row to the nearest multiple of absmax/127 (computed in fp32)."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=-1) / INT8_MAX).clamp_min(MIN_RANGE / INT8_MAX)
    data = torch.round(w32 / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8(data=data, scale=scale)


def dequantize_int8(q: Int8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.data.float() * q.scale.unsqueeze(-1)).to(dtype)


@dataclass
class Int4:
    """Groupwise int4 along the input dimension, two codes per byte.

    w[i, g·G + j] ≈ (code[i, g·G + j] - zero[i, g]) · scale[i, g], with zero = 8 for the
    symmetric variant (`zero is None`)."""

    data: torch.Tensor            # uint8, (out, in / 2)
    scale: torch.Tensor           # float32, (out, in / group_size)
    zero: torch.Tensor | None     # uint8, (out, in / group_size); None when symmetric
    group_size: int

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def nbytes(self) -> int:
        """Packed codes, fp32 scales and (asymmetric) one byte per zero point. Zero points
        are 4-bit values; a kernel layout would pack them too (AWQ's qzeros packs 8 per
        int32), which this byte count does not assume."""
        zeros = 0 if self.zero is None else self.zero.numel()
        return self.data.numel() + 4 * self.scale.numel() + zeros


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2 or in_features % group_size:
        raise ValueError(f"int4 group size {group_size} must be even and divide the input "
                         f"dimension {in_features}")


def int4_scale_zero(w: torch.Tensor, group_size: int, symmetric: bool,
                    levels: int = INT4_LEVELS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) per (row, group) of w (out, in), fp32. `levels`: the largest
    asymmetric code (2^bits - 1; 15 for int4)."""
    groups = w.float().reshape(w.shape[0], -1, group_size)
    if symmetric:
        absmax = groups.abs().amax(dim=-1)
        return (absmax / (INT4_SYM_OFFSET - 1)).clamp_min(MIN_RANGE / 7), None
    high, low = groups.amax(dim=-1), groups.amin(dim=-1)
    scale = (high - low).clamp_min(MIN_RANGE) / levels
    zero = torch.round(-low / scale).clamp(0, levels)
    return scale, zero


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               group_size: int) -> torch.Tensor:
    """Unsigned 4-bit codes (out, in) for w given its per-group scale and zero."""
    groups = w.float().reshape(w.shape[0], -1, group_size)
    q = torch.round(groups / scale.unsqueeze(-1))
    if zero is None:
        q = q.clamp(-INT4_SYM_OFFSET, INT4_SYM_OFFSET - 1) + INT4_SYM_OFFSET
    else:
        q = (q + zero.unsqueeze(-1)).clamp(0, INT4_LEVELS)
    return q.reshape(w.shape).to(torch.uint8)


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                  symmetric: bool = False) -> Int4:
    """Round-to-nearest int4 per group of `group_size` input columns (see module docstring)."""
    check_group_size(w.shape[-1], group_size)
    w = w.detach()
    scale, zero = int4_scale_zero(w, group_size, symmetric)
    codes = int4_codes(w, scale, zero, group_size)
    return Int4(data=pack_nibbles(codes), scale=scale,
                zero=None if zero is None else zero.to(torch.uint8), group_size=group_size)


def dequantize_int4(q: Int4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = unpack_nibbles(q.data).float()
    out_features = codes.shape[0]
    groups = codes.view(out_features, -1, q.group_size)
    zero = (torch.full_like(q.scale, INT4_SYM_OFFSET) if q.zero is None
            else q.zero.float())
    w = (groups - zero.unsqueeze(-1)) * q.scale.unsqueeze(-1)
    return w.view(out_features, -1).to(dtype)


def fake_quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                       symmetric: bool = False, levels: int = INT4_LEVELS) -> torch.Tensor:
    """Quantise and dequantise in one step (fp32), without packing: what AWQ's search
    evaluates for every candidate scale. `levels` < 15 emulates fewer bits (asymmetric
    only; bench/quant/awq_bits.py measures 3 bits, levels = 7)."""
    if symmetric and levels != INT4_LEVELS:
        raise ValueError("fewer levels than int4's are emulated asymmetrically only")
    scale, zero = int4_scale_zero(w, group_size, symmetric, levels)
    groups = w.float().reshape(w.shape[0], -1, group_size)
    q = torch.round(groups / scale.unsqueeze(-1))
    if zero is None:
        deq = q.clamp(-INT4_SYM_OFFSET, INT4_SYM_OFFSET - 1) * scale.unsqueeze(-1)
    else:
        z = zero.unsqueeze(-1)
        deq = ((q + z).clamp(0, levels) - z) * scale.unsqueeze(-1)
    return deq.reshape(w.shape)
