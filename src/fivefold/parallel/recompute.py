"""Activation recomputation, as a transformation of the model.

    none       every block keeps what autograd saves
    selective  the attention core (softmax(QK^T)V) is recomputed in backward: it holds the
               O(s^2) or softmax-sized tensors for little compute (Korthikanti et al. 2022, §4)
    full       only each block's input is kept; the whole block runs again in backward

The wrapped module keeps its parameter names: only its `forward` is replaced.

A recomputed region that communicates (expert parallelism's all-to-alls) should not send
again what it already received: each checkpointed call carries a `ReplayTape`. In the first
forward a communicating layer pushes what it received onto the tape; when backward runs the
region again, the layer pops it instead of communicating (parallel/expert.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fivefold.models.llama import AttentionCore, Block
from fivefold.parallel import peak
from fivefold.parallel.memory import note_kept

MODES = ("none", "selective", "full")


class ReplayTape:
    """What a checkpointed region's communication received in its first forward, in order."""

    def __init__(self):
        self.items: list = []
        self.replaying = False
        self.position = 0

    def push(self, item) -> None:
        self.items.append(item)

    def pop(self):
        item = self.items[self.position]
        self.position += 1
        return item


_TAPE: contextvars.ContextVar[ReplayTape | None] = contextvars.ContextVar(
    "fivefold_replay_tape", default=None)


def replay_tape() -> ReplayTape | None:
    """The tape of the checkpointed region running now (None outside recomputation)."""
    return _TAPE.get()


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        kept = [a for a in args if isinstance(a, torch.Tensor)]
        note_kept(*kept)
        if peak.active():  # alive while the checkpoint keeps them, i.e. until its backward
            for t in kept:
                peak.track(t)
        tape = ReplayTape()

        def taped(*a, **kw):  # first call: record; the recomputation in backward: replay
            token = _TAPE.set(tape)
            try:
                with peak.recomputing() if tape.replaying else contextlib.nullcontext():
                    return forward(*a, **kw)
            finally:
                _TAPE.reset(token)
                tape.replaying, tape.position = True, 0

        return checkpoint(taped, *args, use_reentrant=False, **kwargs)

    return run


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    if mode not in MODES:
        raise ValueError(f"recompute mode '{mode}' is not one of {', '.join(MODES)}")
    target = {"selective": AttentionCore, "full": Block}.get(mode)
    if target is None:
        return model
    for module in model.modules():
        if isinstance(module, target):
            module.forward = _checkpointed(module.forward)
    return model
