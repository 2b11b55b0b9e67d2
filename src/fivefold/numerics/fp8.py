"""FP8 quantise / dequantise, and the FP8 GEMM with fp32 accumulation.

`quantize(x, fmt, granularity)` returns an `FP8Tensor`: the FP8 data and the float32
*dequantisation* scale s (x ≈ data · s, the convention of `torch._scaled_mm` and of
DeepSeek-V3), one per scaling group (numerics/scaling.py):

    tensorwise  s: ()             rowwise  s: (M, 1)
    tiles       s: (M, K/128)     blocks   s: (M/128, K/128)

`fp8_mm(a, b)` computes a · bᵀ for a (M, K) and b (N, K), both quantised along K (the
reduction dimension), in float32 accumulation:

  - tensorwise and rowwise go to `torch._scaled_mm` (cuBLASLt on CUDA, an emulation on
    CPU), which applies a's and b's scales to the fp32 accumulator, through the custom op
    `fivefold::fp8_scaled_mm` (fp8_ops.py: torch.compile keeps its operands' layout);
  - tiles x tiles and tiles x blocks (DeepSeek-V3's fine-grained scaling, arXiv 2412.19437
    §3.3.2) take `kernel`: "scaled_mm" runs cuBLASLt's blockwise FP8 GEMM (fp8_kernel.py;
    CUDA, compute capability 9.x); "emulated", the reference and the CPU path, runs them
    as K slices of 128: each slice's product of the FP8 values is exact in
    fp32 (two 4-bit significands), is summed over its 128 elements in fp32, multiplied by
    the slice's scales (one per row of a, one per row of b) and added to an fp32
    accumulator. This is the promotion DeepSeek-V3 does on Hopper every N_C = 128
    elements, where the tensor core's own accumulator keeps only ~14 bits.

Saturation: x · m is clamped to ±fmt.max before the cast (torch < 2.12 does not saturate
an eager cast). A NaN passes the clamp and stays NaN; see scaling.py for inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.numerics.formats import E4M3, FP8_BLOCK, FloatFormat
from fivefold.numerics.fp8_ops import (
    blockwise_scaled_mm,
    fp8_blockwise_emulated_mm,
    fp8_scaled_mm,
)
from fivefold.numerics.scaling import (
    amax_to_scale,
    block_amax,
    expand_scale,
    row_amax,
    tensor_amax,
    tile_amax,
)

GRANULARITIES = ("tensorwise", "rowwise", "tiles", "blocks")


@dataclass
class FP8Tensor:
    """A 2-D tensor in FP8 with its dequantisation scales: value ≈ data · scale."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    fmt: FloatFormat = E4M3
    block: int = FP8_BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (
            self.scale.numel() * self.scale.element_size())

    def t(self) -> FP8Tensor:
        """The transpose, where it keeps its groups: tensorwise and 128x128 blocks only
        (a row or a tile becomes a column; those must be quantised again)."""
        if self.granularity == "tensorwise":
            return FP8Tensor(self.data.t().contiguous(), self.scale, self.granularity,
                             self.fmt, self.block)
        if self.granularity == "blocks":
            return FP8Tensor(self.data.t().contiguous(), self.scale.t().contiguous(),
                             self.granularity, self.fmt, self.block)
        raise ValueError(f"an FP8 tensor with {self.granularity} scales has no cheap "
                         f"transpose; dequantise and quantise it again")


