"""Peak bytes of live tensor storages, counted from allocations, on any device (CPU too).

A dispatch mode sees every tensor an operator returns; a storage seen for the first time is
counted until it is freed (a weak reference's callback), and the tensors alive before the
meter started (weights, gradients, optimizer states, handed in as `existing`) are counted
the same way. Views and in-place results share a counted storage and add nothing. The peak
is what an allocator without caching or fragmentation would need: on CUDA it is comparable
with `torch.cuda.max_memory_allocated`, on a CPU it is the number RSS cannot give.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakAllocations(TorchDispatchMode):
    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self._refs: list = []
        for t in existing:
            self._track(t)

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        self._refs.append(weakref.ref(storage, lambda _, key=key: self._free(key)))

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out


def module_and_optimizer_tensors(modules, optimizers) -> list[torch.Tensor]:
    """Parameters, their gradients and every optimizer state tensor."""
    out = []
    for m in modules:
        for p in m.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
    for opt in optimizers:
        for group in opt.param_groups:
            out.extend(group["params"])
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out
