"""ZeRO-3's parameter side: each rank keeps 1/N of every block; blocks are gathered on use.

The units are the transformer blocks, and "the rest" of a model chunk (embedding, final
norm, output head: one unit, since tied embeddings use one weight at both ends). Unit i is
segment i of the flat layout; this rank keeps its owned range of every segment in one flat
parameter shard (Rajbhandari et al. 2020, "ZeRO", §5.3: P_os+g+p).

    forward   before a unit runs: wait for (or start) its all-gather; start the next
              unit's gather (prefetch); after it ran: free the gathered copy
    backward  when the gradient of a unit's output arrives (a hook on that output, which
              fires just before the unit's own backward): gather it again, prefetch the
              unit before it; when the unit's last parameter gradient has accumulated:
              free it, and (on the final micro-batch) its gradient bucket is
              reduce-scattered by `data.GradReducer`

A parameter stays the same `nn.Parameter` throughout: its data is a view of its unit's
gathered buffer, whose storage is freed with `untyped_storage().resize_(0)` and
re-allocated before the next gather, as FSDP (Zhao et al. 2023, §3.2) does. Views, and
the tensors autograd saved for backward, keep pointing at the same storage.

The rest unit is gathered for the whole forward (the embedding opens it, the head closes
it) and, in backward, from the head's backward to the embedding's. So every unit is
gathered twice per micro-batch: two all-gathers of all parameters per micro-batch.

Under pipeline parallelism each chunk has its own units, and prefetching stays inside a
chunk (the next action may belong to another chunk and free what was fetched). A split
backward (ZB-H1, DualPipeV) gathers again for its W pass if the unit was freed since B
(`ensure_params`). DualPipeV with tied embeddings puts the head on the embedding's rank in
another chunk: the head's rest unit *borrows* the embedding's unit, gathering it for its
own forward and backward too (2 more all-gathers of the embedding per micro-batch, which
the planner counts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fivefold.parallel import comm, peak
from fivefold.parallel.buffers import FlatLayout
from fivefold.parallel.zero3_fp8 import FP8UnitGather, gathered_params, refresh_scales

FREE, GATHERING, READY = "free", "gathering", "ready"


class Unit(NamedTuple):
    module: nn.Module  # a block, or the chunk itself for its rest
    kind: str  # "block" | "rest"
    chunk: int  # index of the pipeline chunk it belongs to (0 without pipelining)
    borrowed: list[int]  # earlier units whose weights it also uses (a tied head)


def zero3_units(chunks: list[nn.Module], named_params) -> tuple[list[list[int]], list[Unit]]:
    """Parameter-index groups (one per unit, forward order) and the units. A rest unit's
    `borrowed` lists the earlier units whose weights it also uses (the head of DualPipeV's
    V uses the embedding of the first chunk on the same rank, tied)."""
    index = {id(p): i for i, (_, p) in enumerate(named_params)}
    groups, units = [], []
    for c, chunk in enumerate(chunks):
        layers = getattr(chunk, "layers", [])  # a ModuleList, or a pipeline stage's ModuleDict
        blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        mine = [index[id(p)] for p in chunk.parameters()
                if id(p) not in in_blocks and id(p) in index]
        owner = {i: g for g, group in enumerate(groups) for i in group}
        rest = [i for i in dict.fromkeys(mine) if i not in owner]  # a shared weight once
        borrowed = sorted({owner[i] for i in mine if i in owner})
        if borrowed and not rest:
            raise ValueError("ZeRO-3: a pipeline chunk holding only a weight shared with "
                             "another chunk is not supported")
        if rest:
            groups.append(rest)
            units.append(Unit(chunk, "rest", c, borrowed))
        for block in blocks:  # the block's parameters this optimizer holds (dense or experts)
            members = [index[id(p)] for p in block.parameters() if id(p) in index]
            if members:
                groups.append(members)
                units.append(Unit(block, "block", c, []))
    return groups, units


def fp8_units(layout: FlatLayout, units: list, rank: int, device: torch.device,
              dtype: torch.dtype) -> dict:
    """Unit index -> its FP8 gather, for units holding weights of modules marked
    `fp8_gather` (parallel.fp8_allgather: tensorwise FP8 linears and routed experts)."""
    slot_of = {id(slot.param): slot for slot in layout.params}
    out = {}
    for u, unit in enumerate(units):
        weights = [(slot_of[id(p)], m, name) for m in unit.module.modules()
                   if getattr(m, "fp8_gather", False)
                   for name, p, _ in gathered_params(m)
                   if id(p) in slot_of and slot_of[id(p)].segment == u]
        if weights:
            out[u] = FP8UnitGather(layout, layout.segments[u], weights, rank, device, dtype)
    return out


class ParamGatherer:
    def __init__(self, layout: FlatLayout, units: list, group: comm.Group, dtype: torch.dtype,
                 device: torch.device, watchdog):
        self.layout, self.units, self.group, self.watchdog = layout, units, group, watchdog
        self.rank = group.rank
        self.shard = torch.empty(layout.total // layout.shards, dtype=dtype, device=device)
        self.full: list[torch.Tensor] = []
        self.state = [FREE] * len(units)
        self.handles: dict[int, object] = {}
        self.fp8: dict = {}
        with torch.no_grad():
            for seg in layout.segments:
                full = torch.zeros(seg.size, dtype=dtype, device=device)
                for i in seg.params:
                    slot = layout.params[i]
                    view = full[slot.start - seg.start:slot.start - seg.start + slot.numel]
                    view.copy_(slot.param.detach().reshape(-1))
                    slot.param.data = view.view(slot.shape)
                lo, hi = seg.owned(self.rank, layout.shards)
                layout.segment_shard(self.shard, seg).copy_(full[lo - seg.start:hi - seg.start])
                self.full.append(full)
                self.state[seg.index] = READY
                self.free(seg.index)
        self.unit_of = {id(slot.param): slot.segment for slot in layout.params}
        self.fp8 = fp8_units(layout, units, self.rank, device, dtype)  # parallel.fp8_allgather
        self.fp8_stale = True  # their scales wait for the weights' next amax all-reduce
        self.backward_next = [self._backward_next(u) for u in range(len(units))]  # prefetch
        self._hooks = []
        for u, unit in enumerate(units):
            self._hooks.append(unit.module.register_forward_pre_hook(self._pre_forward(u)))
            self._hooks.append(unit.module.register_forward_hook(self._post_forward(u)))

    # --- gather and free ------------------------------------------------------------------
    def gather(self, u: int) -> None:
        """Start unit u's all-gather (asynchronously) unless it is gathered or on its way."""
        if self.state[u] != FREE:
            return
        seg, full = self.layout.segments[u], self.full[u]
        full.untyped_storage().resize_(seg.size * full.element_size())
        if u in self.fp8:  # FP8-linear weights gather in FP8 (zero3_fp8.py)
            if self.fp8_stale:  # all units' scales, in one all-reduce of amaxes
                refresh_scales(self.fp8, self.shard, self.group, self.watchdog)
                self.fp8_stale = False
            self.handles[u] = self.fp8[u].start(full, self.shard, self.group)
        else:
            self.handles[u] = comm.all_gather(full, self.layout.segment_shard(self.shard, seg),
                                              self.group, async_op=True)
        self.state[u] = GATHERING
        peak.sample("unit gathered")

    def weights_changed(self) -> None:
        """The shard was written (an optimizer step, a load) or a step begins: the FP8
        gather's scales are recomputed at its next gather."""
        self.fp8_stale = True

    def ensure(self, u: int) -> None:
        self.gather(u)
        if self.state[u] == GATHERING:
            self.watchdog.wait(self.handles.pop(u), f"ZeRO-3 gather of unit {u}")
            self.state[u] = READY

    def ensure_params(self, params) -> None:
        """Gather the units holding `params` (a split backward's W pass: the weight-gradient
        nodes unpack every tensor they saved, the weight among them, so it must be whole)."""
        for u in dict.fromkeys(self.unit_of[id(p)] for p in params):
            self.ensure(u)

    def free(self, u: int) -> None:
        if self.state[u] == GATHERING:
            self.ensure(u)  # never free memory a collective is still writing
        self.full[u].untyped_storage().resize_(0)
        if u in self.fp8:
            self.fp8[u].free()
        self.state[u] = FREE

    def free_all(self) -> None:
        for u in range(len(self.units)):
            self.free(u)

    # --- hooks ----------------------------------------------------------------------------
    def _with_borrowed(self, u: int) -> list[int]:
        return [u, *self.units[u].borrowed]

    def _pre_forward(self, u: int):
        def hook(module, args):
            for unit in self._with_borrowed(u):
                self.ensure(unit)
            if u + 1 < len(self.units) and self.units[u + 1].chunk == self.units[u].chunk:
                # Prefetch: its all-gather overlaps this unit's compute. Not across chunks:
                # another action may run first and free it, and it would be gathered twice.
                self.gather(u + 1)
        return hook

    def _post_forward(self, u: int):
        def hook(module, args, output):
            for unit in self._with_borrowed(u):
                self.free(unit)
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._pre_backward(u))
        return hook

    def _pre_backward(self, u: int):
        def hook(grad):
            for unit in self._with_borrowed(u):
                self.ensure(unit)
            before = self.backward_next[u]
            if before is not None:
                self.gather(before)
        return hook

    def _backward_next(self, u: int) -> int | None:
        """The unit whose backward comes after u's, in u's chunk: its blocks in reverse,
        after the rest (the head's backward comes first)."""
        unit = self.units[u]
        blocks = [i for i, other in enumerate(self.units)
                  if other.kind == "block" and other.chunk == unit.chunk]
        if unit.kind == "rest":
            return blocks[-1] if blocks else None
        return u - 1 if u - 1 in blocks else None

    def backward_order(self) -> list[int]:
        """Units in the order backward finishes them: blocks last to first, then each
        chunk's rest (its embedding's gradient comes last); chunks last to first."""
        last_first = list(reversed(range(len(self.units))))
        return ([u for u in last_first if self.units[u].kind == "block"]
                + [u for u in last_first if self.units[u].kind == "rest"])

    def fp8_buffers(self) -> list[torch.Tensor]:
        """The FP8 gather's own memory (zero3_fp8.py), beside the units' buffers: each
        gathered FP8 unit's codes (1 byte per element of the unit; 0 once freed) and the
        messages of a gather in flight (its send and receive buffers)."""
        held = [unit.bytes for unit in self.fp8.values()]
        for handle in self.handles.values():  # an FP8 unit's pending gather holds both
            held += [t for t in (getattr(handle, "out", None), getattr(handle, "send", None))
                     if t is not None]
        return held

    def gathered_tensors(self) -> list[torch.Tensor]:
        return [self.shard, *self.full]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
