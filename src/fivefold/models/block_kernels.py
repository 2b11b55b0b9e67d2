"""RMSNorm and RoPE, forward and backward, as one kernel each on a GPU (RMSNorm's backward
two, for its weight gradient), registered as torch custom ops.

The norm's arithmetic (models/llama.py `RMSNormFunction`): statistics in fp32,
`rstd = 1 / sqrt(mean(x²) + eps)`, `y = weight · (x · rstd)` with the normalised value cast
to x's dtype before the weight; backward `dx = rstd · (gx − x̂ · mean(gx · x̂))` with
`gx = grad · weight`, and `dweight = Σ_rows grad · x̂` (x̂ rounded to x's dtype as in the
forward), all in fp32. Written with torch ops that is 25 kernels per norm, forward +
backward, each a pass over the activations (the casts to and from fp32 among them): 9.9 GB
a layer's two norms move at 8192 tokens of hidden 4096 (`fivefold trace`). Here the forward
reads x once and writes y and one fp32 statistic per row; the backward reads grad and x once,
writes dx, and its programs' partial sums of dweight (a few hundred rows of fp32) are added up
by one more reduction.

Where: a device other than the CPU, eager (under `torch.compile` inductor fuses the torch
ops itself), with Triton (or its interpreter, `TRITON_INTERPRET=1`, which the tests use in
fp32 and fp16). Without Triton the ops run the same torch arithmetic as `RMSNormFunction`;
the meta device's trace (fivefold.trace) sees one op for each. The CPU never takes this path,
so its results stay bit for bit what they were. On a GPU the row's sum of squares is reduced
in the kernel's order, not torch's: rstd may differ in its last bit (tests/test_block_kernels.py
holds both to the fp32 error model).
"""

from __future__ import annotations

import torch

from fivefold.numerics.kernel_support import compiling, triton_usable

try:  # Triton is optional (see models/loss_kernel.py)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# The fused path where it applies; False: the torch ops everywhere (a GPU benchmark's "before").
FUSED_ON_DEVICE = True
MAX_FUSED_DIM = 1 << 16  # one program holds a whole row


def fused_path(x: torch.Tensor) -> bool:
    """Whether the norm of x runs as these ops: not on a CPU, not while compiling, a row that
    fits one program."""
    if not FUSED_ON_DEVICE or x.device.type == "cpu" or x.shape[-1] > MAX_FUSED_DIM:
        return False
    return not compiling()


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, dim, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
        tl.store(rstd_ptr + row, rstd)
        xhat = (x32 * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * dim + cols, (w * xhat).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, dim,
                         ROWS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], tl.float32)
        for r in range(ROWS_PER_PROGRAM):
            row = (pid * ROWS_PER_PROGRAM + r).to(tl.int64)
            offs = row * dim + cols
            m = mask & (offs < rows * dim)  # a row past the last: nothing loaded or stored
            x = tl.load(x_ptr + offs, mask=m, other=0.0)
            g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + tl.minimum(row, rows - 1))  # a dead row loads 0s
            xhat = x.to(tl.float32) * rstd
            dw += g * xhat.to(x.dtype).to(tl.float32)
            gx = g * w
            dx = rstd * (gx - xhat * (tl.sum(gx * xhat, axis=0) / dim))
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(dw_ptr + pid * dim + cols, dw, mask=mask)


def rms_norm_reference_forward(x, weight, eps):
    """(y, rstd) by torch's ops: the CPU's norm, and the kernel's reference."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd


def rms_norm_reference_backward(grad, x, weight, rstd):
    """(grad_x, grad_weight) by torch's ops; d(x·rstd)/dx applied to gx = grad·weight is
    rstd · (gx − x̂ · mean(gx · x̂))."""
    xhat = x.float() * rstd
    grad32 = grad.float()
    grad_weight = (grad32 * xhat.to(x.dtype).float()).flatten(0, -2).sum(0)
    gx = grad32 * weight.float()
    grad_x = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def _block(dim: int) -> int:
    return triton.next_power_of_2(dim)


@torch.library.custom_op("fivefold::rms_norm_forward", mutates_args=())
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y in the dtype weight · x gives, rstd fp32 of shape (..., 1)."""
    if not (triton_usable(x.device) and x.is_contiguous() and weight.is_contiguous()):
        return rms_norm_reference_forward(x, weight, eps)
    dim = x.shape[-1]
    rows = x.numel() // max(dim, 1)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if rows:
        _forward_kernel[(rows,)](x, weight, y, rstd, dim, eps, BLOCK=_block(dim))
    return y, rstd


