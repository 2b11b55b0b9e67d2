"""The FP8 GEMMs as torch custom ops, opaque to `torch.compile`.

cuBLASLt's FP8 GEMM takes its operands in one layout only: the first row-major, the second
column-major (the "TN" layout; torch/_meta_registrations.py `_check_scaled_mm_sizes`), and
the blockwise kernel also fixes the strides of its scales (numerics/fp8_kernel.py).
Inductor lowers `aten._scaled_mm` itself and is free to re-layout a graph's intermediate
tensors; fed the quantiser's output it handed the GEMM a row-major second operand and
failed: `InductorError: _scaled_mm: mat_b must be col_major, got stride [512, 1]`
(torch 2.13, fivefold's FP8 linear under torch.compile on a CPU). A custom op is a call
inductor keeps as it is; each op below also puts its operands into the layout its kernel
needs (a no-op for the eager callers, which pass them so), so whatever strides a compiled
graph chooses the GEMM gets what it takes.

    fp8_scaled_mm(a, b, scale_a, scale_b, out_dtype)        tensorwise and rowwise
    fp8_blockwise_scaled_mm(a, b, scale_a, scale_b, kind_b) 1x128 tiles x tiles | blocks

Both compute a · bᵀ for a (M, K) and b (N, K) FP8 codes quantised along K. Each has a fake
(meta) implementation, so a trace (fivefold.trace) sees one GEMM with its bytes, and a FLOP
formula in torch's table (torch.utils.flop_counter), so it counts 2·M·K·N FLOPs at the FP8
peak as `aten._scaled_mm` does. torch.library.custom_op and register_fake: torch >= 2.4.
"""

from __future__ import annotations

import torch

from fivefold.numerics import fp8_kernel
from fivefold.numerics.fp8_kernel import ScaledOperand, kernel_operands


@torch.library.custom_op("fivefold::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a · bᵀ on `torch._scaled_mm` (cuBLASLt on CUDA, torch's kernel on a CPU); scale_a
    () or (M, 1), scale_b () or (1, N): dequantisation scales applied to the fp32 sums."""
    a, b = a.contiguous(), b.contiguous()  # a row-major; bᵀ column-major
    if a.device.type != "cpu":
        return _aligned_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    try:
        return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b,
                                out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError):
        # A torch build without a CPU _scaled_mm (2.13 has one): the same product, exact
        # FP8 values multiplied in fp32 and scaled after (equal up to fp32 summation order).
        return ((a.float() @ b.float().t()) * (scale_a * scale_b)).to(out_dtype)


def _pad_to_16(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    if tuple(t.shape) == (rows, cols):
        return t
    out = torch.full((rows, cols), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _aligned_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """cuBLASLt takes K and N in multiples of 16 only (torch/_meta_registrations.py
    `_check_scaled_mm_sizes`; the weight gradient's K is the token count, an expert's any
    number): pad K with zero codes (they add nothing to a sum) and N with zero rows (their
    columns of the result are dropped); a rowwise scale_b gets 1.0 there. No copy when both
    are multiples of 16."""
    (m, k), n = a.shape, b.shape[0]
    kp, np_ = -(-k // 16) * 16, -(-n // 16) * 16
    if (kp, np_) == (k, n):
        return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    a, b = _pad_to_16(a, m, kp), _pad_to_16(b, np_, kp)
    if scale_b.numel() > 1:
        scale_b = _pad_to_16(scale_b, 1, np_, 1.0)
    out = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[:, :n].contiguous()


@fp8_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _m_major(scale: torch.Tensor) -> torch.Tensor:
    """(R, C) with strides (1, R); no copy when it is already so."""
    return scale.t().contiguous().t()


@torch.library.custom_op("fivefold::fp8_blockwise_scaled_mm", mutates_args=())
def fp8_blockwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                     scale_b: torch.Tensor, kind_b: str) -> torch.Tensor:
    """a · bᵀ (bf16) on cuBLASLt's blockwise FP8 GEMM, with the operands of
    numerics/fp8_kernel.py `kernel_operands`: a (M, K) padded to whole tiles, scale_a
    (M, K/128) M-major, b (N, K), scale_b (L4, N/128) for "BlockWise128x128" or (N, K/128)
    for "BlockWise1x128", both stored column by column."""
    ops = {"mat_a": a.contiguous(), "mat_b": b.contiguous().t(), "scale_a": _m_major(scale_a),
           "kind_a": "BlockWise1x128", "scale_b": _m_major(scale_b), "kind_b": kind_b}
    return fp8_kernel.call_scaled_mm(ops, torch.bfloat16)  # by the module: tests replace it


@fp8_blockwise_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, kind_b):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("fivefold::fp8_blockwise_emulated_mm", mutates_args=())
def fp8_blockwise_emulated_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                              scale_b: torch.Tensor, block: int,
                              out_dtype: torch.dtype) -> torch.Tensor:
    """a · bᵀ for a (M, K), b (N, K) FP8 codes in K slices of `block` (numerics/fp8.py
    `blockwise_mm`, the emulated kernel): sum over slices k of (a_k · b_kᵀ) ⊙ (scale_a[:, k]
    scale_b[:, k]ᵀ) in fp32, scale_a (M, K/block) and scale_b (N, K/block) per row and
    slice, cast to `out_dtype`. One op, so that recompute = auto's policy keeps its output
    (parallel/recompute.py), not each slice's fp32 partial."""
    k = a.shape[1]
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for i, start in enumerate(range(0, k, block)):
        a_k = a[:, start:start + block].float()
        b_k = b[:, start:start + block].float()
        partial = a_k @ b_k.t()  # exact products, fp32 sum over <= 128 elements
        out.addcmul_(partial, scale_a[:, i:i + 1] * scale_b[:, i].reshape(1, -1))
    return out.to(out_dtype)


@fp8_blockwise_emulated_mm.register_fake
def _(a, b, scale_a, scale_b, block, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def blockwise_scaled_mm(a: ScaledOperand, b: ScaledOperand,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a · bᵀ on cuBLASLt (bf16 out, as torchao asks for it; cast to `out_dtype`): the
    kernel path of numerics/fp8.py `fp8_mm`."""
    ops = kernel_operands(a, b)
    out = fp8_blockwise_scaled_mm(ops["mat_a"], ops["mat_b"].t(), ops["scale_a"],
                                  ops["scale_b"], ops["kind_b"])
    return out[: ops["rows"]].to(out_dtype)


def _register_flops() -> None:
    """2·M·K·N for each op, in torch's FLOP table (which fivefold.trace reads)."""
    try:
        from torch.utils.flop_counter import register_flop_formula
    except ImportError:  # pragma: no cover - every torch this project supports has it
        return

    def gemm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[0]

    register_flop_formula([torch.ops.fivefold.fp8_scaled_mm,
                           torch.ops.fivefold.fp8_blockwise_scaled_mm,
                           torch.ops.fivefold.fp8_blockwise_emulated_mm])(gemm_flops)


_register_flops()
