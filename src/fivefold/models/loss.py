"""The output head and cross-entropy together, in chunks of tokens: full logits never exist.

The plain way (logits = h·Wᵀ, then cross-entropy) holds batch × sequence × vocabulary logits
in fp32, their log-softmax for backward and, in backward, a gradient of the same size: at a
128k vocabulary that is the largest activation of a small model. Here the head runs on a
chunk of token rows at a time (`LOGITS_CHUNK_ELEMENTS` logits), and each chunk's gradients
are finished while its logits exist: softmax − one-hot gives the logits' gradient, which is
multiplied out at once into the gradient of the head's input (rows × h) and added into the
weight's gradient (accumulated in fp32). Backward then only scales the two by the loss's
incoming gradient. No matmul is repeated; what stays saved for backward is the input's and
the weight's gradient (T·h and V·h in the compute dtype) instead of T·V fp32 logits.
The same idea as Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, §3.3) and
Wijmans et al. 2024 ("Cut your losses"), written here in plain PyTorch ops.

The model stays plain: under tensor parallelism each rank holds a slice of the vocabulary,
and the per-token maximum and sums are completed by `reduce_max` / `reduce_sum`, which the
tensor-parallel loss (parallel/tensor.py) passes in as all-reduces over the tp group. Per
chunk they carry rows, 2·rows floats: over all chunks the same bytes as one all-reduce of
the whole batch's per-token scalars (Megatron-LM's vocab-parallel cross-entropy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Logits per chunk: 2^24 fp32 values = 64 MiB (the exponentials overwrite them in place; in
# bf16 a compute-dtype cast beside them). Rows per chunk = this / local vocabulary: 512 at a
# 32k vocabulary, 130 at Llama 3's 128k. Smaller chunks cost time on a CPU, where the fp32
# weight gradient is read and rewritten once per chunk and short matmuls run below peak:
# 128-row chunks made the 25M benchmark model's head and loss 6% slower than 512-row ones.
LOGITS_CHUNK_ELEMENTS = 1 << 24


# Called as (point, tensors) where the loss holds large tensors it does not save (a chunk's
# logits, the gradients being formed), so that a memory tracker (parallel/peak.py) can count
# them; None costs nothing.
_transient_observer: Callable[[str, list[torch.Tensor]], None] | None = None


def observe_transients(observer: Callable[[str, list[torch.Tensor]], None] | None) -> None:
    global _transient_observer
    _transient_observer = observer


def _observe(point: str, tensors: list[torch.Tensor]) -> None:
    if _transient_observer is not None:
        _transient_observer(point, tensors)


def chunk_rows(num_tokens: int, vocab_local: int) -> int:
    return max(1, min(num_tokens, LOGITS_CHUNK_ELEMENTS // max(vocab_local, 1)))


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


# Rows per block of `_add_wider_`: 2^20 fp32 values (4 MiB) of cast operand at a time.
_ADD_BLOCK_ELEMENTS = 1 << 20


def _add_wider_(out: torch.Tensor, part: torch.Tensor) -> None:
    """out += part for a `part` in a narrower dtype, a block of rows at a time: the add casts
    its operand to out's dtype first, and a whole V·h cast would be one more buffer of the
    weight gradient's size (newly mapped, so page faults on every write).

    On a GPU the caching allocator reuses that buffer, and the blocks would be launches: at
    Llama 3's 128k vocabulary and h 4096, 501 adds per chunk and 63 chunks: on an H100 their
    31,563 launches took 207 of an 8B-shaped step's 389 ms of GPU time and kept the host busy
    for most of its 550-690 ms (bench/gpu_profile.py). One add there: the same elementwise
    sums, bit for bit."""
    if out.device.type != "cpu":
        out += part
        return
    step = max(1, _ADD_BLOCK_ELEMENTS // max(out[0].numel(), 1))
    for i in range(0, out.shape[0], step):
        out[i:i + step] += part[i:i + step]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start: int, num_valid: int,
                reduce_max: Callable, reduce_sum: Callable, with_grads: bool):
        x = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        token_loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        if with_grads:
            grad_x = torch.empty_like(x)
            grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        rows = chunk_rows(x.shape[0], weight.shape[0])
        # Buffers made once and reused by every chunk: a fresh one per chunk would be a new
        # mapping of tens of MB each time (glibc maps buffers that large on their own), whose
        # first writes cost more page faults than the work done in them. Nothing is held that
        # the unbuffered loop did not hold at its largest: the chunk's fp32 logits (`wide`)
        # and, in a narrower compute dtype, their cast (`narrow`, which first receives the
        # matmul's logits), and once the logits are cast, the chunk's share of the weight's
        # gradient in the compute dtype, written into the free fp32 buffer where it fits.
        shape = (min(rows, x.shape[0]), weight.shape[0])
        wide = torch.empty(shape, dtype=torch.float32, device=x.device)
        mixed = weight.dtype != torch.float32
        narrow = torch.empty(shape, dtype=weight.dtype, device=x.device) if mixed else None
        spare = wide.view(-1).view(weight.dtype) if mixed else None
        if spare is not None and spare.numel() >= weight.numel():
            spare = spare[:weight.numel()].view(weight.shape)
        else:
            spare = None
        for start in range(0, x.shape[0], rows):
            xc, tc = x[start:start + rows], t[start:start + rows]
            n = xc.shape[0]
            if mixed:
                torch.mm(xc, weight.t(), out=narrow[:n])
                wide[:n].copy_(narrow[:n])
            else:
                torch.mm(xc, weight.t(), out=wide[:n])
            token_loss[start:start + rows], grad_logits = _rows_loss(
                wide[:n], tc, vocab_start, num_valid, reduce_max, reduce_sum, with_grads)
            if not with_grads:
                continue
            if mixed:
                cast = narrow[:n]
                cast.copy_(grad_logits)
            else:
                cast = grad_logits
            _observe("loss chunk", [grad_logits, cast, grad_x, grad_w])
            grad_logits = cast  # the fp32 logits' buffer is free again here
            torch.mm(grad_logits, weight, out=grad_x[start:start + rows])
            # The first chunk writes the weight's gradient, the others add to it: no pass to
            # zero V·h fp32 values first.
            if not mixed and start == 0:
                torch.mm(grad_logits.t(), xc, out=grad_w)
            elif not mixed:
                grad_w.addmm_(grad_logits.t(), xc)
            else:
                part = (grad_logits.t() @ xc if spare is None
                        else torch.mm(grad_logits.t(), xc, out=spare))
                if start == 0:
                    grad_w.copy_(part)
                else:
                    _add_wider_(grad_w, part)
                del part
        # One sum over all tokens, in the same order as an unchunked loss would take it.
        loss = token_loss.sum()
        if with_grads:
            ctx.save_for_backward(grad_x.view_as(hidden), grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        grad_x, grad_w = grad_x * grad_loss, grad_w * grad_loss
        _observe("loss backward", [grad_x, grad_w])
        return grad_x, grad_w, None, None, None, None, None, None


class _CrossEntropyFromLogits(torch.autograd.Function):
    """The same per-row arithmetic on materialised logits (saving their gradient)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start: int, num_valid: int, reduce_max: Callable,
                reduce_sum: Callable):
        flat = logits.reshape(-1, logits.shape[-1]).float().clone()
        token_loss, grad_logits = _rows_loss(flat, targets.reshape(-1), vocab_start, num_valid,
                                             reduce_max, reduce_sum, logits.requires_grad)
        if grad_logits is not None:
            ctx.save_for_backward(grad_logits.view_as(logits))
        ctx.dtype = logits.dtype
        return token_loss.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_logits,) = ctx.saved_tensors
        grad = grad_logits * grad_loss
        cast = grad.to(ctx.dtype)
        _observe("loss backward", [grad, cast])
        return cast, None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor, vocab_start: int = 0,
                                 num_valid: int | None = None,
                                 reduce_max: Callable = _identity,
                                 reduce_sum: Callable = _identity) -> torch.Tensor:
    """Σ over target tokens of cross-entropy(hidden·weightᵀ, target), in fp32; targets of -100
    are ignored. `weight` holds vocabulary rows [vocab_start, vocab_start + num_valid) (all
    of them on one device); rows past num_valid are padding."""
    num_valid = weight.shape[0] if num_valid is None else num_valid
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, vocab_start, num_valid,
                                            reduce_max, reduce_sum, with_grads)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0,
                      num_valid: int | None = None, reduce_max: Callable = _identity,
                      reduce_sum: Callable = _identity) -> torch.Tensor:
    """The same loss from materialised logits: the pipeline's split backward needs the
    logits' gradient, and a materialised loss is the reference the chunked one is tested
    against."""
    num_valid = logits.shape[-1] if num_valid is None else num_valid
    return _CrossEntropyFromLogits.apply(logits, targets, vocab_start, num_valid, reduce_max,
                                         reduce_sum)
