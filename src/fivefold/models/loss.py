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

from fivefold.models import loss_chunks
from fivefold.models.loss_kernel import _identity, _rows_loss, cross_entropy_rows_

# Logits per chunk on a CPU: 2^24 fp32 values = 64 MiB (the exponentials overwrite them in
# place; in bf16 a compute-dtype cast beside them). Rows per chunk = this / local vocabulary:
# 512 at a 32k vocabulary, 130 at Llama 3's 128k. Smaller chunks cost time on a CPU, where the
# fp32 weight gradient is read and rewritten once per chunk and short matmuls run below peak:
# 128-row chunks made the 25M benchmark model's head and loss 6% slower than 512-row ones.
# On a GPU the chunk follows the device's memory (models/loss_chunks.py, shared with the
# planner).
LOGITS_CHUNK_ELEMENTS = loss_chunks.LOGITS_CHUNK_ELEMENTS

# The fused path on a GPU (one kernel per chunk for the loss and the logits' gradient, chunks
# sized by memory). False gives the chunked path everywhere, as before it existed: the GPU
# benchmark's "before" (bench/gpu_step.py).
FUSED_ON_DEVICE = True

# The memory the meta device stands for (a trace of a GPU's step, fivefold.trace, sets its
# GPU's); a CUDA device reports its own.
META_DEVICE_MEMORY = 80 * 2**30


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
    """A CPU's rows per chunk (and the chunked path's on any device)."""
    return max(1, min(num_tokens, LOGITS_CHUNK_ELEMENTS // max(vocab_local, 1)))


def device_memory(device: torch.device) -> float:
    """The bytes a GPU chunk is sized by (models/loss_chunks.py); 0 on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "meta":
        return float(META_DEVICE_MEMORY)
    return 0.0


def fused_path(device: torch.device, reduce_max: Callable, reduce_sum: Callable) -> bool:
    """Whether the loss takes the fused path: on a GPU (not a CPU), with the whole vocabulary
    on this rank (a vocabulary-parallel loss completes each row's max and sum across ranks
    between the two passes the kernel makes in one)."""
    return (FUSED_ON_DEVICE and device.type != "cpu" and reduce_max is _identity
            and reduce_sum is _identity)


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


def _fused(x, t, weight, vocab_start: int, num_valid: int, with_grads: bool):
    """The GPU path: chunks as large as the device's memory allows (one at 8192 tokens and a
    128k vocabulary on an 80 GiB card), each chunk's logits made by one GEMM in the compute
    dtype, turned into their gradient in place by one kernel (models/loss_kernel.py), then
    multiplied out into the input's and the weight's gradients. With one chunk the weight's
    gradient is one GEMM in the compute dtype (fp32 accumulation inside it); with several,
    the chunks' parts add into fp32 and round once at the end, as on the CPU.

    W is read twice a chunk and its gradient written once: a fixed number of passes over the
    head's largest tensors, not one per 64 MiB of logits."""
    rows = loss_chunks.chunk_rows(x.shape[0], weight.shape[0], device_memory(x.device),
                                  weight.element_size())
    chunks = -(-x.shape[0] // rows)
    logits = torch.empty((min(rows, x.shape[0]), weight.shape[0]), dtype=weight.dtype,
                         device=x.device)
    losses, grad_x, grad_w = [], None, None
    if with_grads:
        grad_x = torch.empty_like(x)
    for start in range(0, x.shape[0], rows):
        xc, tc = x[start:start + rows], t[start:start + rows]
        chunk = logits[:xc.shape[0]]
        torch.mm(xc, weight.t(), out=chunk)
        losses.append(cross_entropy_rows_(chunk, tc, vocab_start, num_valid, with_grads))
        if not with_grads:
            continue
        _observe("loss chunk", [chunk, grad_x])
        torch.mm(chunk, weight, out=grad_x[start:start + rows])
        if grad_w is None:  # the first chunk writes it: no pass to zero V·h values first
            grad_w = torch.mm(chunk.t(), xc)
            if chunks > 1:
                grad_w = grad_w.float()
        elif weight.dtype == torch.float32:
            grad_w.addmm_(chunk.t(), xc)  # accumulated inside the GEMM (beta = 1)
        else:
            grad_w += torch.mm(chunk.t(), xc)
    token_loss = losses[0] if len(losses) == 1 else torch.cat(losses)
    if grad_w is not None and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    # One sum over all tokens, in the same order as an unchunked loss would take it.
    return token_loss.sum(), grad_x, grad_w


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start: int, num_valid: int,
                reduce_max: Callable, reduce_sum: Callable, with_grads: bool):
        x = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        if fused_path(x.device, reduce_max, reduce_sum):
            loss, grad_x, grad_w = _fused(x, t, weight, vocab_start, num_valid, with_grads)
            if with_grads:
                ctx.save_for_backward(grad_x.view_as(hidden), grad_w)
            return loss
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
