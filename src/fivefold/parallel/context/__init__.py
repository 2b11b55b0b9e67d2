"""Context parallelism: each sequence is split over the cp ranks, attention crosses ranks.

The transformation (`apply_context_parallel`) changes two modules of the plain model:

    self_attn.core  -> ContextAttentionCore: the local queries attend over every rank's keys
                       (ring or all-gather K/V, attention.py), causal by true position
    rotary          -> ContextRotary: local position i is given its true position in the
                       sequence, so RoPE sees the tokens where they are

Everything else (projections, norms, MLP, loss) works token by token and needs nothing. The
trainer cuts each micro-batch with `shard_batch` (inputs and targets by the same
permutation); the loss of a rank is its targets' summed cross-entropy, divided by the target
count of the whole global batch, and gradients are summed over dp×cp (parallel/zero.py),
so no averaging depends on how many valid targets each shard holds.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.models.llama import Attention, Rotary
from fivefold.parallel.comm import Group
from fivefold.parallel.context.attention import SCHEMES, ContextAttention, kernel_available
from fivefold.parallel.context.layout import LAYOUTS, local_chunks, local_positions

__all__ = ["LAYOUTS", "SCHEMES", "ContextAttentionCore", "ContextRotary",
           "apply_context_parallel", "kernel_available", "shard_batch", "shard_sequence"]


def shard_sequence(x: torch.Tensor, layout: str, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of x (b, s, ...): its two chunks of s / (2·cp), in order."""
    b, s = x.shape[:2]
    chunks = x.reshape(b, 2 * cp, s // (2 * cp), *x.shape[2:])
    first, second = local_chunks(layout, cp, rank)
    return torch.cat([chunks[:, first], chunks[:, second]], dim=1)


def shard_batch(micro_batches, layout: str, group: Group):
    """Cut every (inputs, targets) micro-batch to this cp rank's tokens."""
    if group.size == 1:
        return micro_batches
    return [(shard_sequence(x, layout, group.size, group.rank),
             shard_sequence(y, layout, group.size, group.rank)) for x, y in micro_batches]


class ContextAttentionCore(nn.Module):
    """Replaces `AttentionCore` under cp > 1. `counter`, when a list, receives the number of
    (query, key) score pairs of every kernel call (for the balance test)."""

    def __init__(self, group: Group, layout: str, scheme: str, kernel: str = "auto"):
        super().__init__()
        self.group, self.layout, self.scheme, self.kernel = group, layout, scheme, kernel
        self.counter: list[int] | None = None

    def forward(self, q, k, v, causal_offset: int | None = 0):
        if causal_offset != 0:
            raise NotImplementedError("a KV cache (generation) does not run under cp > 1")
        return ContextAttention.apply(q, k, v, self.group, self.layout, self.scheme,
                                      self.counter, self.kernel)


class ContextRotary(Rotary):
    """RoPE tables at the true positions of this rank's tokens.

    Callers pass local positions 0 … n − 1 (n = seq_len / cp); they are mapped through the
    rank's position table, so the model code stays unaware of the split.
    """

    def __init__(self, cfg, layout: str, cp: int, rank: int):
        super().__init__(cfg)
        self.layout, self.cp, self.rank = layout, cp, rank

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        n = positions.numel()
        table = torch.tensor(local_positions(self.layout, self.cp, self.rank, n * self.cp),
                             device=positions.device)
        return super().forward(table[positions], dtype)


def apply_context_parallel(model: nn.Module, group: Group, layout: str, scheme: str,
                           kernel: str = "auto") -> None:
    """Swap the attention cores and the rotary tables of a (meta-built) model in place."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = ContextAttentionCore(group, layout, scheme, kernel)
    model.rotary = ContextRotary(model.cfg, layout, group.size, group.rank)
