"""Which part of the step an op belongs to: module hooks for forward and backward, named
phases (optimizer, gradient sync, collectives) around the trainer's own calls.

Forward: a module's pre-hook pushes its name, its hook pops it. Backward: when the gradient
of one of a module's outputs is ready its name is pushed (a tensor hook: a multi-grad hook
does not fire on the tensor backward starts from), when those of its inputs are, popped (a
multi-grad hook on the inputs); a module whose inputs need
no gradient (the embedding) stays pushed until the backward pass ends, when an autograd
engine callback clears what is left. A recomputed forward inside backward nests like any
forward. A phase (`with tracker.phase("optimizer")`) overrides modules: its ops are its own.

Part names, from the innermost module (`part_name`):
    embedding, rotary, layers.I.attention, layers.I.mlp, layers.I.norms, layers.I (the rest
    of block I), final_norm, loss (the head and cross-entropy), model (the model's own ops),
    step (ops of the step outside any module or phase), and the phases: optimizer,
    zero_grad, grad_sync, collective.OP.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_SUB = (("norm", "norms"), ("attn", "attention"), ("attention", "attention"),
        ("mlp", "mlp"), ("feed_forward", "mlp"), ("moe", "mlp"), ("experts", "mlp"))


def part_name(module_name: str) -> str:
    """The part of a module, from its qualified name inside a model chunk."""
    if not module_name:
        return "model"
    m = _LAYER.search(module_name)
    if m:
        rest = module_name[m.end():].split(".")[0] if m.end() < len(module_name) else ""
        for key, part in _SUB:
            if key in rest:
                return f"layers.{m.group(1)}.{part}"
        return f"layers.{m.group(1)}"
    head = module_name.split(".")[0]
    if "embed" in head:
        return "embedding"
    if head in ("loss_fn", "lm_head", "output", "head"):
        return "loss"
    if head in ("norm", "final_norm", "ln_f"):
        return "final_norm"
    return head


class PartTracker:
    """The current part, for `OpCounter(part=tracker.current)`."""

    def __init__(self):
        self.stack: list[str] = []  # module names, forward and backward alike
        self.phases: list[str] = []
        self.handles: list = []
        self._cleanup_queued = False

    def current(self) -> str:
        if self.phases:
            return self.phases[-1]
        if self.stack:
            return part_name(self.stack[-1])
        return "step"

    @contextmanager
    def phase(self, name: str):
        self.phases.append(name)
        try:
            yield
        finally:
            self.phases.pop()

    def _pop(self, name: str) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] == name:
                del self.stack[i]
                return

    def _clear_after_backward(self) -> None:
        if self._cleanup_queued:
            return
        self._cleanup_queued = True

        def clear():
            self.stack.clear()
            self._cleanup_queued = False

        torch.autograd.Variable._execution_engine.queue_callback(clear)

    def attach(self, modules: list[tuple[str, torch.nn.Module]]) -> None:
        """Hook every module of each (prefix, root) pair; names are relative to the root."""
        for prefix, root in modules:
            for name, mod in root.named_modules():
                full = f"{prefix}.{name}" if prefix and name else (name or prefix)
                self.handles.append(mod.register_forward_pre_hook(self._pre(full)))
                self.handles.append(mod.register_forward_hook(self._post(full)))

    def _pre(self, name: str):
        def hook(module, args):
            self.stack.append(name)
            tensors = [t for t in tree_flatten(args)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors and torch.is_grad_enabled():
                register_multi_grad_hook(tensors, lambda grads: self._pop(name))
        return hook

    def _post(self, name: str):
        def hook(module, args, out):
            self._pop(name)
            tensors = [t for t in tree_flatten(out)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if not tensors or not torch.is_grad_enabled():
                return
            pushed = []

            def begin_backward(grad):  # a tensor hook also fires on the root of backward
                if not pushed:
                    pushed.append(True)
                    self.stack.append(name)
                    self._clear_after_backward()
            for t in tensors:
                t.register_hook(begin_backward)
        return hook

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
