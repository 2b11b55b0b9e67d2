"""The blockwise FP8 GEMM on the hardware: cuBLASLt's DeepSeek-style scaled matmul.

PyTorch exposes it as `F.scaled_mm(mat_a, mat_b, scale_a, ScalingType.BlockWise1x128,
scale_b, ScalingType.BlockWise1x128 | BlockWise128x128)` (torch 2.10+; the same op is
`torch._scaled_mm_v2` with the recipes as integers 4 and 5, which torchao falls back to).
It runs on CUDA with compute capability 9.x (H100, H200) and cuBLASLt >= 12.9 only
(aten/src/ATen/native/cuda/ScaledBlas.cpp, `_check_deepseek_support`); on CPU it raises.

The layouts it takes (torch/_meta_registrations.py `_check_scaled_mm_sizes_v2`; torchao
prototype/blockwise_fp8_training), for out = mat_a · mat_b with mat_a (M, K) row-major and
mat_b (K, N) column-major (that is, the (N, K) operand of `fp8_mm(a, b)` = a · bᵀ,
transposed as a view), fp32 scales, L4 = round_up(K/128, 4):

    a 1x128 tiles      scale_a (M, K/128)    strides (1, M)     "M-major"
    b 128x128 blocks   scale_b (L4, N/128)   strides (1, L4)    the transpose of the
                       weight's (N/128, K/128) block scales, padded to (N/128, L4)
    b 1x128 tiles      scale_b (N, K/128)    strides (1, N)     (the weight gradient)

Without the L4 padding cuBLASLt reads the block scales with leading dimension L4 anyway
and the result is silently wrong when (K/128) % 4 != 0 (pytorch PR #166752); the padding
holds 1.0, as torchao's `_pad_blockwise_128x128_scale_k_major` does.

What the kernel cannot take is refused before a run (config/fp8.py, lowp/convert.py): a
weight dimension that is not a multiple of 128 (a block would be partial). The token
dimension is padded here with zeros to a multiple of 128: as the rows of a (forward,
input gradient) zero rows give zero outputs, sliced off; as the reduction dimension
(weight gradient, tiles along the tokens) zero columns add nothing and a partial last
tile keeps the scale the emulation gives it (its amax ignores zeros). So both paths
quantise the same groups and differ only in summation order and the output rounding: the
kernel is asked for bf16 (as torchao's blockwise linear asks; fp32 output unverified), so an
fp32 caller gets bf16-rounded values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

BLOCK = 128
RECIPE_IDS = {"BlockWise1x128": 4, "BlockWise128x128": 5}  # torch's ScalingType values
_KIND = {"tiles": "BlockWise1x128", "blocks": "BlockWise128x128"}


def scaled_mm_api() -> str | None:
    """Which entry point this torch has for the blockwise scaled matmul, or None."""
    scaling = getattr(F, "ScalingType", None)
    if hasattr(F, "scaled_mm") and scaling is not None and hasattr(scaling, "BlockWise1x128"):
        return "F.scaled_mm"
    if hasattr(torch, "_scaled_mm_v2"):
        return "torch._scaled_mm_v2"
    return None


def kernel_support(device: torch.device) -> tuple[bool, str]:
    """(True, what) where the blockwise kernel can run on `device`, else (False, why):
    CUDA, the API, compute capability 9.x, then a probe that runs it once (the cuBLASLt
    version is not visible from Python; a build without 12.9 fails the probe)."""
    if device.type != "cuda":
        return False, f"device {device.type}: cuBLASLt's blockwise FP8 GEMM is CUDA-only"
    if scaled_mm_api() is None:
        return False, f"torch {torch.__version__} has neither F.scaled_mm nor _scaled_mm_v2"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return False, (f"{torch.cuda.get_device_name(device)} has compute capability "
                       f"{major}.{minor}; cuBLASLt's blockwise FP8 GEMM needs 9.x")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe(torch.device("cuda", index))


class ScaledOperand(Protocol):
    """What the kernel reads of an FP8 operand: numerics/fp8.py's FP8Tensor has these fields
    (named here rather than imported, so that fp8.py, which calls this module, is the only
    one of the two to import the other)."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    block: int

    @property
    def shape(self) -> tuple[int, int]: ...


