"""Adafactor (`train.optimizer = adafactor`): a factored second moment, no first moment.

Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost"
(arXiv 1804.04235, Algorithms 4-5), as torch.optim.Adafactor computes it
(torch/optim/_adafactor.py `_single_tensor_adafactor`):

    β̂2 = 1 − t^beta2_decay        ρ = min(lr, 1/sqrt(t))   (relative step; else ρ = lr)
    α = max(ε2, RMS(W))·ρ          (relative step; else α = lr)
    W ← W·(1 − lr·λ)
    matrix:  R ← lerp(R, mean_cols(G²), β̂2)   C ← lerp(C, mean_rows(G²), β̂2)
             V̂ = R C / max(mean(R), ε1)       (over the last two dims)
    vector (or adafactor_factored = false):  V ← lerp(V, G², β̂2),  V̂ = V
    U = G / sqrt(max(V̂, ε1²));   W ← W − α / max(1, RMS(U)/d) · U

R and C hold rows + columns values per matrix instead of rows × columns. They need the whole
matrix's gradient, and α and the clipping need the whole weight's and update's RMS, so the
weight (relative step only) and then the gradient of every piece are gathered into their
logical tensors, one tensor at a time (`Assembler.each`: under ZeRO or TP a rank holds one
gathered tensor at a time, never a copy of the model); each rank keeps R, C (and V)
for the whole logical tensors it holds a piece of, identical on every such rank, and
updates its own piece: bit-identical to one device. The states are small for matrices; an
unfactored V is a whole copy per holding rank (ZeRO does not shard it).

Stacked expert weights ([E, A, B]) are one matrix per expert, as for Muon: R and C per expert
(torch's factoring over the last two dims already is), and α and the clipping from each
expert's own RMS, which is what torch's Adafactor computes for an expert kept as its own
A × B weight (torch would take one RMS over the whole stack). Under expert parallelism a rank
holds whole experts, so it keeps R, C (and V) of its own experts only (`held_shape`) and
computes what one device computes for them.
"""

from __future__ import annotations

import functools
import math

import torch

from fivefold.parallel.optim_base import Derived, PieceOptimizer


class Adafactor(PieceOptimizer):
    SHAPED_KEYS = ()  # what shaped_states may return

    def __init__(self, masters, infos, tr, oc, assembler=None):
        super().__init__(masters, infos, tr, assembler)
        self.oc = oc
        self.eps1 = oc.adafactor_eps1 or torch.finfo(torch.float32).eps
        for m in self.masters:
            self.reset_state(m)

    def factored(self, info) -> bool:
        return self.oc.adafactor_factored and len(info.logical_shape) >= 2

    def reset_state(self, master) -> None:
        info = self.info_of[id(master)]
        shape, device = info.held_shape, master.device
        if self.factored(info):
            self.state[master] = {"row_var": torch.zeros(*shape[:-1], 1, device=device),
                                  "col_var": torch.zeros(*shape[:-2], 1, shape[-1],
                                                         device=device)}
        else:
            self.state[master] = {"variance": torch.zeros(shape, device=device)}

    @torch.no_grad()
    def step(self, closure=None):
        # skipped by the host (SKIPS_ON_DEVICE stays False): the relative step and the
        # update's clipping read each matrix's norm on the host anyway (`_norms`)
        t, oc = self.begin_step(), self.oc
        infos = self.assembler_infos()
        plan = {self.info_of[id(m)].index: (m, group["lr"], group["weight_decay"])
                for group in self.param_groups for m in group["params"]}
        # Each whole tensor is gathered (a collective on every rank) and dropped before the
        # next: first the weights, whose RMS the relative step needs (before any update),
        # then the gradients, each updating its piece.
        weight_norms = {}
        if oc.adafactor_relative_step:
            weights = {i: m.view(-1) for i, (m, _, _) in plan.items()}
            for index, weight in self.assembler.each(weights, infos):
                info = self.info_of[id(plan[index][0])]
                stacked = len(info.matrix_shape) < len(info.logical_shape)
                weight_norms[index] = _norms(weight.float(), stacked)
                del weight
        grads = {i: functools.partial(self._flat_grad, m) for i, (m, _, _) in plan.items()}
        beta = t ** oc.adafactor_beta2_decay  # 1 − β̂2
        for index, whole in self.assembler.each(grads, infos):
            m, lr, wd = plan[index]
            info = self.info_of[id(m)]
            grad = whole.float()
            del whole
            st = self.state[m]
            stacked = len(info.matrix_shape) < len(info.logical_shape)
            if oc.adafactor_relative_step:
                rho = min(lr, 1 / t ** 0.5)
                alpha = [max(oc.adafactor_eps2, norm / (n ** 0.5)) * rho
                         for norm, n in weight_norms[index]]
            else:
                alpha = [lr] * (grad.size(0) if stacked else 1)
            if self.factored(info):
                row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(
                    grad.size(-1))
                st["row_var"].lerp_(row_mean, beta)
                col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(
                    grad.size(-2))
                st["col_var"].lerp_(col_mean, beta)
                estimate = st["row_var"] @ st["col_var"]
                estimate.div_(st["row_var"].mean(dim=-2, keepdim=True).clamp_(
                    min=self.eps1))
            else:
                st["variance"].lerp_(grad * grad, beta)
                estimate = st["variance"].clone()
            update = estimate.clamp_(min=self.eps1 * self.eps1).rsqrt_()
            update.mul_(grad)
            del grad, estimate
            p = m.view(-1)
            if wd != 0:
                p.mul_(1 - lr * wd)
            # torch's operations in its order, per matrix of a stack (bit-equal)
            scale = [-a / max(1.0, norm / ((n ** 0.5) * oc.adafactor_clip))
                     for a, (norm, n) in zip(alpha, _norms(update, stacked))]
            own = self.assembler.own(info, update).to(p.device)
            per = math.prod(info.param.shape[int(stacked):])  # local values per matrix
            for j in range(info.lo // per, -(-info.hi // per)):  # matrices in the piece
                a, b = max(info.lo, j * per) - info.lo, min(info.hi, (j + 1) * per) - info.lo
                p[a:b].add_(own[a:b], alpha=scale[j])
            del update, own

    def _flat_grad(self, master) -> torch.Tensor:
        """A piece's fp32 gradient, flat: one made at a time (optim_base.grad)."""
        grad = self.grad(master)
        return (grad if grad is not None else torch.zeros_like(master)).view(-1)

    def assembler_infos(self):
        return getattr(self, "all_infos", None) or self.infos

    # --- checkpoints: the whole logical state, replicated on every holding rank ------------
    def checkpoint_views(self, master, load, convert_from=None) -> dict:
        info, out = self.info_of[id(master)], {}
        ep_slice = getattr(info.param, "_ep_slice", None)
        for key, value in self.state[master].items():
            full = value.shape if ep_slice is None else (info.logical_shape[0],
                                                         *value.shape[1:])
            d = Derived(value.shape, full, None, 1)
            if ep_slice is not None:  # this rank's experts of the logical state
                d._ep_slice = ep_slice
            out[key] = (d, 0, value.numel(), value.view(-1))
        return out

    def shaped_states(self, master) -> dict[str, torch.Tensor]:
        """None: R, C and V are logical tensors already, not shaped like a local piece."""
        return {}


def _norms(x: torch.Tensor, stacked: bool) -> list[tuple[float, int]]:
    """(2-norm, values) of the whole tensor, or of each matrix of a stack (one at a time, as
    torch's Adafactor would take the norm of an expert kept as its own weight)."""
    mats = list(x) if stacked else [x]
    return [(m.norm(2).item(), m.numel()) for m in mats]
