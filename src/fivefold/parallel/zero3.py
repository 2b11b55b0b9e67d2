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
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.parallel import comm
from fivefold.parallel.buffers import FlatLayout

FREE, GATHERING, READY = "free", "gathering", "ready"


def zero3_units(chunks: list[nn.Module], named_params) -> tuple[list[list[int]], list]:
    """Parameter-index groups (one per unit, forward order) and each unit's (module, kind)."""
    index = {id(p): i for i, (_, p) in enumerate(named_params)}
    groups, units = [], []
    for chunk in chunks:
        layers = getattr(chunk, "layers", [])  # a ModuleList, or a pipeline stage's ModuleDict
        blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        rest = [index[id(p)] for p in chunk.parameters()
                if id(p) not in in_blocks and id(p) in index]
        taken = {i for g in groups for i in g}
        rest = [i for i in dict.fromkeys(rest) if i not in taken]  # a shared weight once
        if rest:
            groups.append(rest)
            units.append((chunk, "rest"))
        for block in blocks:
            groups.append([index[id(p)] for p in block.parameters()])
            units.append((block, "block"))
    return groups, units


class ParamGatherer:
    def __init__(self, layout: FlatLayout, units: list, group: comm.Group, dtype: torch.dtype,
                 device: torch.device, watchdog):
        self.layout, self.units, self.group, self.watchdog = layout, units, group, watchdog
        self.rank = group.rank
        self.shard = torch.empty(layout.total // layout.shards, dtype=dtype, device=device)
        self.full: list[torch.Tensor] = []
        self.state = [FREE] * len(units)
        self.handles: dict[int, object] = {}
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
        self._hooks = []
        for u, (module, _kind) in enumerate(units):
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(u)))
            self._hooks.append(module.register_forward_hook(self._post_forward(u)))

    # --- gather and free ------------------------------------------------------------------
    def gather(self, u: int) -> None:
        """Start unit u's all-gather (asynchronously) unless it is gathered or on its way."""
        if self.state[u] != FREE:
            return
        seg, full = self.layout.segments[u], self.full[u]
        full.untyped_storage().resize_(seg.size * full.element_size())
        self.handles[u] = comm.all_gather(full, self.layout.segment_shard(self.shard, seg),
                                          self.group, async_op=True)
        self.state[u] = GATHERING

    def ensure(self, u: int) -> None:
        self.gather(u)
        if self.state[u] == GATHERING:
            self.watchdog.wait(self.handles.pop(u), f"ZeRO-3 gather of unit {u}")
            self.state[u] = READY

    def free(self, u: int) -> None:
        if self.state[u] == GATHERING:
            self.ensure(u)  # never free memory a collective is still writing
        self.full[u].untyped_storage().resize_(0)
        self.state[u] = FREE

    def free_all(self) -> None:
        for u in range(len(self.units)):
            self.free(u)

    # --- hooks ----------------------------------------------------------------------------
    def _pre_forward(self, u: int):
        def hook(module, args):
            self.ensure(u)
            if u + 1 < len(self.units):
                self.gather(u + 1)  # prefetch: its all-gather overlaps this unit's compute
        return hook

    def _post_forward(self, u: int):
        def hook(module, args, output):
            self.free(u)
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._pre_backward(u))
        return hook

    def _pre_backward(self, u: int):
        def hook(grad):
            self.ensure(u)
            before = self._backward_next(u)
            if before is not None:
                self.gather(before)
        return hook

    def _backward_next(self, u: int) -> int | None:
        """The unit whose backward comes after u's: blocks in reverse, the rest first."""
        kind = self.units[u][1]
        if kind == "rest":
            blocks = [i for i in range(u + 1, len(self.units)) if self.units[i][1] == "block"]
            return blocks[-1] if blocks else None
        return u - 1 if u - 1 >= 0 and self.units[u - 1][1] == "block" else None

    def backward_order(self) -> list[int]:
        """Units in the order backward finishes them: blocks last to first, then each
        chunk's rest (its embedding's gradient comes last); chunks last to first."""
        last_first = list(reversed(range(len(self.units))))
        return ([u for u in last_first if self.units[u][1] == "block"]
                + [u for u in last_first if self.units[u][1] == "rest"])

    def gathered_tensors(self) -> list[torch.Tensor]:
        return [self.shard, *self.full]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
