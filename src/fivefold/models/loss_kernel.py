"""One kernel for a chunk of logits' cross-entropy and its gradient, written over the logits.

`cross_entropy_rows_(logits, targets, vocab_start, num_valid, with_grads)` returns the fp32
per-token losses of `logits` (rows × V, any float dtype) and, with `with_grads`, overwrites
the logits with their gradient softmax − one-hot(target) for kept tokens (0 for targets of
-100 and for padding columns past `num_valid`).

The same arithmetic as the chunked loss's `_rows_loss` (models/loss.py), which on its own
is seven or eight passes over a T × V buffer (max, subtract, gather, exp, sum, scale,
scatter, and the casts to and from fp32 around them). On a GPU with Triton it is one kernel:
each program takes one row, reads it once for the running max and sum of exponentials
(the online softmax of Milakov & Gimelshein 2018), then once more to write the gradient in
the logits' dtype, in fp32 arithmetic throughout. Liger-Kernel's fused linear cross-entropy
(Hsu et al. 2024, §3.3) computes the logits' gradient inside the loss's forward the same way.

Registered as a torch custom op (`fivefold::cross_entropy_rows_`), so a trace
(fivefold.trace) sees one kernel that reads and rewrites the chunk. Elsewhere (a CPU, a GPU
without Triton, `TRITON_INTERPRET` aside) it runs `_rows_loss` on an fp32 copy: the chunked
loss's own arithmetic, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fivefold.numerics.kernel_support import triton_usable

try:  # Triton is optional: the GPU machine's 3.6 and the registry's 3.9 both have what is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


if triton is not None:

    @triton.jit
    def _cross_entropy_rows_kernel(logits_ptr, stride, targets_ptr, loss_ptr, vocab, vocab_start,
                                   num_valid, WITH_GRADS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        target = tl.load(targets_ptr + row)
        local = target - vocab_start
        mine = (local >= 0) & (local < num_valid)
        keep = target != -100
        cols = tl.arange(0, BLOCK)
        # pass 1: the running max m and sum of exp(x - m) over the row's valid columns
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for off in range(0, vocab, BLOCK):
            idx = off + cols
            x = tl.load(base + idx, mask=idx < num_valid, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # a lane that has seen only -inf keeps s = 0 (exp(-inf - -inf) would be nan)
            scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            s = s * scale + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
            m = m_new
        row_max = tl.max(m, axis=0)
        s = tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max))
        sum_exp = tl.sum(s, axis=0)
        safe = tl.where(mine, local, 0)
        x_target = tl.load(base + safe).to(tl.float32) - row_max
        x_target = tl.where(mine, x_target, 0.0)
        loss = tl.where(keep, tl.log(sum_exp) - x_target, 0.0)
        tl.store(loss_ptr + row, loss)
        if WITH_GRADS:
            # pass 2: softmax − one-hot, for kept tokens; padding columns get exp(-inf) = 0
            factor = tl.where(keep, 1.0 / sum_exp, 0.0)
            for off in range(0, vocab, BLOCK):
                idx = off + cols
                x = tl.load(base + idx, mask=idx < vocab, other=0.0).to(tl.float32)
                p = tl.where(idx < num_valid, tl.exp(x - row_max), 0.0) * factor
                p = p - tl.where((idx == local) & mine & keep, 1.0, 0.0)
                tl.store(base + idx, p.to(logits_ptr.dtype.element_ty), mask=idx < vocab)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _rows_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, num_valid: int,
               reduce_max: Callable, reduce_sum: Callable, with_grads: bool):
    """Per-token losses of fp32 logits rows (overwritten), and with `with_grads` the logits'
    gradient softmax − one-hot(target) for kept tokens (in the same storage)."""
    if num_valid < logits.shape[-1]:  # padding rows of a split head are not words
        logits[:, num_valid:] = float("-inf")
    row_max = reduce_max(logits.max(dim=-1).values)
    logits -= row_max.unsqueeze(-1)
    local = targets - vocab_start
    mine = (local >= 0) & (local < num_valid)
    local = torch.where(mine, local, torch.zeros_like(local))
    target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
    exp = logits.exp_()
    sum_exp, target_logit = reduce_sum(torch.stack((exp.sum(dim=-1), target_logit)))
    keep = targets != -100
    token_loss = (sum_exp.log() - target_logit) * keep
    if not with_grads:
        return token_loss, None
    exp.mul_((keep / sum_exp).unsqueeze(-1))
    exp.scatter_add_(-1, local.unsqueeze(-1), -(mine & keep).unsqueeze(-1).float())
    return token_loss, exp


def _launch(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, num_valid: int,
            with_grads: bool, block: int | None = None) -> torch.Tensor:
    """Run the kernel; `block`: columns per step of a row's loops (tests use small ones)."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss
    block = block or min(4096, triton.next_power_of_2(vocab))
    _cross_entropy_rows_kernel[(rows,)](logits, logits.stride(0), targets, loss, vocab,
                                        vocab_start, num_valid, WITH_GRADS=with_grads,
                                        BLOCK=block)
    return loss


def _reference(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, num_valid: int,
               with_grads: bool) -> torch.Tensor:
    wide = logits.float() if logits.dtype != torch.float32 else logits
    token_loss, grads = _rows_loss(wide, targets, vocab_start, num_valid, _identity, _identity,
                                   with_grads)
    if grads is not None and grads is not logits:
        logits.copy_(grads)
    return token_loss


@torch.library.custom_op("fivefold::cross_entropy_rows_", mutates_args=("logits",))
def cross_entropy_rows_(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                        num_valid: int, with_grads: bool) -> torch.Tensor:
    """Per-token fp32 losses of a chunk of logits; with `with_grads` the logits' gradient
    is written over them (see the module's docstring)."""
    if triton_usable(logits.device) and logits.stride(-1) == 1:
        return _launch(logits, targets.contiguous(), vocab_start, num_valid, with_grads)
    return _reference(logits, targets, vocab_start, num_valid, with_grads)


@cross_entropy_rows_.register_fake
def _(logits, targets, vocab_start, num_valid, with_grads):
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)
