"""The communication of tensor and sequence parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, section 3, figure 3) brackets each parallel region with
two conjugate operators: `f` (identity forward, all-reduce backward) where a replicated
activation enters a column-parallel layer, and `g` (all-reduce forward, identity backward)
where a row-parallel layer's partial sums leave. Sequence parallelism (Korthikanti et al.
2022, section 4.2.2, figure 5) keeps the activations between regions split along the
sequence and replaces `f` by an all-gather (backward: reduce-scatter) and `g` by a
reduce-scatter (backward: all-gather), moving the same bytes as the all-reduce they
replace (an all-reduce is a reduce-scatter followed by an all-gather).

Every collective goes through `fivefold.parallel.comm`, so the ledger sees all of them.
Activations are (batch, seq, hidden); sequence collectives work seq-major, because a flat
all-gather or reduce-scatter splits the outermost dimension (free when batch is 1).

Overlap. The region entry (`enter_region`) and the column-parallel linears that read its
output share a `Region`. Each column linear adds its input gradient into the region; the
last one to arrive starts the region's all-reduce (or reduce-scatter) asynchronously and
only then computes its own weight gradient, so that GEMM runs while the bytes travel; the
region entry's backward waits. This is Megatron's asynchronous input-gradient all-reduce
(`LinearWithGradAccumulationAndAsyncCommunication`), kept at one collective per region
even though the plain model has separate q, k, v (and gate, up) projections.

Saved input under SP (`parallel.sp_saved_input`). A column linear needs its input for the
weight gradient. "full" keeps the all-gathered, full-sequence input (T·h per region);
"shard" keeps only this rank's sequence shard (T·h/tp) and all-gathers it again in backward,
started before the input-gradient GEMM so the two overlap (Korthikanti et al. 2022 §4.2.2;
Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication` with sequence parallelism).
The consumers of one region share the one shard and the one backward all-gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.parallel import comm
from fivefold.parallel.comm import Group


def gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s/tp, ...) on each rank -> (b, s, ...) in tp-rank order, contiguous."""
    xs = x.transpose(0, 1).contiguous()
    out = torch.empty((group.size * xs.shape[0], *xs.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, xs, group)
    return out.transpose(0, 1).contiguous()


def _scatter_seq_start(x: torch.Tensor, group: Group, async_op: bool = False):
    """Start the reduce-scatter of (b, s, ...) to this rank's (b, s/tp, ...) sum."""
    s = x.shape[1]
    if s % group.size:
        raise ValueError(f"sequence length {s} is not divisible by tp = {group.size}; "
                         f"sequence parallelism needs it (change train.seq_len)")
    xs = x.transpose(0, 1).contiguous()
    out = torch.empty((s // group.size, *xs.shape[1:]), dtype=x.dtype, device=x.device)
    handle = comm.reduce_scatter(out, xs, group, async_op=async_op)
    return out, handle


def reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    out, _ = _scatter_seq_start(x, group)
    return out.transpose(0, 1)


def split_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of the sequence (no communication)."""
    return x.chunk(group.size, dim=1)[group.rank]


class Region:
    """One entry into a tensor-parallel region, shared by its column-parallel consumers."""

    def __init__(self, group: Group, sp: bool, save_shard: bool = False):
        self.group, self.sp = group, sp
        self.save_shard = sp and save_shard  # keep the sequence shard, gather it in backward
        self.full: torch.Tensor | None = None  # the input gathered again in backward
        self.full_handle = None
        self.full_users = 0
        self.consumers = 0  # column linears that read this entry (counted in forward)
        self.arrived = 0  # ... whose input gradient has arrived (counted in backward)
        self.grad: torch.Tensor | None = None
        self.handle = None

    def add_grad(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad.add_(grad)
        self.arrived += 1
        if self.arrived == self.consumers:
            self.start_reduce()

    def start_reduce(self) -> None:
        if self.sp:
            self.grad, self.handle = _scatter_seq_start(self.grad, self.group, async_op=True)
        else:
            self.handle = comm.all_reduce(self.grad, self.group, async_op=True)

    def start_gather(self, shard: torch.Tensor) -> None:
        """Start the backward all-gather of the saved shard (once for all consumers)."""
        if self.full is None:
            xs = shard.transpose(0, 1).contiguous()
            self.full = torch.empty((self.group.size * xs.shape[0], *xs.shape[1:]),
                                    dtype=xs.dtype, device=xs.device)
            self.full_handle = comm.all_gather(self.full, xs, self.group, async_op=True)

    def gathered(self) -> torch.Tensor:
        """The full-sequence input (b, s, ...), waiting for the all-gather if needed."""
        if self.full_handle is not None:
            self.full_handle.wait()
            self.full_handle = None
            self.full = self.full.transpose(0, 1).contiguous()
        return self.full

    def release_gathered(self) -> None:
        """A consumer is done with the gathered input; the last one frees it."""
        self.full_users += 1
        if self.full_users >= self.consumers:
            self.full, self.full_handle, self.full_users = None, None, 0

    def finish(self, extra: torch.Tensor | None) -> torch.Tensor | None:
        """The reduced input gradient: the consumers' sum, plus `extra` from any other reader."""
        if self.grad is not None and self.handle is None:
            self.start_reduce()  # some consumer never ran backward (its output was unused)
        if self.handle is not None:
            self.handle.wait()
        out = self.grad
        if out is not None and self.sp:
            out = out.transpose(0, 1)
        if extra is not None:  # a reader that is not a column linear: reduce it on its own
            extra = reduce_scatter_seq(extra, self.group) if self.sp else _all_reduced(
                extra, self.group)
            out = extra if out is None else out + extra
        self.arrived, self.grad, self.handle = 0, None, None  # ready for another backward
        return out


def _all_reduced(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, group)
    return x


class _EnterRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward; with SP, all-gather / reduce-scatter."""

    @staticmethod
    def forward(ctx, x, region: Region):
        ctx.set_materialize_grads(False)
        ctx.region = region
        return gather_seq(x, region.group) if region.sp else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.region.finish(grad), None


def enter_region(x: torch.Tensor, group: Group, sp: bool,
                 save_shard: bool = False) -> torch.Tensor:
    """Enter a column-parallel region; the returned tensor carries its `Region` (and, when
    the consumers save the sequence shard, the shard itself, only as long as it lives)."""
    region = Region(group, sp, save_shard)
    out = _EnterRegion.apply(x, region)
    out._tp_region = region
    if region.save_shard:
        out._tp_shard = x
    return out


class _ColumnLinear(torch.autograd.Function):
    """y = x W^T + b on a region's input, with the overlapped input-gradient reduction."""

    @staticmethod
    def forward(ctx, x, weight, bias, region: Region, shard):
        # Under SP with save_shard, only this rank's sequence shard is kept (`shard`, the
        # region entry's input; its gradient flows through the entry, not from here).
        ctx.save_for_backward(shard if region.save_shard else x, weight)
        ctx.region, ctx.has_bias = region, bias is not None
        region.consumers += 1
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        region = ctx.region
        if region.save_shard:  # gather the input again while the input gradient is computed
            region.start_gather(x)
        if ctx.needs_input_grad[0]:
            region.add_grad(grad.matmul(weight))  # may start the async reduction
        if region.save_shard:
            x = region.gathered()
        # The weight gradient is computed while the region's reduction is in flight.
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(x.reshape(-1, x.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        if region.save_shard:
            region.release_gathered()
        return None, grad_weight, grad_bias, None, None


def column_linear(x: torch.Tensor, weight, bias, group: Group, sp: bool,
                  save_shard: bool = False) -> torch.Tensor:
    region = getattr(x, "_tp_region", None)
    if region is None:  # used outside a prepared region: enter one just for this layer
        x = enter_region(x, group, sp, save_shard)
        region = x._tp_region
    shard = getattr(x, "_tp_shard", None) if region.save_shard else None
    return _ColumnLinear.apply(x, weight, bias, region, shard)


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward; with SP, reduce-scatter / all-gather."""

    @staticmethod
    def forward(ctx, x, group: Group, sp: bool):
        ctx.group, ctx.sp = group, sp
        return reduce_scatter_seq(x, group) if sp else _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (gather_seq(grad, ctx.group) if ctx.sp else grad), None, None


def leave_region(x: torch.Tensor, group: Group, sp: bool) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group, sp)


def sum_grad_over_tp(grad: torch.Tensor, group: Group) -> torch.Tensor:
    """Complete a gradient that each tp rank holds only a partial sum of."""
    return _all_reduced(grad, group)


def sum_grad_over_replicas(grad: torch.Tensor, group: Group, slot: int, slots: int,
                           dim: int) -> torch.Tensor:
    """Sum the gradient of a piece held by several tp ranks (kv heads when kv < tp).

    Each rank places its partial gradient at its piece's slot of a zero buffer the size of
    the whole logical tensor and all-reduces over tp; ranks holding the same piece add into
    the same slot. This uses the tp group itself (no sub-groups to create), at the cost of
    moving the whole tensor: slots × the bytes an all-reduce over the sharing ranks would.
    """
    shape = list(grad.shape)
    shape[dim] *= slots
    buf = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
    size = grad.shape[dim]
    buf.narrow(dim, slot * size, size).copy_(grad)
    comm.all_reduce(buf, group)
    # clone, not contiguous(): a dim-0 slice is already contiguous, and returning the view
    # would keep the whole logical-size buffer alive as this parameter's gradient.
    return buf.narrow(dim, slot * size, size).clone()
