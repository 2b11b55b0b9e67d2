"""Mixture-of-experts feed-forward block, in plain PyTorch (no parallelism here).

    x [b, s, h] -> router (fp32 scores, top-k) -> dispatcher(x, expert_idx, weights, experts)
               (+ shared expert) -> [b, s, h]

The router scores every token against every expert in fp32 (softmax or sigmoid), picks the
top k with a deterministic tie-break (the lower expert index wins), and returns the chosen
experts' weights taken from the unbiased scores, optionally renormalised over the k and
multiplied by a routed scaling factor. DeepSeek-V3's group-limited routing and its
auxiliary-loss-free `expert_bias` (Wang et al. 2024, arXiv 2408.15664) change only which
experts are chosen, never the weights.

`GroupedExperts` holds the routed SwiGLU experts stacked as `w_gate [E, I, H]`,
`w_up [E, I, H]`, `w_down [E, H, I]` and runs tokens already sorted by expert with one
grouped matmul per projection (`torch._grouped_mm` / `F.grouped_mm`), or a per-expert loop
where the installed torch lacks it; the two give the same numbers.

`MoE.dispatcher` is replaceable: the default `LocalDispatcher` permutes the token copies by
expert, runs the local experts and combines in token order; expert parallelism swaps in an
all-to-all dispatcher with the same call signature and shards the stacked experts on dim 0.

Balancing losses, and why they are attached the way they are
-----------------------------------------------------------
Both losses are computed *per sequence* and summed over the sequences of the forward call:

  balance (DeepSeek-V3 sequence-wise form, arXiv 2412.19437 eq. 17-20; Switch Transformer's
  loss over one sequence, Fedus et al. 2021 eq. 4):  L_seq = sum_i f_i · P_i with
  f_i = E/(k·S) · #{tokens of the sequence routed to i},  P_i = mean over the sequence of
  the normalised score of expert i. It is 1 when the sequence's load is even.
  z-loss (ST-MoE, Zoph et al. 2022 eq. 5): Z_seq = mean over the sequence of logsumexp(logits)².

A per-sequence quantity needs no count from another micro-batch or data-parallel rank, so
the sum over the global batch, divided by the number of sequences in it, is the same for
every split into micro-batches, dp ranks and pipeline stages: the loss is invariant to the
layout by construction (a global-batch Switch loss would need an all-reduce of counts inside
every forward). Context parallelism, which cuts a sequence, must sum the counts and scores of
one sequence over cp before the product; it is the one layout this form does not cover alone.

The losses do not travel with the model's output: under pipeline parallelism the MoE layer
may sit on another stage than the loss. `AuxLossInjector` (Megatron-core's
"MoEAuxLossAutoScaler" idea) returns the block's output unchanged in forward and, in
backward, feeds d(total)/d(aux) = `aux_grad_scale` into the aux losses' graph, so their
gradient reaches the router whatever stage or recomputation runs the backward. The trainer
sets `aux_grad_scale` to loss_scale / (sequences in the global batch) with
`set_aux_grad_scale`; left unset, a forward call weighs its own sequences equally (1/b).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models.mlp import MLP
from fivefold.models.presets import ModelConfig
from fivefold.numerics.kernel_support import compiling

# torch >= 2.8 (CPU and CUDA); the public wrapper arrived later.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(x: torch.Tensor, hidden: int, inter: int) -> bool:
    """Rows must be 16-byte aligned, and this torch must run the kernel on x's device and
    dtype (CPU support arrived after CUDA's; CUDA wants bf16): tried once on a tiny input."""
    if _GROUPED_MM is None:
        return False
    if (hidden * x.element_size()) % 16 or (inter * x.element_size()) % 16:
        return False
    key = (x.device.type, x.dtype)
    if key not in _WORKS:
        a = torch.zeros(2, 8, device=x.device, dtype=x.dtype)
        b = torch.zeros(1, 8, 8, device=x.device, dtype=x.dtype)
        offs = torch.tensor([2], device=x.device, dtype=torch.int32)
        try:
            _GROUPED_MM(a, b.transpose(-2, -1), offs=offs)
            _WORKS[key] = True
        except (RuntimeError, NotImplementedError):
            _WORKS[key] = False
    return _WORKS[key]


def probe_grouped_mm(model: nn.Module) -> None:
    """Try the grouped matmul now, eagerly, at each `GroupedExperts`' weight device and
    dtype (train.compile calls this before compiling): traced, the first block's probe
    filled `_WORKS` and the next block's graph, guarded on it, compiled again."""
    for m in model.modules():
        if isinstance(m, GroupedExperts) and m.w_gate.device.type != "meta":
            grouped_mm_available(m.w_gate, m.hidden, m.inter)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    fails on an expanded (stride-0) gradient such as the one `y.sum().backward()` sends."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [T, K] sorted by group, w [G, N, K] -> [T, N]: x_g @ w_g^T per group."""
    return _ContiguousGrad.apply(_GROUPED_MM(x, w.transpose(-2, -1), offs=offs))


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights; `impl` is "auto", "grouped_mm" or "loop"."""

    def __init__(self, num_experts: int, hidden: int, inter: int, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.impl = num_experts, hidden, inter, impl
        self.w_gate = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def use_grouped_mm(self, x: torch.Tensor) -> bool:
        if self.impl == "loop":
            return False
        if self.impl == "auto" and x.dtype != torch.bfloat16 and compiling():
            # torch 2.13's meta kernel of _grouped_mm, which a trace runs, takes bf16 only
            # (the CPU kernel also runs fp32 and fp16): the trace failed, so traced, the loop
            return False
        ok = grouped_mm_available(x, self.hidden, self.inter)
        if self.impl == "grouped_mm" and not ok:
            raise RuntimeError("GroupedExperts(impl='grouped_mm'): this torch/device/dtype has "
                               "no grouped matmul; use impl='auto' or 'loop'")
        return ok

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted [T, H]: tokens grouped by local expert, `counts[e]` rows for expert e."""
        if self.use_grouped_mm(x_sorted):
            offs = torch.cumsum(counts.to(x_sorted.device), 0).to(torch.int32)  # counts may be host
            h = F.silu(_gmm(x_sorted, self.w_gate, offs)) * _gmm(x_sorted, self.w_up, offs)
            return _gmm(h, self.w_down, offs)
        return self._loop(x_sorted, counts)

    @torch.compiler.disable
    def _loop(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Eager under torch.compile: the rows per expert change every step, and a graph
        specialised on them would be compiled again for each new split."""
        outs = []
        for e, rows in enumerate(x_sorted.split(counts.tolist())):
            h = F.silu(rows @ self.w_gate[e].t()) * (rows @ self.w_up[e].t())
            outs.append(h @ self.w_down[e].t())
        return torch.cat(outs) if outs else x_sorted.new_zeros(0, self.hidden)


class Router(nn.Module):
    """Scores in fp32; top-k with the lower expert index winning ties."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, score_func: str = "softmax",
                 norm_topk_prob: bool = True, scaling_factor: float = 1.0, num_groups: int = 1,
                 topk_groups: int = 1):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"router score function '{score_func}' is not softmax or sigmoid")
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.norm_topk_prob, self.scaling_factor = norm_topk_prob, scaling_factor
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # Aux-loss-free balancing: added to the scores for the choice only (see update_expert_bias).
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()

    def forward(self, x: torch.Tensor):
        """x [T, H] -> (logits [T, E], scores [T, E], expert_idx [T, k], weights [T, k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = self.scores(logits)
        choice = scores.detach() + self.expert_bias.float()
        if self.num_groups > 1:
            choice = self._limit_groups(choice)
        # A stable descending sort keeps equal scores in index order: ties go to the lower
        # expert index on every device and layout (torch.topk promises no order for ties).
        ranked = torch.sort(choice, dim=-1, descending=True, stable=True)[1]
        expert_idx = ranked[:, :self.top_k].contiguous()
        weights = scores.gather(-1, expert_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, expert_idx, weights * self.scaling_factor

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 group-limited routing: experts in `num_groups` groups; a group's score is
        the sum of its two best (sigmoid) or its best (softmax, DeepSeek-V2) experts; only the
        `topk_groups` best groups stay eligible, the others are masked to -inf."""
        t = choice.shape[0]
        grouped = choice.view(t, self.num_groups, -1)
        if self.score_func == "sigmoid":
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
        else:
            group_score = grouped.amax(-1)
        ranked = torch.sort(group_score, dim=-1, descending=True, stable=True)[1]
        keep = ranked[:, :self.topk_groups]
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~mask[..., None], float("-inf")).view(t, -1)


