"""Expert parallelism: each of the `ep` ranks of an expert group holds E/ep experts, and the
tokens travel to their experts and back with two all-to-alls per MoE layer.

    apply_expert_parallel(model, dims)    # after TP/CP, before recompute and the pipeline

cuts every MoE layer's stacked expert weights (`w_gate`, `w_up` [E, I, H], `w_down`
[E, H, I]) to this rank's contiguous block of experts along dim 0, tags them as pieces of
the logical tensors (`_full_shape`, `_shard_fn`, `_ep_slice`), and swaps the layer's
dispatcher for `AllToAllDispatcher`. One MoE layer, one micro-batch, on each rank:

    route        x [T, H], top-k experts [T, k]  ->  T·k routed rows, sorted by expert id;
                 experts are numbered rank-major, so the rows for rank 0 come first
    counts       all-to-all of the per-expert counts (E int64): each rank learns how many
                 rows it receives, from each source rank, for each of its local experts
    dispatch     all-to-all of the rows with uneven splits: T·k·H elements leave this rank
    experts      received rows regrouped expert-major, run through the local experts
    combine      the reverse all-to-all brings every row back to the rank of its token,
                 where it is weighted by its router weight and summed over the k choices

Both token all-to-alls are autograd functions whose backward is the reverse all-to-all of
the gradient, so per micro-batch and MoE layer the ledger holds 4 token all-to-alls (2
forward, 2 backward) and 1 count exchange. The bytes of a dispatch are this rank's routed
rows T·k·H·β; a combine's input is the rows this rank's experts processed, which equals
T·k·H·β on average over the ep group (exactly, summed over it).

Under full recomputation the block's forward runs again in backward; the all-to-alls
replay what the first forward received instead of communicating again
(`recompute.replay_tape`): recomputation then costs no extra communication, for the price
of keeping the received rows and the combined rows of each MoE layer until its backward.

Gradients: an expert's weights live on the edp ranks (same experts, other tokens); the
gradient each rank computes covers every token routed to its experts from its whole ep
group, so expert gradients are summed over edp and dense ones over dp×cp
(`expert_optim.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import ConfigError
from fivefold.models.moe import expert_counts, moe_layers
from fivefold.parallel import comm
from fivefold.parallel.comm import Group
from fivefold.parallel.memory import note_kept
from fivefold.parallel.recompute import replay_tape

EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


class _AllToAll(torch.autograd.Function):
    """Rows of x go to ranks by `send` counts; `recv` rows arrive. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x, group: Group, send: list[int], recv: list[int], replayed):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        if replayed is not None:  # a recomputed forward: what the first forward received
            return replayed.view_as(replayed)
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), group, recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        comm.all_to_all(out, grad.contiguous(), ctx.group, ctx.send, ctx.recv)
        return out, None, None, None, None


def all_to_all_rows(x: torch.Tensor, group: Group, send: list[int], recv: list[int],
                    replayed: torch.Tensor | None = None) -> torch.Tensor:
    return _AllToAll.apply(x, group, send, recv, replayed)


def expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups received rows from (source rank, expert) order into
    (expert, source rank) order. recv_counts [ep, E_local]: rows from each source per expert."""
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) block starts
    sizes, starts = recv_counts.t().reshape(-1), starts.view_as(recv_counts).t().reshape(-1)
    # Block b of the new order holds rows starts[b] .. starts[b] + sizes[b] - 1.
    offsets = torch.cumsum(sizes, 0) - sizes
    within = torch.arange(int(sizes.sum()), device=flat.device)
    within = within - torch.repeat_interleave(offsets, sizes)
    return torch.repeat_interleave(starts, sizes) + within


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse permutation. Un-permuting by index_select saves only the index for
    backward (an index_copy into a new tensor would keep its source too)."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


class AllToAllDispatcher:
    """The MoE layer's dispatcher under expert parallelism (see the module docstring).

    Called as `dispatcher(x [T, H], expert_idx [T, k], weights [T, k], experts) -> [T, H]`,
    like the local dispatcher it replaces; `experts` holds this rank's E/ep experts.
    """

    replays_tape = True  # recomputation replays what it received (parallel/recompute.py)

    def __init__(self, group: Group, num_experts: int):
        self.group, self.num_experts = group, num_experts
        self.local = num_experts // group.size

    def __call__(self, x, expert_idx, weights, experts):
        tape = replay_tape()
        replaying = tape is not None and tape.replaying
        num_tokens, k = expert_idx.shape
        flat_idx = expert_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)  # rows sorted by expert id, then token
        rows = x[order // k]
        if replaying:
            recv_counts, recv_rows, back_rows = tape.pop()
        else:
            counts = expert_counts(flat_idx, self.num_experts)
            recv_counts = torch.empty_like(counts)
            comm.all_to_all(recv_counts, counts, self.group)
            recv_rows = back_rows = None
        recv_counts = recv_counts.view(self.group.size, self.local)
        send = torch.bincount(flat_idx // self.local, minlength=self.group.size).tolist()
        recv = recv_counts.sum(1).tolist()

        received = all_to_all_rows(rows, self.group, send, recv, recv_rows)
        perm = expert_major(recv_counts)
        out_sorted = experts(received[perm], recv_counts.sum(0))
        out_recv = out_sorted.index_select(0, _inverse(perm))
        back = all_to_all_rows(out_recv, self.group, recv, send, back_rows)

        if tape is not None and not replaying:
            tape.push((recv_counts.reshape(-1), received.detach(), back.detach()))
            note_kept(received, back)
        # Combined as models.moe.LocalDispatcher does: in fp32, summed in token order.
        unsorted = back.index_select(0, _inverse(order)).view(num_tokens, k, -1)
        return (unsorted.float() * weights[..., None]).sum(1).to(x.dtype)


class EPParams:
    """Mixin for an experts module: puts the expert-parallel tags back on its parameters
    whenever `_apply` (`to()`, `to_empty()`) replaces them, as tensor.TPParams does."""

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        tag_expert_params(self)
        return out


_SWAPPED: dict[type, type] = {}


def tag_expert_params(module: nn.Module) -> None:
    start, stop, full = module._ep_range
    for name in EXPERT_PARAMS:
        p = module._parameters.get(name)
        if p is None:
            continue
        p._full_shape = (full, *p.shape[1:])
        p._shard_fn = _expert_shard(start, stop)
        p._ep_slice = (0, start, stop)
        p._expert = True


def _expert_shard(start: int, stop: int):
    return lambda full: full.narrow(0, start, stop - start).clone()


def _shard_experts(experts: nn.Module, group: Group) -> None:
    """Keep this rank's contiguous block of experts of every stacked expert weight."""
    cls = type(experts)
    if not issubclass(cls, EPParams):
        if cls not in _SWAPPED:
            _SWAPPED[cls] = type(f"EP{cls.__name__}", (EPParams, cls), {})
        experts.__class__ = _SWAPPED[cls]
    full = experts._parameters[EXPERT_PARAMS[0]].shape[0]
    local = full // group.size
    start = group.rank * local
    experts._ep_range = (start, start + local, full)
    for name in EXPERT_PARAMS:
        old = experts._parameters[name]
        if old.is_meta:
            new = torch.empty((local, *old.shape[1:]), dtype=old.dtype, device="meta")
        else:
            new = old.detach()[start:start + local].clone()
        experts._parameters[name] = nn.Parameter(new, requires_grad=old.requires_grad)
    experts.num_experts = local
    tag_expert_params(experts)


def apply_expert_parallel(model: nn.Module, dims) -> nn.Module:
    """Shard every MoE layer's experts over dims["ep"] and dispatch with all-to-alls."""
    group: Group = dims["ep"]
    if group.size == 1:
        return model
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"parallel.ep = {group.size} but the model has no MoE layers; "
                          f"set parallel.ep = 1 or pick a mixture-of-experts model")
    for layer in layers:
        num_experts = layer.experts._parameters[EXPERT_PARAMS[0]].shape[0]
        if num_experts % group.size:
            raise ConfigError(f"parallel.ep = {group.size} does not divide the "
                              f"{num_experts} experts; pick an ep that divides them")
        _shard_experts(layer.experts, group)
        layer.dispatcher = AllToAllDispatcher(group, num_experts)
    return model


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether `param` is a stacked expert weight sharded by expert parallelism."""
    return getattr(param, "_expert", False)


def expert_param_ids(modules) -> set[int]:
    """ids of the stacked expert weights in `modules` (at any ep, ep 1 included)."""
    return {id(layer.experts._parameters[name]) for module in modules
            for layer in moe_layers(module) for name in EXPERT_PARAMS
            if layer.experts._parameters.get(name) is not None}
