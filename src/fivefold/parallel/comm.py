"""The one door for communication, and its ledger.

Every collective and point-to-point call in fivefold goes through this module. Each call
can be recorded in the topology's `Ledger` as (op, group, dtype, elements, bytes), where
bytes is the *logical* size of the message, the convention the planner shares:

    all_reduce      the tensor's bytes
    reduce_scatter  the full (unsharded) input's bytes
    all_gather      the full (gathered) output's bytes
    send / recv     the message's bytes, on the sender / on the receiver
    all_to_all      the input's bytes
    broadcast       the tensor's bytes

A group of one rank moves nothing: calls on it return at once and record nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class LedgerEntry:
    op: str
    group: str
    dtype: str
    elements: int
    bytes: int


@dataclass
class Ledger:
    """Communication recorded on this rank, per step (reset at the start of each step)."""

    enabled: bool = False
    entries: list[LedgerEntry] = field(default_factory=list)

    def record(self, op: str, group: Group, tensor: torch.Tensor) -> None:
        if self.enabled:
            n = tensor.numel()
            self.entries.append(LedgerEntry(op, group.name, str(tensor.dtype).replace(
                "torch.", ""), n, n * tensor.element_size()))

    def reset(self) -> None:
        self.entries.clear()

    def totals(self) -> dict[tuple[str, str], dict[str, int]]:
        """{(group, op): {"calls": n, "elements": e, "bytes": b}}."""
        out: dict[tuple[str, str], dict[str, int]] = defaultdict(
            lambda: {"calls": 0, "elements": 0, "bytes": 0})
        for e in self.entries:
            t = out[(e.group, e.op)]
            t["calls"] += 1
            t["elements"] += e.elements
            t["bytes"] += e.bytes
        return dict(out)

    def bytes_by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for e in self.entries:
            out[e.group] += e.bytes
        return dict(out)

    def summary(self) -> str:
        """One line per (group, op), for the per-step log."""
        rows = [f"{g:>6} {op:<15} calls={t['calls']:<5} MB={t['bytes'] / 1e6:.3f}"
                for (g, op), t in sorted(self.totals().items())]
        return "\n".join(rows) if rows else "(no communication)"


@dataclass
class Group:
    """A process group with its name, its members (global ranks) and this rank's place."""

    name: str
    ranks: list[int]
    pg: object | None  # torch ProcessGroup; None when the group has one member
    ledger: Ledger

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank()) if self.size > 1 else 0

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


class _Done:
    """The handle of a call that needed no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


# torch 2.13 renames the flat collectives (the old names warn); 2.11 has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _op(op: str):
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "avg": dist.ReduceOp.AVG}[op]


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    if group.size == 1:
        return DONE
    group.ledger.record("all_reduce", group, tensor)
    return dist.all_reduce(tensor, op=_op(op), group=group.pg, async_op=async_op) or DONE


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group, op: str = "sum",
                   async_op: bool = False):
    """output (n/size elements) gets this rank's slice of the reduction of input (n)."""
    if group.size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return DONE
    group.ledger.record("reduce_scatter", group, input)
    return _reduce_scatter_flat(output, input, op=_op(op), group=group.pg,
                                async_op=async_op) or DONE


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False):
    """output (flat, size × input) gets every rank's input, in group-rank order."""
    if group.size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return DONE
    group.ledger.record("all_gather", group, output)
    return _all_gather_flat(output, input, group=group.pg, async_op=async_op) or DONE


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: Group, async_op: bool = False):
    if group.size == 1:
        return DONE
    group.ledger.record("broadcast", group, tensor)
    return dist.broadcast(tensor, src=group.global_rank(src_group_rank), group=group.pg,
                          async_op=async_op) or DONE


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group,
               output_splits: list[int] | None = None, input_splits: list[int] | None = None,
               async_op: bool = False):
    if group.size == 1:
        output.copy_(input)
        return DONE
    group.ledger.record("all_to_all", group, input)
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group.pg,
                                  async_op=async_op) or DONE


@dataclass
class P2P:
    """One point-to-point operation: kind 'send' or 'recv', with a peer's group rank."""

    kind: str
    tensor: torch.Tensor
    peer: int


def batch_p2p(ops: list[P2P], group: Group) -> list:
    """Post sends and receives together (torch batched isend/irecv); returns their handles."""
    if not ops:
        return []
    p2p_ops = []
    for op in ops:
        group.ledger.record(op.kind, group, op.tensor)
        fn = dist.isend if op.kind == "send" else dist.irecv
        # A send may be a view (a sequence-parallel output is a transposed one when b > 1);
        # the backends take dense tensors only. A receive buffer is always dense.
        tensor = op.tensor.contiguous() if op.kind == "send" else op.tensor
        p2p_ops.append(dist.P2POp(fn, tensor, group.global_rank(op.peer), group=group.pg))
    return dist.batch_isend_irecv(p2p_ops)


def barrier(group: Group) -> None:
    if group.size > 1:
        dist.barrier(group=group.pg)
