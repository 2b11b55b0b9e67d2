"""ZeRO-3 for a frozen base (LoRA, QLoRA): each rank keeps 1/N of every block's frozen bytes.

Under LoRA the optimizer holds only the adapters, so `zero3.ParamGatherer` shards those; the
frozen base of each block (plain weights without a gradient, and the buffers of a quantised
linear: NF4's packed codes with their int8 absmaxes, fp32 factors, mean and code table, or
int8 codes with their scales) would stay whole on every rank. Here those tensors are sharded
the same way (Rajbhandari et al. 2020, "ZeRO", §5.3, applied to weights that never train):

    layout    per block, its frozen tensors' bytes in one flat uint8 buffer, largest element
              size first (so every tensor starts aligned to its own element size without
              padding between them), padded at the end to a multiple of N; rank r keeps
              bytes [r·S/N, (r+1)·S/N) of it
    forward   before a block runs: wait for (or start) its all-gather, start the next
              block's (prefetch); after it ran: free the gathered copy
    backward  when the gradient of the block's output arrives: free the block after it (its
              backward is over: this output is its input), gather this one again (the
              input gradient of a frozen linear needs its weight, a quantised one
              dequantises again), start the block before it (prefetch). So at most two
              blocks are gathered at once. The first block is freed when the step's
              gradient sync finishes.

Nothing here has a gradient: no reduce-scatter, no optimizer state. The values move as raw
bytes, so every rank computes with exactly the single-process weights. As in FSDP (Zhao et
al. 2023, §3.2), each tensor keeps its identity: a parameter's `.data` and a buffer are
typed views of the block's gathered storage, freed with `untyped_storage().resize_(0)`.

A module holds its weight in buffers when it has a `dequantize` method (quant/linear.py's
quantised linears); `parallel/` recognises it by that method, not by importing it.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.parallel import comm, peak

FREE, GATHERING, READY = "free", "gathering", "ready"


def block_frozen_tensors(block: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner module, attribute name, tensor) of a block's frozen weights: parameters without
    a gradient, and the buffers of modules that hold a quantised weight."""
    out, seen = [], set()
    for module in block.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((module, name, p))
        if callable(getattr(module, "dequantize", None)):
            for name, b in module.named_buffers(recurse=False):
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    out.append((module, name, b))
    return sorted(out, key=lambda m: -m[2].element_size())  # stable: model order within a size


def frozen_segment_bytes(nbytes: int, shards: int) -> int:
    """A block's gathered buffer: its frozen bytes padded to a multiple of `shards`."""
    return -(-nbytes // shards) * shards


class FrozenGatherer:
    """Shards the frozen tensors of `blocks` over `group` and gathers them around each use."""

    def __init__(self, blocks: list[nn.Module], group: comm.Group, device: torch.device,
                 watchdog):
        self.group, self.watchdog, self.shards = group, watchdog, group.size
        self.blocks, self.members, self.full, self.sizes = [], [], [], []
        for block in blocks:
            members = block_frozen_tensors(block)
            if members:
                self.blocks.append(block)
                self.members.append(members)
        self.offsets = []
        total = 0
        for members in self.members:
            nbytes = sum(t.numel() * t.element_size() for *_, t in members)
            self.offsets.append(total // self.shards)
            size = frozen_segment_bytes(nbytes, self.shards)
            self.sizes.append(size)
            total += size
        self.shard = torch.empty(total // self.shards, dtype=torch.uint8, device=device)
        self.state = [READY] * len(self.blocks)
        self.handles: dict[int, object] = {}
        with torch.no_grad():
            for u, members in enumerate(self.members):
                full = torch.zeros(self.sizes[u], dtype=torch.uint8, device=device)
                at = 0
                for module, name, t in members:
                    n = t.numel() * t.element_size()
                    view = full[at:at + n].view(t.dtype).view(t.shape)
                    view.copy_(t.detach())
                    self._rebind(module, name, view)
                    at += n
                part = self.sizes[u] // self.shards
                self._shard_of(u).copy_(full[group.rank * part:(group.rank + 1) * part])
                self.full.append(full)
                self.free(u)
        self._hooks = []
        for u, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._pre_forward(u)))
            self._hooks.append(block.register_forward_hook(self._post_forward(u)))

    @staticmethod
    def _rebind(module: nn.Module, name: str, view: torch.Tensor) -> None:
        if name in module._parameters:
            module._parameters[name].data = view
        else:
            module._buffers[name] = view

    def _shard_of(self, u: int) -> torch.Tensor:
        return self.shard[self.offsets[u]:self.offsets[u] + self.sizes[u] // self.shards]

    # --- gather and free ------------------------------------------------------------------
    def gather(self, u: int) -> None:
        if self.state[u] != FREE:
            return
        full = self.full[u]
        full.untyped_storage().resize_(self.sizes[u])
        self.handles[u] = comm.all_gather(full, self._shard_of(u), self.group, async_op=True)
        self.state[u] = GATHERING
        peak.sample("frozen unit gathered")

    def ensure(self, u: int) -> None:
        self.gather(u)
        if self.state[u] == GATHERING:
            self.watchdog.wait(self.handles.pop(u), f"ZeRO-3 gather of frozen block {u}")
            self.state[u] = READY

    def free(self, u: int) -> None:
        if self.state[u] == GATHERING:
            self.ensure(u)  # never free memory a collective is still writing
        self.full[u].untyped_storage().resize_(0)
        self.state[u] = FREE

    def free_all(self) -> None:
        for u in range(len(self.blocks)):
            self.free(u)

    # --- hooks ----------------------------------------------------------------------------
    def _pre_forward(self, u: int):
        def hook(module, args):
            self.ensure(u)
            if u + 1 < len(self.blocks):
                self.gather(u + 1)
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
            if u + 1 < len(self.blocks):
                self.free(u + 1)  # u's output is u+1's input: u+1's backward is over
            self.ensure(u)
            if u > 0:
                self.gather(u - 1)  # prefetch: backward runs the blocks last to first
        return hook

    def gathered_tensors(self) -> list[torch.Tensor]:
        return [self.shard, *self.full]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


def frozen_gatherer(units, group: comm.Group, device: torch.device,
                    watchdog) -> FrozenGatherer | None:
    """The gatherer of the ZeRO-3 block units' frozen weights, or None where they have none
    (full training) or there is one rank."""
    blocks = [unit.module for unit in units if unit.kind == "block"]
    if group.size == 1 or not any(block_frozen_tensors(b) for b in blocks):
        return None
    return FrozenGatherer(blocks, group, device, watchdog)
