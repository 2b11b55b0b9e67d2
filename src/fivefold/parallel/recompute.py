"""Activation recomputation, as a transformation of the model.

    none       every block keeps what autograd saves
    selective  the attention core (softmax(QK^T)V) is recomputed in backward: it holds the
               O(s^2) or softmax-sized tensors for little compute (Korthikanti et al. 2022, §4)
    full       only each block's input is kept; the whole block runs again in backward

The wrapped module keeps its parameter names: only its `forward` is replaced.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fivefold.models.llama import AttentionCore, Block
from fivefold.parallel.memory import note_kept

MODES = ("none", "selective", "full")


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            note_kept(*(a for a in args if isinstance(a, torch.Tensor)))
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

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
