"""Measuring what autograd keeps for backward: saved-activation bytes per micro-batch.

`SavedActivations` counts, once per storage, every tensor autograd saves during a forward
(through `torch.autograd.graph.saved_tensors_hooks`), leaving out the parameters (weights are
model state, not activations). Recomputed regions save nothing inside them, but the
checkpoint keeps the region's inputs alive: the recompute wrapper reports those through
`note_kept`, so full recomputation is measured as what it really holds.
"""

from __future__ import annotations

import contextvars

import torch

_ACTIVE: contextvars.ContextVar[SavedActivations | None] = contextvars.ContextVar(
    "fivefold_saved_activations", default=None)


def _storage_key(t: torch.Tensor) -> int:
    """The identity of the storage behind t: stable when ZeRO-3 frees a gathered parameter
    (resize to 0 bytes) and gathers it again into the same storage."""
    return t.untyped_storage()._cdata


class SavedActivations:
    def __init__(self, params=()):
        self.param_storages = {_storage_key(p) for p in params}
        self.storages: dict[int, int] = {}

    def _add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = _storage_key(t)
        if key in self.param_storages:
            return
        self.storages[key] = max(self.storages.get(key, 0), t.untyped_storage().nbytes())

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._token = _ACTIVE.set(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def _pack(self, t):
        self._add(t)
        return t

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        _ACTIVE.reset(self._token)


def note_kept(*tensors) -> None:
    """Called by recomputation for the inputs a checkpointed region keeps alive."""
    meter = _ACTIVE.get()
    if meter is not None:
        for t in tensors:
            meter._add(t)