def expert_counts(expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`torch.bincount(expert_idx.flatten(), minlength=num_experts)` for indices known to
    lie below num_experts: the same int64 counts at a length fixed in advance. bincount's
    length is max(minlength, the largest index + 1), which its kernel must look at first (a
    host sync on CUDA) and which broke the compiled block's graph (a data-dependent shape)."""
    flat = expert_idx.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


class LocalDispatcher:
    """Permute token copies by expert, run the experts, un-permute, combine with the weights.

    The combine multiplies and sums in fp32 in token order (copy 0 + copy 1 + ...), as HF does.
    """

    def __call__(self, x, expert_idx, weights, experts):
        t, k = expert_idx.shape
        flat = expert_idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, experts.num_experts)
        y_sorted = experts(x.index_select(0, order // k), counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y_sorted.index_select(0, inverse).view(t, k, -1)
        return (y.float() * weights[..., None]).sum(1).to(x.dtype)


class AuxLossInjector(torch.autograd.Function):
    """Identity on `out`; backward sends `scale` as the gradient of the scalar `aux`."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device, dtype=torch.float32), None


def capacity_mask(expert_idx, weights, seq_len: int, num_experts: int, factor: float):
    """Token dropping: per sequence, each expert takes at most ceil(factor · S·k / E) copies.

    Drop policy: within one sequence and expert, copies are kept in order of their routing
    weight (highest first; equal weights: earlier token first); the rest are dropped — their
    weight becomes zero and the token keeps only its residual (and shared expert) path. The
    capacity is per sequence, so what is dropped does not depend on the micro-batch size or
    the layout. Dropped copies still pass through the experts (the dispatch stays [T, k]);
    the capacity changes what the model computes, not its cost.
    """
    t, k = expert_idx.shape
    b = t // seq_len
    cap = math.ceil(factor * seq_len * k / num_experts)
    e = expert_idx.view(b, -1)
    w = weights.detach().view(b, -1)
    by_weight = torch.sort(w, dim=-1, descending=True, stable=True)[1]
    by_expert = torch.sort(e.gather(1, by_weight), dim=-1, stable=True)[1]
    order = by_weight.gather(1, by_expert)  # per sequence: by expert, then weight, then token
    sorted_e = e.gather(1, order)
    counts = F.one_hot(e, num_experts).sum(1)
    starts = torch.cumsum(counts, -1) - counts
    rank = torch.arange(e.shape[1], device=e.device) - starts.gather(1, sorted_e)
    keep = torch.empty_like(rank, dtype=torch.bool).scatter_(1, order, rank < cap)
    return keep.view(t, k)


class MoE(nn.Module):
    """Router + routed experts + optional shared expert (gated as in Qwen2-MoE, or not)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.router = Router(h, cfg.num_experts, cfg.experts_top_k, cfg.router_score,
                             cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.router_groups,
                             cfg.router_topk_groups)
        self.experts = GroupedExperts(cfg.num_experts, h, cfg.moe_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = cfg.replace(intermediate_size=cfg.shared_expert_intermediate_size,
                                 mlp="swiglu")
            self.shared_expert = MLP(shared)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.dispatcher = LocalDispatcher()
        self.aux_grad_scale: float | None = None
        # Statistics of the training forwards since the last `reset_stats` (not recomputations).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("aux_sums", torch.zeros(3), persistent=False)  # balance, z, sequences

    def reset_buffers(self) -> None:
        """Called by `materialize` after `to_empty`: buffers are not drawn from names. They
        stay fp32 whatever the parameters' dtype (a bf16 count stops at 256)."""
        device, e = self.router.weight.device, self.cfg.num_experts
        self.router.expert_bias = torch.zeros(e, device=device)
        self.tokens_per_expert = torch.zeros(e, device=device)
        self.aux_sums = torch.zeros(3, device=device)

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_sums.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits, scores, expert_idx, weights = self.router(flat)
        if self.cfg.capacity_factor > 0:
            keep = capacity_mask(expert_idx, weights, s, self.cfg.num_experts,
                                 self.cfg.capacity_factor)
            weights = weights * keep
        out = self.dispatcher(flat, expert_idx, weights, self.experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        out = out.view(b, s, h)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self._weighted()):
            balance, z = self._losses(logits, scores, expert_idx, b, s)  # (else: metrics only)
        self._record(expert_idx, balance, z, b)
        total = self.cfg.aux_loss_coeff * balance + self.cfg.z_loss_coeff * z
        if torch.is_grad_enabled() and total.requires_grad:
            scale = self.aux_grad_scale if self.aux_grad_scale is not None else 1.0 / b
            out = AuxLossInjector.apply(out, total, scale)
        return out

    recomputed = False  # inside a checkpointed region (parallel/recompute.py marks it)

    def _recomputing(self) -> bool:
        """Whether this forward runs inside backward (a recomputation). A compiled layer
        outside any checkpoint never does, so its graph skips the question: dynamo cannot
        trace the graph task's id (a graph break per layer). Inside one, it asks (the break
        stays): a recomputation must run the graph its forward ran, which saves the same
        tensors (a graph of its own for recomputations failed torch's checkpoint: 34
        tensors saved against 36)."""
        if compiling() and not self.recomputed:
            return False
        return torch._C._current_graph_task_id() != -1

    def _weighted(self) -> bool:
        return self.cfg.aux_loss_coeff > 0 or self.cfg.z_loss_coeff > 0

    def _losses(self, logits, scores, expert_idx, b: int, s: int):
        """Sums over the b sequences of the per-sequence balance loss and z-loss (fp32)."""
        e, k = self.cfg.num_experts, self.cfg.experts_top_k
        counts = F.one_hot(expert_idx.view(b, -1), e).sum(1).float()  # [b, E]
        f = counts * (e / (k * s))
        probs = scores / scores.sum(-1, keepdim=True) if self.router.score_func == "sigmoid" \
            else scores
        p = probs.view(b, s, e).mean(1)
        balance = (f * p).sum()
        z = torch.logsumexp(logits, -1).pow(2).view(b, s).mean(1).sum()
        return balance, z

    @torch.no_grad()
    def _record(self, expert_idx, balance, z, b: int) -> None:
        # Skip eval forwards and full recomputation's second forward (it runs inside backward).
        if not self.training or self._recomputing():
            return
        self.tokens_per_expert += expert_counts(expert_idx, self.cfg.num_experts).float()
        self.aux_sums += torch.stack([balance.detach(), z.detach(),
                                      torch.tensor(float(b), device=z.device)])


def mark_recomputed(region: nn.Module) -> None:
    """The MoE layers of a checkpointed region: their forward may run again in backward."""
    for m in moe_layers(region):
        m.recomputed = True


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module, scale: float | None) -> None:
    """d(objective)/d(sum of the aux losses of one forward): loss_scale / global sequences."""
    for m in moe_layers(model):
        m.aux_grad_scale = scale


@torch.no_grad()
def update_expert_bias(layers: list[MoE], global_counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (Wang et al. 2024; DeepSeek-V3 §2.1.2): after each step,
    bias_i += rate · sign(mean load − load_i), from the token counts of the GLOBAL batch
    (`global_counts` [layers, E], all-reduced over dp×cp by the caller). The mean shift is
    removed (as torchtitan does) so the biases stay centred; selection depends only on
    differences, so this changes nothing but keeps the numbers small."""
    for layer, counts in zip(layers, global_counts):
        delta = rate * torch.sign(counts.mean() - counts)
        layer.router.expert_bias += delta - delta.mean()
