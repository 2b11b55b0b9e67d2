"""Causal attention over a sequence split across the cp group: ring and all-gather K/V.

Both schemes run the same block loop. For each source rank (this rank first, then the rank
before it, ...), the local queries attend to that rank's keys through the calls of
`layout.block_calls` (full, diagonal or skipped), with a block kernel that returns each
row's log-sum-exp (LSE): fused on CPU, flash on CUDA, portable matmuls anywhere (kernels.py).
Partial outputs are merged in fp32 in the stable form

    out ← out − sigmoid(lse_b − lse) · (out − out_b),   lse ← lse − logsigmoid(lse − lse_b)

(the same merge as PyTorch's `_templated_ring_attention` and zhuzilin's ring-flash-attention,
written here from the softmax identity out = Σ_b exp(lse_b − lse) out_b).

    ring       K/V (packed as one tensor) travel to the next rank cp − 1 times; the next
               transfer is posted before the current block's attention, so it overlaps.
               Backward: K/V travel again, and the fp32 dK/dV accumulators travel with the
               block they belong to, cp sends in all, the last one home to the owner; dQ
               stays local.
    allgather  one all-gather of K/V per layer (Llama 3, Dubey et al. 2024 §3.3.2), kept for
               backward, and one reduce-scatter of the fp32 dK/dV in backward.

Backward recomputes nothing of the forward: each block's gradient comes from the kernel's
backward with the merged output and LSE, which is exactly the gradient of the full softmax.
"""

from __future__ import annotations

import torch

from fivefold.parallel import comm
from fivefold.parallel.comm import P2P, Group
from fivefold.parallel.context import kernels
from fivefold.parallel.context.layout import block_calls, ring_sources

SCHEMES = ("ring", "allgather")


def kernel_available(device_type: str) -> bool:
    """Whether a block kernel with the LSE runs on this device: the portable one runs on any
    (kernels.py); the fused CPU and flash CUDA ones are chosen where they apply."""
    return True


def block_forward(q, k, v, causal: bool, scale: float, kernel: str = "auto"):
    """(out, lse fp32) of one block; k/v may have fewer heads (grouped-query attention)."""
    return kernels.IMPLEMENTATIONS[kernels.choose(q, kernel)][0](q, k, v, causal, scale)


def block_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float,
                   kernel: str = "auto"):
    return kernels.IMPLEMENTATIONS[kernels.choose(q, kernel)][1](grad_out, q, k, v, out, lse,
                                                                 causal, scale)


def _rows(t: torch.Tensor, lo: int, hi: int, chunk: int) -> torch.Tensor:
    return t[:, :, lo * chunk:hi * chunk]