@dataclass
class _Operand:
    """The fields `kernel_operands` reads of an FP8Tensor (the probe builds its own)."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    block: int = BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)


@functools.cache
def _probe(device: torch.device) -> tuple[bool, str]:
    """Run a 256 x 384 x 256 product (K/128 = 3: the L4 padding matters) of random FP8
    values and scales on the device against `reference_scaled_mm`; any error or a wrong
    result says the kernel is unusable here."""
    gen = torch.Generator(device=device).manual_seed(0)
    m, k, n = 256, 384, 256

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=gen) + 0.5

    a = _Operand(torch.randn(m, k, device=device, generator=gen).to(torch.float8_e4m3fn),
                 rand(m, k // BLOCK), "tiles")
    b = _Operand(torch.randn(n, k, device=device, generator=gen).to(torch.float8_e4m3fn),
                 rand(n // BLOCK, k // BLOCK), "blocks")
    try:
        ops = kernel_operands(a, b)
        out = call_scaled_mm(ops).double().cpu()[:m]
    except Exception as e:  # noqa: BLE001  any failure (a changed signature too) says "no"
        text = str(e).strip().splitlines()
        return False, (f"the blockwise scaled_mm probe failed: {type(e).__name__}: "
                       f"{text[0] if text else ''}")
    ref = reference_scaled_mm(ops)[:m]
    rel = ((out - ref).norm() / ref.norm()).item()
    if not rel < 2.0**-8 + 1e-4:  # bf16 output rounding plus the kernel's fp32 sums
        return False, f"the blockwise scaled_mm probe is off by {rel:.1e} (relative)"
    return True, f"cuBLASLt blockwise FP8 GEMM via {scaled_mm_api()}"


def kernel_shape_problem(rows: int, cols: int) -> str | None:
    """Why a weight of (rows, cols) cannot go through the kernel, or None."""
    bad = [d for d in (rows, cols) if d % BLOCK]
    if bad:
        return f"weight shape ({rows}, {cols}) has a dimension not a multiple of {BLOCK}"
    return None


def _pad_dim(t: torch.Tensor, dim: int, size: int, value: float = 0.0) -> torch.Tensor:
    extra = size - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def _m_major(scale: torch.Tensor) -> torch.Tensor:
    """A (R, C) scale with strides (1, R): the same values, stored column by column."""
    return scale.t().contiguous().t()


def kernel_operands(a: ScaledOperand, b: ScaledOperand) -> dict:
    """The exact arguments of the scaled-matmul call for a · bᵀ (a: tiles, b: tiles or
    blocks, both along K), and `rows`, the rows of the result to keep."""
    if a.granularity != "tiles" or b.granularity not in _KIND:
        raise ValueError(f"the blockwise kernel takes tiles x (tiles | blocks), got "
                         f"{a.granularity} x {b.granularity}")
    if a.block != BLOCK or b.block != BLOCK:
        raise ValueError(f"the blockwise kernel takes {BLOCK}-wide groups only")
    (m, k), n = a.shape, b.shape[0]
    if n % BLOCK:
        raise ValueError(f"blockwise kernel: the weight side has {n} rows, not a multiple "
                         f"of {BLOCK}")
    kp, mp = math.ceil(k / BLOCK) * BLOCK, math.ceil(m / BLOCK) * BLOCK
    a_data = _pad_dim(_pad_dim(a.data, 1, kp), 0, mp)  # zero columns, then zero rows
    b_data = _pad_dim(b.data, 1, kp)
    scale_a = _m_major(_pad_dim(a.scale, 0, mp, 1.0))  # (mp, kp/128), strides (1, mp)
    if b.granularity == "blocks":  # (n/128, kp/128) -> (L4, n/128), strides (1, L4)
        l4 = math.ceil(kp // BLOCK / 4) * 4
        scale_b = _pad_dim(b.scale, 1, l4, 1.0).t()
    else:  # tiles (n, kp/128), strides (1, n)
        scale_b = _m_major(b.scale)
    return {"mat_a": a_data, "mat_b": b_data.t(), "scale_a": scale_a, "kind_a": "BlockWise1x128",
            "scale_b": scale_b, "kind_b": _KIND[b.granularity], "rows": m}


def call_scaled_mm(ops: dict, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The kernel call itself, through whichever entry point this torch has."""
    api = scaled_mm_api()
    if api == "F.scaled_mm":
        st = F.ScalingType
        return F.scaled_mm(ops["mat_a"], ops["mat_b"], ops["scale_a"], getattr(st, ops["kind_a"]),
                           ops["scale_b"], getattr(st, ops["kind_b"]), output_dtype=out_dtype)
    if api == "torch._scaled_mm_v2":
        return torch._scaled_mm_v2(ops["mat_a"], ops["mat_b"], [ops["scale_a"]],
                                   [RECIPE_IDS[ops["kind_a"]]], [], [ops["scale_b"]],
                                   [RECIPE_IDS[ops["kind_b"]]], [], None, out_dtype, [], False)
    raise RuntimeError(f"torch {torch.__version__} has no blockwise scaled matmul")


def reference_scaled_mm(ops: dict) -> torch.Tensor:
    """What the kernel computes with these operands, in float64 on any device, reading each
    scale from its storage the way cuBLASLt does (by its leading dimension, not by the
    tensor's shape): a scale tensor of the wrong layout or without the L4 padding gives a
    wrong result here as on the GPU. For the tests; slow."""
    a, b = (ops[key].detach().cpu().double() for key in ("mat_a", "mat_b"))  # (M, K), (K, N)
    (m, k), n = a.shape, b.shape[1]
    kb = k // BLOCK
    sa = _read(ops["scale_a"], (m, kb), (1, m))
    if ops["kind_b"] == "BlockWise128x128":
        l4 = math.ceil(kb / 4) * 4
        sb = _read(ops["scale_b"], (kb, n // BLOCK), (1, l4)).repeat_interleave(BLOCK, 1)
    else:
        sb = _read(ops["scale_b"], (n, kb), (1, n)).t()  # (kb, n)
    out = torch.zeros(m, n, dtype=torch.float64)
    for i in range(kb):
        cols = slice(i * BLOCK, (i + 1) * BLOCK)
        out += (a[:, cols] @ b[cols]) * sa[:, i:i + 1] * sb[i:i + 1]
    return out


def _read(scale: torch.Tensor, size: tuple[int, int], stride: tuple[int, int]) -> torch.Tensor:
    """The (size) matrix the kernel sees at the scale's first element with `stride`."""
    base = scale.detach().cpu()  # a dense view keeps its strides (and storage) on the copy
    if base.stride() != scale.stride():
        raise ValueError(f"scale of strides {scale.stride()} is not dense")
    offset = base.storage_offset()
    need = offset + (size[0] - 1) * stride[0] + (size[1] - 1) * stride[1] + 1
    if need > base.untyped_storage().nbytes() // base.element_size():
        raise ValueError(f"scale storage too small for {size} at strides {stride}: the kernel "
                         f"would read past it")
    return base.as_strided(size, stride, offset).double()
