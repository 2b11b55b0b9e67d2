"""Block kernels of the ring: attention of a block of queries over a block of keys that also
returns each row's log-sum-exp (LSE), and its backward given the merged output and LSE.

Three implementations, one contract (shapes q: (b, h, n, d), k/v: (b, h_kv, m, d) with h_kv
dividing h; causal blocks are square, masked top-left as the diagonal of a causal matrix):

    fused      CPU: aten's `_scaled_dot_product_flash_attention_for_cpu` and its backward.
    flash      CUDA, bf16/fp16: aten's `_scaled_dot_product_flash_attention` (FlashAttention-2,
               Dao 2023) and its backward, which return and take the LSE (natural log). K/V
               are expanded to the query heads and their gradients summed back over each
               group, so grouped-query attention needs nothing of the kernel.
    portable   any device and dtype: the matmuls and the LSE written out in fp32,
               S = q·kᵀ·scale (−inf above the diagonal when causal), lse = logsumexp(S),
               P = exp(S − lse), out = P·v; backward with D = rowsum(dO ∘ out):
               dv = Pᵀ·dO, dP = dO·vᵀ, dS = P ∘ (dP − D), dq = dS·k·scale, dk = dSᵀ·q·scale
               (the softmax gradient as FlashAttention's backward writes it, Dao et al. 2022
               Algorithm 4). It holds a block's n × m scores, so it is the correctness
               reference and the fallback, not the fast path.

The backward takes the *merged* output and LSE of all blocks, not the block's own: then
P = exp(S − lse) is this block's share of the full softmax, and the block gradients sum to
the gradient of the full attention (the identity the ring's backward relies on).

On CUDA the flash kernel is tried once per (dtype, head dim) on a small input against the
portable one; if it raises or disagrees, the portable kernel runs for that case and a warning
says so. No GPU ran this module's CUDA path when it was written: the CPU tests check the
portable kernel against the fused one, the flash path is untested on a GPU.
"""

from __future__ import annotations

import functools
import warnings

import torch

KERNELS = ("auto", "fused", "flash", "portable")


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, h_kv, m, d) → (b, heads, m, d): each K/V head serves heads / h_kv query heads."""
    group = heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _sum_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse of `_expand_heads` for gradients: sum over each group of query heads."""
    b, heads, m, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, m, d).sum(dim=2)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), _expand_heads(k, q.shape[1]).float().transpose(-1, -2))
    scores.mul_(scale)
    if causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(mask, float("-inf"))
    return scores


def portable_forward(q, k, v, causal: bool, scale: float):
    """(out in q's dtype, lse fp32 (b, h, n)) by matmuls in fp32."""
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    out = torch.matmul(probs, _expand_heads(v, q.shape[1]).float())
    return out.to(q.dtype), lse


def portable_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) in the inputs' dtypes from the merged `out` and `lse` (see above)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    probs = _scores(q, k, causal, scale).sub_(lse.float().unsqueeze(-1)).exp_()
    d_out = grad_out.float()
    v_wide = _expand_heads(v, heads).float()
    dv = torch.matmul(probs.transpose(-1, -2), d_out)
    row_dot = (d_out * out.float()).sum(dim=-1, keepdim=True)
    d_scores = probs.mul_(torch.matmul(d_out, v_wide.transpose(-1, -2)).sub_(row_dot))
    dq = torch.matmul(d_scores, _expand_heads(k, heads).float()).mul_(scale)
    dk = torch.matmul(d_scores.transpose(-1, -2), q.float()).mul_(scale)
    return (dq.to(q.dtype), _sum_heads(dk, kv_heads).to(k.dtype),
            _sum_heads(dv, kv_heads).to(v.dtype))


def fused_cpu_forward(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


def fused_cpu_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


def flash_cuda_forward(q, k, v, causal: bool, scale: float):
    heads = q.shape[1]
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _expand_heads(k, heads), _expand_heads(v, heads), 0.0, causal, False, scale=scale)
    return result[0], result[1]


def flash_cuda_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    heads, kv_heads = q.shape[1], k.shape[1]
    # Dense inputs: no cumulative sequence lengths; without dropout the RNG state is unread.
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, _expand_heads(k, heads), _expand_heads(v, heads), out, lse, None, None,
        q.shape[2], k.shape[2], 0.0, causal, rng, offset, scale=scale)
    return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


IMPLEMENTATIONS = {"fused": (fused_cpu_forward, fused_cpu_backward),
                   "flash": (flash_cuda_forward, flash_cuda_backward),
                   "portable": (portable_forward, portable_backward)}


@functools.lru_cache(maxsize=64)
def _flash_works(device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Run flash once on a small causal GQA block, forward and backward, against the
    portable kernel (bf16/fp16 tolerance 2e-2 relative)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, d_out = (torch.randn(1, heads, 64, head_dim, generator=gen, device=device,
                                  dtype=dtype) for heads in (4, 2, 2, 4))
    scale = head_dim ** -0.5
    try:
        got = flash_cuda_forward(q, k, v, True, scale)
        got_grads = flash_cuda_backward(d_out, q, k, v, got[0], got[1], True, scale)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        warnings.warn(f"context parallelism: the flash kernel failed on {device} {dtype} "
                      f"(head dim {head_dim}): {str(e).splitlines()[0]}; the portable block "
                      f"kernel runs instead", stacklevel=3)
        return False
    want = portable_forward(q, k, v, True, scale)
    want_grads = portable_backward(d_out, q, k, v, want[0], want[1], True, scale)
    pairs = [(got[0], want[0]), (got[1], want[1]), *zip(got_grads, want_grads)]
    ok = all(float((a.float() - b.float()).norm()) <= 2e-2 * float(b.float().norm()) + 1e-6
             for a, b in pairs)
    if not ok:
        warnings.warn(f"context parallelism: the flash kernel disagrees with the portable one "
                      f"on {device} {dtype}; the portable block kernel runs instead",
                      stacklevel=3)
    return ok


def choose(q: torch.Tensor, kernel: str = "auto") -> str:
    """Which implementation runs a block of `q`: the one asked for, or for "auto" fused on
    CPU, flash on CUDA in bf16/fp16 with a head dim flash takes (≤ 256, a multiple of 8) once
    it has passed its check, portable otherwise."""
    if kernel != "auto":
        return kernel
    if q.device.type == "cpu" and hasattr(torch.ops.aten,
                                          "_scaled_dot_product_flash_attention_for_cpu"):
        return "fused"
    head_dim = q.shape[-1]
    if (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)
            and head_dim <= 256 and head_dim % 8 == 0
            and _flash_works(str(q.device), q.dtype, head_dim)):
        return "flash"
    return "portable"