class _Accumulator:
    """Merged output and LSE of the local queries, fp32."""

    def __init__(self, q: torch.Tensor):
        self.out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        self.lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)

    def add(self, rows: slice, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        out, lse = self.out[:, :, rows], self.lse[:, :, rows]
        if torch.isneginf(lse).all():  # first block for these rows
            out.copy_(out_b)
            lse.copy_(lse_b)
            return
        lse_b = lse_b.float()
        out.sub_(torch.sigmoid(lse_b - lse).unsqueeze(-1) * (out - out_b.float()))
        lse.sub_(torch.nn.functional.logsigmoid(lse - lse_b))


def _forward_block(acc, q, kv, calls, chunk, scale, counter, kernel="auto"):
    for call in calls:
        rows = slice(call.q0 * chunk, call.q1 * chunk)
        out_b, lse_b = block_forward(_rows(q, call.q0, call.q1, chunk),
                                     _rows(kv[0], call.k0, call.k1, chunk),
                                     _rows(kv[1], call.k0, call.k1, chunk), call.causal, scale,
                                     kernel)
        acc.add(rows, out_b, lse_b)
        if counter is not None:
            counter.append(call.score_pairs(chunk) * q.shape[0] * q.shape[1])


def _backward_block(dq, dkv, grad_out, q, kv, out, lse, calls, chunk, scale, kernel="auto"):
    for call in calls:
        qr = slice(call.q0 * chunk, call.q1 * chunk)
        kr = slice(call.k0 * chunk, call.k1 * chunk)
        g_q, g_k, g_v = block_backward(
            grad_out[:, :, qr], q[:, :, qr], kv[0][:, :, kr], kv[1][:, :, kr], out[:, :, qr],
            lse[:, :, qr], call.causal, scale, kernel)
        dq[:, :, qr] += g_q
        dkv[0][:, :, kr] += g_k
        dkv[1][:, :, kr] += g_v


class ContextAttention(torch.autograd.Function):
    """softmax(QKᵀ·scale, causal over the true positions)·V for the local queries.

    q: (b, heads, 2c, d); k, v: (b, kv_heads, 2c, d), this rank's two chunks. `kernel` picks
    the block kernel (kernels.py: auto, fused, flash or portable).
    """

    @staticmethod
    def forward(ctx, q, k, v, group: Group, layout: str, scheme: str, counter,
                kernel: str = "auto"):
        cp, rank = group.size, group.rank
        chunk, scale = q.shape[2] // 2, q.shape[-1] ** -0.5
        kv = torch.stack([k, v])  # one message per transfer
        acc = _Accumulator(q)
        if scheme == "ring":
            held = kv
            for step, src in enumerate(ring_sources(cp, rank)):
                if step < cp - 1:  # post the next transfer first: it overlaps this block
                    incoming = torch.empty_like(held)
                    handles = comm.batch_p2p([P2P("send", held, (rank + 1) % cp),
                                              P2P("recv", incoming, (rank - 1) % cp)], group)
                _forward_block(acc, q, held, block_calls(layout, cp, rank, src), chunk, scale,
                               counter, kernel)
                if step < cp - 1:
                    for h in handles:
                        h.wait()
                    held = incoming
            saved_kv = kv
        else:
            gathered = torch.empty((cp,) + kv.shape, dtype=kv.dtype, device=kv.device)
            comm.all_gather(gathered.view(-1), kv.reshape(-1), group)
            for src in ring_sources(cp, rank):
                _forward_block(acc, q, gathered[src], block_calls(layout, cp, rank, src), chunk,
                               scale, counter, kernel)
            saved_kv = gathered
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, saved_kv, out, acc.lse)
        ctx.group, ctx.layout, ctx.scheme, ctx.kv_dtype = group, layout, scheme, k.dtype
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, saved_kv, out, lse = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        cp, rank = group.size, group.rank
        chunk, scale = q.shape[2] // 2, q.shape[-1] ** -0.5
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if ctx.scheme == "ring":
            dkv = _ring_backward(dq, grad_out, q, saved_kv, out, lse, group, layout, chunk,
                                 scale, ctx.kernel)
        else:
            grads = torch.zeros(saved_kv.shape, dtype=torch.float32, device=q.device)
            for src in ring_sources(cp, rank):
                _backward_block(dq, grads[src], grad_out, q, saved_kv[src], out, lse,
                                block_calls(layout, cp, rank, src), chunk, scale, ctx.kernel)
            dkv = torch.empty(saved_kv.shape[1:], dtype=torch.float32, device=q.device)
            comm.reduce_scatter(dkv.view(-1), grads.view(-1), group)
        dkv = dkv.to(ctx.kv_dtype)
        return dq.to(q.dtype), dkv[0], dkv[1], None, None, None, None, None


def _ring_backward(dq, grad_out, q, kv, out, lse, group, layout, chunk, scale, kernel):
    """K/V go round again; each block's fp32 dK/dV accumulator follows it, home at the end."""
    cp, rank = group.size, group.rank
    held, kv_handles, acc_handles, incoming_acc = kv, [], [], None
    for step, src in enumerate(ring_sources(cp, rank)):
        if step < cp - 1:
            incoming = torch.empty_like(held)
            kv_handles = comm.batch_p2p([P2P("send", held, (rank + 1) % cp),
                                         P2P("recv", incoming, (rank - 1) % cp)], group)
        block = torch.zeros(held.shape, dtype=torch.float32, device=held.device)
        _backward_block(dq, block, grad_out, q, held, out, lse,
                        block_calls(layout, cp, rank, src), chunk, scale, kernel)
        if incoming_acc is not None:  # what the earlier ranks added to this block's grads
            for h in acc_handles:
                h.wait()
            block += incoming_acc
        incoming_acc = torch.empty_like(block)
        acc_handles = comm.batch_p2p([P2P("send", block, (rank + 1) % cp),
                                      P2P("recv", incoming_acc, (rank - 1) % cp)], group)
        if step < cp - 1:
            for h in kv_handles:
                h.wait()
            held = incoming
    for h in acc_handles:
        h.wait()
    return incoming_acc  # this rank's own block, with every rank's contribution
