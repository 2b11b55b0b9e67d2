"""MXFP4: FP4 (E2M1) elements in blocks of 32 sharing one E8M0 power-of-two scale.

The OCP Microscaling Formats (MX) Specification v1.0 (2023), §5 and §6.3:

- E2M1 (1 sign, 2 exponent, 1 mantissa bit, bias 1, no inf/NaN) holds ±{0, 0.5, 1, 1.5, 2,
  3, 4, 6}; the largest power of two it holds is 4 = 2^2 (`emax_elem = 2`).
- A block of k = 32 consecutive values along the reduction dimension shares the scale
  X = 2^(floor(log2(max|V|)) - emax_elem), stored as E8M0: an 8-bit biased exponent
  (bias 127, 0xFF = NaN), no sign, no mantissa.
- Each element is V / X rounded to the nearest E2M1 value, ties to even, saturating at
  ±6 (max|V| / X lies in [4, 8), so the top of the block can clip by up to 25%).

Stored here: 4-bit codes (sign in bit 3, the magnitude's index in the table in bits 0-2),
two per byte, first in the high nibble (intx.pack_nibbles, the project's order; torchao and
torch's float4_e2m1fn_x2 put the first in the low nibble), and one uint8 biased exponent
per block: 4 + 8/32 = 4.25 bits per value. Emulated on CPU: dequantise, then compute in
fp32/bf16. The scale computation matches torchao 0.18's `to_mx` in its default FLOOR mode,
including its floor of 2^-126 on the divisor for all-zero (or subnormal) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.numerics.formats import E2M1_EMAX, E2M1_MAX, E8M0_BIAS, MX_BLOCK
from fivefold.numerics.intx import pack_nibbles, unpack_nibbles

MX_BLOCK_SIZE = MX_BLOCK
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitudes, index = code & 7
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0**-126


@dataclass
class MXFP4:
    """Codes (uint8, two per byte) and biased E8M0 exponents (uint8, one per block of
    `block_size` along the last dimension)."""

    data: torch.Tensor     # uint8, (..., k / 2)
    scale: torch.Tensor    # uint8, (..., k / block_size)
    block_size: int = MX_BLOCK_SIZE

    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel()


def check_block_size(k: int, block_size: int) -> None:
    if block_size <= 0 or block_size % 2 or k % block_size:
        raise ValueError(f"MX block size {block_size} must be even and divide the last "
                         f"dimension {k}")


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Codes of the nearest E2M1 values to x (fp32), ties to the even mantissa, saturating
    at ±6. Two neighbouring magnitudes differ in their index's low bit, which is the
    mantissa bit, so 'even' is 'even index'."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    magnitude = x.abs().clamp(max=E2M1_MAX).unsqueeze(-1)
    distance = (magnitude - table).abs()
    nearest = distance == distance.min(dim=-1, keepdim=True).values
    even = torch.arange(8, device=x.device) % 2 == 0
    # Among the nearest (one, or two on a tie) take the even one; argmax takes the first max.
    index = (nearest.to(torch.uint8) * 2 + (nearest & even).to(torch.uint8)).argmax(dim=-1)
    sign = x < 0                       # a small negative rounds to -0, as IEEE rounding does
    return (index + 8 * sign).to(torch.uint8)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def quantize_mxfp4(w: torch.Tensor, block_size: int = MX_BLOCK_SIZE) -> MXFP4:
    """MX-scale and round w (any shape, blocks along the last dimension); fp32 arithmetic."""
    check_block_size(w.shape[-1], block_size)
    blocks = w.detach().float().reshape(*w.shape[:-1], -1, block_size)
    amax = blocks.abs().amax(dim=-1)
    # floor(log2(amax)): frexp gives amax = m · 2^e with m in [0.5, 1).
    exponent = torch.frexp(amax).exponent - 1 - E2M1_EMAX
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    divisor = torch.exp2(exponent.float()).clamp_min(F32_MIN_NORMAL)
    codes = e2m1_round(blocks / divisor.unsqueeze(-1)).reshape(w.shape)
    scale = (exponent + E8M0_BIAS).to(torch.uint8)
    return MXFP4(data=pack_nibbles(codes), scale=scale, block_size=block_size)


def dequantize_mxfp4(q: MXFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = e2m1_value(unpack_nibbles(q.data))
    blocks = values.reshape(*values.shape[:-1], -1, q.block_size)
    scale = torch.exp2(q.scale.float() - E8M0_BIAS)
    scale = torch.where(q.scale == E8M0_NAN, torch.nan, scale)
    return (blocks * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)
