"""NF4: QLoRA's 4-bit NormalFloat with double-quantised block scales.

Method (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", §3):

- The 16 code values are quantiles of N(0, 1) scaled to [-1, 1], asymmetric so that 0 is
  exact (8 positive levels, 7 negative ones and -1).
- The tensor is flattened (row-major) and cut into blocks of 64; each block is divided by
  its absmax and every value rounded to the nearest code. Two codes share a byte, the
  first element of a pair in the high nibble.
- Double quantisation: the per-block absmax constants (fp32, 32 bits per 64 values = 0.5
  bits/param) are centred on their mean and quantised symmetrically to int8 with one fp32
  factor per 256 constants: 8/64 + 32/(64·256) = 0.127 bits/param of overhead, ≈4.127
  bits/param in all.

The layout (flattened blocks, high nibble first, int8 scalers with factor
`256 / (2·absmax)`, scaler mean subtracted) follows torchao 0.18's `NF4Tensor`, so the codes
and scalers match `to_nf4` bit for bit on fp32 input when the same code table is used
(tests/test_numerics_nf4.py). Two deliberate differences, both tested:

- `NF4_CODES` holds the exact quantiles (as bitsandbytes does); torchao rounds them to four
  decimals (`TORCHAO_NF4_CODES`). Pass `codes=TORCHAO_NF4_CODES` to reproduce torchao.
- A tensor whose size is not a multiple of `block_size` or whose block count is not a
  multiple of `scaler_block_size` is padded with zeros here (torchao refuses it): zeros
  change neither a block's absmax nor a scaler block's absmax, and the scaler mean is taken
  over the real blocks only.

Quantisation is computed in float32 whatever the input dtype (torchao computes in the input
dtype), so a bf16 weight's codes can differ from torchao's where a value sits within bf16
rounding of a decision boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.numerics.formats import NF4_BLOCK, NF4_SCALER_BLOCK
from fivefold.numerics.intx import pack_nibbles, unpack_nibbles

# The 16 NF4 values: QLoRA's normal-float quantiles, as listed in bitsandbytes
# (functional.py, `get_4bit_type("nf4")`), which is the table the QLoRA paper defines.
NF4_CODES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171066284,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# The same table rounded to four decimals, as torchao 0.18's NF4Tensor writes it.
TORCHAO_NF4_CODES = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)

NF4_BLOCK_SIZE = NF4_BLOCK
NF4_SCALER_BLOCK_SIZE = NF4_SCALER_BLOCK


@dataclass
class NF4:
    """A tensor in NF4. `data` holds two 4-bit codes per byte (first in the high nibble);
    `scalers` the int8 double-quantised block absmaxes; `factors` one fp32 per scaler
    block (absmax = scalers / factor + mean); `codes` the 16 values the codes index."""

    data: torch.Tensor            # uint8, ceil(numel / 2) (padded numel / 2)
    scalers: torch.Tensor         # int8, n_blocks padded to a multiple of scaler_block_size
    factors: torch.Tensor         # float32, n_scaler_blocks
    mean: torch.Tensor            # float32 scalar: mean of the real blocks' absmax
    codes: torch.Tensor           # float32, 16
    shape: tuple[int, ...]
    block_size: int = NF4_BLOCK_SIZE
    scaler_block_size: int = NF4_SCALER_BLOCK_SIZE

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def nbytes(self) -> int:
        """Bytes held: packed codes, int8 scalers, fp32 factors and mean (the 16-entry code
        table is a format constant and not counted)."""
        return (self.data.numel() + self.scalers.numel() + 4 * self.factors.numel() + 4)

    def bits_per_param(self) -> float:
        return 8.0 * self.nbytes() / self.numel


def _padded(flat: torch.Tensor, multiple: int) -> torch.Tensor:
    rest = (-flat.numel()) % multiple
    return torch.cat([flat, flat.new_zeros(rest)]) if rest else flat


def nearest_code(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code for each value of x (ties go to the lower index, as
    `argmin` over |x - code| does in torchao). Works in chunks to bound the numel×16
    temporary."""
    out = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    flat = x.reshape(-1)
    chunk = 1 << 20
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].unsqueeze(-1)
        out[start:start + chunk] = (part - codes).abs().min(dim=-1).indices.to(torch.uint8)
    return out


def quantize_nf4(w: torch.Tensor, block_size: int = NF4_BLOCK_SIZE,
                 scaler_block_size: int = NF4_SCALER_BLOCK_SIZE,
                 codes: tuple[float, ...] = NF4_CODES) -> NF4:
    """Quantise w to NF4 with double-quantised absmax (see the module docstring)."""
    if block_size % 2:
        raise ValueError(f"NF4 block_size must be even, got {block_size}")
    table = torch.tensor(codes, dtype=torch.float32, device=w.device)
    flat = _padded(w.detach().reshape(-1).float(), block_size)
    blocks = flat.view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)

    # Double quantisation of the absmax constants (QLoRA §3, torchao's arithmetic). Padding
    # scalers are 0 after centring, so they move no scaler block's absmax.
    mean = absmax.mean()
    centred = _padded(absmax - mean, scaler_block_size).view(-1, scaler_block_size)
    scaler_absmax = centred.abs().amax(dim=1, keepdim=True)
    # A scaler block whose constants all equal the mean stores zeros; factor 1 keeps it
    # finite (torchao would divide by zero there).
    factors = 256 / (2 * torch.where(scaler_absmax > 0, scaler_absmax, 128.0))
    scalers = (centred * factors).round().clamp(-128, 127).to(torch.int8)

    # Codes from the exact absmax (not the double-quantised one), as QLoRA and torchao do;
    # an all-zero block divides by 1 and codes 0.
    scaled = blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(-1)
    data = pack_nibbles(nearest_code(scaled, table))
    return NF4(data=data, scalers=scalers.view(-1), factors=factors.view(-1), mean=mean,
               codes=table, shape=tuple(w.shape), block_size=block_size,
               scaler_block_size=scaler_block_size)


def dequantize_scalers(q: NF4) -> torch.Tensor:
    """The per-block absmax as stored: int8 / factor + mean (fp32), one per block."""
    per_block = q.scalers.view(-1, q.scaler_block_size).float() / q.factors.unsqueeze(-1)
    return per_block.view(-1) + q.mean


def dequantize_nf4(q: NF4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes[code] · absmax per block, computed in fp32, cast to dtype, in the original
    shape."""
    values = q.codes[unpack_nibbles(q.data).long()].view(-1, q.block_size)
    absmax = dequantize_scalers(q)[: values.shape[0]]
    out = (values * absmax.unsqueeze(-1)).view(-1)[: q.numel]
    return out.view(q.shape).to(dtype)