def _amax(x: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    if granularity == "tensorwise":
        return tensor_amax(x)
    if granularity == "rowwise":
        return row_amax(x)
    if granularity == "tiles":
        return tile_amax(x, block)
    if granularity == "blocks":
        return block_amax(x, block)
    raise ValueError(f"unknown FP8 scaling granularity '{granularity}'; one of {GRANULARITIES}")


def quantize(x: torch.Tensor, fmt: FloatFormat = E4M3, granularity: str = "tensorwise",
             pow2: bool = False, block: int = FP8_BLOCK) -> FP8Tensor:
    """Scaled, saturating cast of a 2-D tensor to FP8 (computed in float32)."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    multiplier = amax_to_scale(_amax(x, granularity, block), fmt, pow2)
    full = expand_scale(multiplier, tuple(x.shape), granularity, block)
    scaled = (x.float() * full).clamp(-fmt.max, fmt.max)
    # row-major data whatever x's strides (a transposed x gives a transposed result):
    # cuBLASLt's FP8 GEMM takes its first operand row-major
    return FP8Tensor(scaled.to(fmt.dtype).contiguous(), multiplier.reciprocal(), granularity,
                     fmt, block)


def quantize_with_amax(x: torch.Tensor, amax: torch.Tensor, fmt: FloatFormat = E4M3,
                       pow2: bool = False) -> FP8Tensor:
    """Tensorwise cast of a 2-D x with the multiplier of a given `amax` (delayed scaling:
    the amax of earlier steps, Transformer Engine's `DelayedScaling`), not x's own: x · m
    may then exceed the format's range, and the clamp saturates it (here it does work)."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    multiplier = amax_to_scale(amax.detach().float().reshape(()), fmt, pow2)
    scaled = (x.float() * multiplier).clamp(-fmt.max, fmt.max)
    return FP8Tensor(scaled.to(fmt.dtype).contiguous(), multiplier.reciprocal(), "tensorwise",
                     fmt)


def dequantize(q: FP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data · scale, in `dtype` (for tests and for re-quantising along another axis)."""
    full = expand_scale(q.scale, q.shape, q.granularity, q.block)
    return (q.data.float() * full).to(dtype)


KERNELS = ("emulated", "scaled_mm")


def fp8_mm(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype = torch.float32,
           kernel: str = "emulated") -> torch.Tensor:
    """a · bᵀ for a (M, K), b (N, K) quantised along K, accumulated in float32.
    `kernel` picks the blockwise path (tensorwise and rowwise always take _scaled_mm)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_mm: inner dimensions differ: {a.shape} x {b.shape}ᵀ")
    kinds = (a.granularity, b.granularity)
    if kinds in (("tensorwise", "tensorwise"), ("rowwise", "rowwise")):
        scale_b = b.scale if b.granularity == "tensorwise" else b.scale.reshape(1, -1)
        return fp8_scaled_mm(a.data, b.data, a.scale, scale_b, out_dtype)
    if kinds == ("rowwise", "tensorwise"):  # rowwise_gw_hp's input gradient: b's one
        # scale repeated per row of b, as torchao does (float8_ops.py preprocess_addmm:
        # _scaled_mm takes both operands at one granularity)
        scale_b = b.scale.reshape(1).repeat(b.shape[0]).reshape(1, -1)
        return fp8_scaled_mm(a.data, b.data, a.scale, scale_b, out_dtype)
    if a.granularity in ("tiles", "blocks") and b.granularity in ("tiles", "blocks"):
        if kernel == "scaled_mm":
            return blockwise_scaled_mm(a, b, out_dtype)
        if kernel != "emulated":
            raise ValueError(f"unknown blockwise FP8 kernel '{kernel}'; one of {KERNELS}")
        return blockwise_mm(a, b, out_dtype)
    raise ValueError(f"fp8_mm has no kernel for {a.granularity} x {b.granularity} scales")


def _row_slice_scales(q: FP8Tensor) -> torch.Tensor:
    """(rows, K slices): the scale of each row's piece of each 128-wide K slice."""
    if q.granularity == "tiles":
        return q.scale
    return q.scale.repeat_interleave(q.block, dim=0)[: q.shape[0]]


def blockwise_mm(a: FP8Tensor, b: FP8Tensor,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The K-slice kernel: sum over slices k of (a_k · b_kᵀ) ⊙ (s_a[:, k] s_b[:, k]ᵀ), fp32
    (one op: fp8_ops.py `fp8_blockwise_emulated_mm`), cast to `out_dtype`."""
    if a.block != b.block:
        raise ValueError(f"blockwise_mm: block sizes differ ({a.block} and {b.block})")
    return fp8_blockwise_emulated_mm(a.data, b.data, _row_slice_scales(a),
                                     _row_slice_scales(b), a.block, out_dtype)