@rms_norm_forward.register_fake
def _(x, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


@torch.library.custom_op("fivefold::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x in x's dtype, grad_weight in weight's dtype)."""
    if not (triton_usable(x.device) and x.is_contiguous() and weight.is_contiguous()):
        return rms_norm_reference_backward(grad, x, weight, rstd)
    grad = grad.contiguous()
    dim = x.shape[-1]
    rows = x.numel() // max(dim, 1)
    # a few hundred programs, each summing its rows' share of the weight gradient
    per_program = max(1, triton.cdiv(rows, 512))
    programs = max(1, triton.cdiv(rows, per_program))
    grad_x = torch.empty_like(x)
    partial = torch.empty((programs, dim), dtype=torch.float32, device=x.device)
    if rows:
        _backward_kernel[(programs,)](grad, x, weight, rstd.contiguous(), grad_x, partial,
                                      rows, dim, ROWS_PER_PROGRAM=per_program,
                                      BLOCK=_block(dim))
    else:
        partial.zero_()
    return grad_x, partial.sum(0).to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# --- RoPE on q and k together (`apply_rope` below), forward and backward ---------------------
#
# x·cos + rotate_half(x)·sin with rotate_half(x) = (−x₂, x₁): one program a token, its q and k
# heads together, each product rounded to the activations' dtype before the sum as torch's
# three ops round (so on a GPU the result is torch's, bit for bit; fp contraction is off so
# that fp32 keeps the separate roundings too). Backward, the transpose of the same map:
# dx = g·cos + (g₂·sin₂, −g₁·sin₁).

if triton is not None:

    @triton.jit
    def _rope_rows(x_ptr, y_ptr, cos_ptr, sin_ptr, row, pos, heads, d, BACKWARD: tl.constexpr,
                   BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        mask = cols < heads * d
        j = cols % d
        half = d // 2
        first = j < half
        partner = tl.where(first, cols + half, cols - half)
        base = x_ptr + row * heads * d
        x = tl.load(base + cols, mask=mask, other=0.0)
        xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * d + j, mask=mask, other=0.0).to(tl.float32)
        jp = tl.where(first, j + half, j - half)
        if BACKWARD:
            # dx_j = g_j·cos_j + (j in the first half: g_{j+h}·sin_{j+h}; else −g_{j−h}·sin_{j−h})
            s = tl.load(sin_ptr + pos * d + jp, mask=mask, other=0.0).to(tl.float32)
            rot = (xp * s).to(x.dtype).to(tl.float32)
            rot = tl.where(first, rot, -rot)
        else:
            s = tl.load(sin_ptr + pos * d + j, mask=mask, other=0.0).to(tl.float32)
            rot = (tl.where(first, -xp, xp) * s).to(x.dtype).to(tl.float32)
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        tl.store(y_ptr + row * heads * d + cols, (a + rot).to(x.dtype), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, seq, q_heads, k_heads, d,
                     BACKWARD: tl.constexpr, QBLOCK: tl.constexpr, KBLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pos = row % seq
        _rope_rows(q_ptr, qo_ptr, cos_ptr, sin_ptr, row, pos, q_heads, d, BACKWARD, QBLOCK)
        _rope_rows(k_ptr, ko_ptr, cos_ptr, sin_ptr, row, pos, k_heads, d, BACKWARD, KBLOCK)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x₁, x₂) -> (−x₂, x₁) on the last dimension (HF Llama's rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by torch's ops (models/llama.py's everywhere but the fused path)."""
    return x * cos + rotate_half(x) * sin


def _rope_reference(x, cos, sin, backward: bool):
    """x (b, s, heads, d), cos/sin (s, d): torch's ops, `apply_rope` and its transpose."""
    cos, sin = cos[:, None], sin[:, None]
    if not backward:
        return apply_rope(x, cos, sin)
    gs = x * sin
    g1, g2 = gs.chunk(2, dim=-1)
    return x * cos + torch.cat((g2, -g1), dim=-1)


def rope_fused_path(q: torch.Tensor, cos: torch.Tensor) -> bool:
    """q (b, s, heads, d) as it leaves its projection, cos (s, d): the fused path's shapes,
    off a CPU, eager."""
    return (fused_path(q) and q.dim() == 4 and cos.dim() == 2 and cos.shape[0] == q.shape[1]
            and cos.shape[1] == q.shape[-1] and q.shape[-1] % 2 == 0
            and q.shape[2] * q.shape[3] <= MAX_FUSED_DIM)


def _rope(q, k, cos, sin, backward: bool):
    if not (triton_usable(q.device) and q.is_contiguous() and k.is_contiguous()
            and cos.is_contiguous() and sin.is_contiguous()):
        return _rope_reference(q, cos, sin, backward), _rope_reference(k, cos, sin, backward)
    b, s, hq, d = q.shape
    hk = k.shape[2]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel():
        _rope_kernel[(b * s,)](q, k, qo, ko, cos, sin, s, hq, hk, d, BACKWARD=backward,
                               QBLOCK=_block(hq * d), KBLOCK=_block(hk * d),
                               enable_fp_fusion=False)
    return qo, ko


@torch.library.custom_op("fivefold::rope_forward", mutates_args=())
def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q (b, s, heads, d) and k (b, s, kv_heads, d) at cos, sin (s, d)."""
    return _rope(q, k, cos, sin, backward=False)


@rope_forward.register_fake
def _(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("fivefold::rope_backward", mutates_args=())
def rope_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `rope_forward`'s q and k."""
    return _rope(grad_q, grad_k, cos, sin, backward=True)


@rope_backward.register_fake
def _(grad_q, grad_k, cos, sin):
    return grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape)


class RopeFunction(torch.autograd.Function):
    """RoPE of q and k in one op each way (the fused path's; `rope_fused_path`)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_forward(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        gq, gk = rope_backward(grad_q.contiguous(), grad_k.contiguous(), cos.contiguous(),
                               sin.contiguous())
        return gq, gk, None, None
