"""Quantised optimizer states: 8-bit and 4-bit blockwise codes for Adam's two moments.

8-bit (Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization", arXiv
2110.02861, §2): the state is cut into blocks of `BLOCK_8BIT` values; each block is divided by
its absolute maximum (one fp32 scale per block) and every value rounded to the nearest of 256
code points of a *dynamic* map (a sign, an exponent of leading zeros, then a linear fraction:
dense near 0, where most of Adam's values lie). The first moment uses the signed map, the
second (never negative) the unsigned one, whose extra bit goes to precision.

4-bit (Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507,
§3-4): blocks of `BLOCK_4BIT`; the first moment on a signed dynamic map of 16 points; the
second on a *linear* map without zero (1/16 … 1): a zero code would turn 1/sqrt(v) into an
infinite update ("zero-point problem", §4.1). Two codes share a byte (first in the high
nibble). The paper's rank-1 normalisation of the second moment is left out, as torchao
leaves it out: the oracle (tests/test_optimizers.py) is torchao's `AdamW4bit`.

Block size, maps, rounding and packing follow torchao.optim (`quant_utils.py`,
`subclass_8bit.py`, `subclass_4bit.py`) so that the same state gives the same codes; the
maps themselves are bitsandbytes' `create_dynamic_map` with its zero padding removed. A
tensor is quantised only when it has at least `MIN_QUANTISED` values and a whole number of
blocks (bitsandbytes' `min_8bit_size`, torchao's rule); smaller ones keep fp32 states.

Bytes per value: 8-bit 1 + 4/256 for each moment, 4-bit 0.5 + 4/128 (`state_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

# plan/optimizer.py (no torch) repeats these three; tests/test_plan_optimizer.py pins both.
BLOCK_8BIT = 256  # torchao AdamW8bit's block
BLOCK_4BIT = 128  # Li et al. 2023, §3.1 ("B128"), torchao AdamW4bit
MIN_QUANTISED = 4096  # smaller tensors keep fp32 states (bitsandbytes min_8bit_size)
SCALE_FLOOR = 1e-12  # a block of zeros divides by this, not by 0 (torchao scale_tensor)


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> list[float]:
    """The dynamic quantisation map (Dettmers 2016, arXiv 1511.04561; bitsandbytes
    `create_dynamic_map`, without its zero padding): per exponent e, the midpoints of a
    linear grid on [0.1, 1] scaled by 10^(e - max_exponent_bits + 1), plus 0 and 1."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = (2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                 else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        bounds = torch.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2.0  # fp32, scaled in fp32: torchao's values
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional > 0:
        bounds = torch.linspace(0.1, 1, additional + 1)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 2 ** total_bits
    return sorted(data)


@cache
def _qmap(bits: int, signed: bool) -> tuple[float, ...]:
    if bits == 8:
        return tuple(dynamic_map(signed))
    if signed:
        return tuple(dynamic_map(True, 3, 4))
    return tuple(torch.linspace(0, 1, 17)[1:].tolist())  # linear, no zero point


def qmap(bits: int, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(_qmap(bits, signed), dtype=torch.float32, device=device)


def block_size(bits: int) -> int:
    return BLOCK_8BIT if bits == 8 else BLOCK_4BIT


def quantisable(numel: int, bits: int) -> bool:
    """Whether a tensor of `numel` values gets quantised states (else fp32)."""
    return numel >= MIN_QUANTISED and numel % block_size(bits) == 0


def _nearest(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest map point (ties up): the last point at or below the value (the
    index torchao's branchless binary search finds, here one `searchsorted`), then its
    rounding step, in its operations (`quantize_8bit_with_qmap`), so the codes are equal."""
    n = table.numel()
    codes = (torch.searchsorted(table, scaled, right=True) - 1).clamp_(min=0)
    up = (codes + 1).clip(max=n - 1)
    down_value, up_value = table[codes], table[up]
    codes = torch.where(scaled - down_value >= (up_value - down_value) * 0.5, up, codes)
    return codes.to(torch.uint8)


@dataclass
class QuantState:
    """One moment of one tensor: `codes` (uint8; 4-bit: two per byte), one fp32 `scale` per
    block, and the map. `numel` values, flat."""

    codes: torch.Tensor
    scale: torch.Tensor
    bits: int
    signed: bool

    @property
    def numel(self) -> int:
        return self.codes.numel() * (8 // self.bits)

    @classmethod
    def zeros(cls, numel: int, bits: int, signed: bool, device) -> QuantState:
        codes = torch.zeros(numel * bits // 8, dtype=torch.uint8, device=device)
        scale = torch.zeros(numel // block_size(bits), dtype=torch.float32, device=device)
        return cls(codes, scale, bits, signed)

    def table(self) -> torch.Tensor:
        return qmap(self.bits, self.signed, self.codes.device)

    def dequantize(self) -> torch.Tensor:
        """The fp32 values, flat."""
        codes = self.codes
        if self.bits == 4:
            codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
        values = self.table()[codes.int()].view(self.scale.numel(), -1)
        return (values * self.scale.view(-1, 1)).view(-1)

    def quantize_(self, values: torch.Tensor) -> None:
        """Store `values` (flat fp32, `numel` of them): per-block absmax, nearest code."""
        codes, scale = self.quantized(values)
        self.codes.copy_(codes)
        self.scale.copy_(scale)

    def quantized(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (codes, scale) `quantize_` would store for `values`, not stored."""
        blocks = values.reshape(-1, block_size(self.bits))
        scale = blocks.abs().amax(-1).clip(SCALE_FLOOR)
        codes = _nearest((blocks / scale.view(-1, 1)).view(-1), self.table())
        if self.bits == 4:
            codes = (codes[::2] << 4) | codes[1::2]
        return codes, scale


def state_bytes(numel: int, bits: int) -> int:
    """Bytes of one moment of a tensor of `numel` values (fp32 when not quantisable)."""
    if not quantisable(numel, bits):
        return 4 * numel
    return numel * bits // 8 + 4 * (numel // block_size(bits))


def bytes_per_value(bits: int) -> float:
    """Bytes per value of one quantised moment: codes plus the block's fp32 scale."""
    return bits / 8 + 4 / block_size(bits)


def blocks_of(numel: int, bits: int) -> int:
    return math.ceil(numel / block_size(bits))
