"""Muon (`train.optimizer = muon`): momentum, then an orthogonalised step, for the hidden
matrices; AdamW for the rest.

Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024,
kellerjordan.github.io/posts/muon), as torch.optim.Muon (torch/optim/_muon.py) computes it:

    B ← lerp(B, G, 1 − μ)                         (an EMA, as torch's)
    U ← lerp(G, B, μ)  (Nesterov)  or  B
    O ← NS_k(U): X ← U/‖U‖_F in bf16 (or fp32), transposed when tall, k times
         A = X Xᵀ,  X ← aX + (bA + cA²)X           (a, b, c) = (3.4445, −4.7750, 2.0315)
    W ← W·(1 − lr·λ) − lr_adj · O

lr_adj = lr·0.2·sqrt(max(A, B)) ("match_rms_adamw", Liu et al. 2025, arXiv 2502.16982 §2.2:
the update's RMS matches AdamW's, so AdamW's lr and weight decay transfer) or
lr·sqrt(max(1, A/B)) ("original"). Stacked expert weights are one matrix per expert.

The orthogonalisation needs the whole matrix. The momentum is elementwise and stays sharded
(ZeRO) or sliced (TP); the Nesterov update U of each matrix is gathered whole, one matrix at
a time (`Assembler.each`: from its owners over the ZeRO ranks, then over tp), every rank
orthogonalises it, keeps its own piece and frees it before the next: the distributed Muon
of Liu et al. §2.3 (they gather on ZeRO-1 and compute on every rank, as here). A rank holds
one gathered matrix at a time, never a copy of the model. The result is bit-identical to
one device; the cost is the gather (P values per step) and NS on every rank
(2·k·(2·m²·n + m³) FLOPs per m×n matrix, m ≤ n: plan/optimizer.py). Orthogonalising each
tensor-parallel shard on its own instead would make a different, block-diagonal update.

Embeddings, the head, norms, biases and routers (`optim.muon_exclude`) go to a torch AdamW
(update.adamw, train.beta1/beta2/eps) whose lr is `optim.muon_adamw_lr` (0: train.lr),
scaled by the same schedule.
"""

from __future__ import annotations

import functools
import math

import torch

from fivefold.parallel.optim_base import PieceOptimizer
from fivefold.parallel.step_grads import step_torch
from fivefold.parallel.update import adamw


def takes(name: str, param: torch.Tensor, exclude: str) -> bool:
    """Whether Muon updates this parameter: a 2-D matrix (or stacked experts' matrices) whose
    name holds none of `exclude`'s comma-separated parts."""
    parts = [p.strip() for p in exclude.split(",") if p.strip()]
    return param.ndim in (2, 3) and not any(p in name for p in parts)


def newton_schulz(update: torch.Tensor, coefficients, steps: int, eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz's iteration, for one 2-D matrix.

    Each iteration applies p(s) = as + bs³ + cs⁵ to the singular values, and a change of X
    by at most max |p'| over their range (Noferini 2017, SIAM J. Matrix Anal. Appl. 38(2):
    the Fréchet derivative of a generalised matrix function is bounded by p's divided
    differences). Small singular values grow by a = 3.4445 per iteration (a^5 = 485), but
    p' reaches 3.96 at the largest iterate (s = 1.2), so k = 5 iterations can turn a
    relative input change ε into up to 851ε (tests/optimizer_bounds.py `ns_gain`): in bf16
    a last-bit change of the input (a gradient summed in another order) can move the result
    by 851·2^-8, in fp32 (`optim.muon_ns_dtype = fp32`) by 851·2^-24."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # not in place: x may be the momentum itself (fp32)
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str, shape) -> float:
    rows, cols = shape[:2]
    ratio = 0.2 * math.sqrt(max(rows, cols)) if how == "match_rms_adamw" else math.sqrt(
        max(1, rows / cols))
    return lr * ratio


class Muon(PieceOptimizer):
    SHAPED_KEYS = ("momentum", "exp_avg", "exp_avg_sq")  # what shaped_states may return

    def __init__(self, masters, infos, tr, oc, assembler=None):
        from fivefold.config.optim import ns_coefficients

        chosen = [takes(i.name, i.param, oc.muon_exclude) for i in infos]
        matrices = [(m, i) for m, i, c in zip(masters, infos, chosen) if c]
        super().__init__([m for m, _ in matrices], [i for _, i in matrices], tr, assembler)
        self.all_infos = infos  # the assembler indexes every piece of the owner
        self.oc = oc
        self.coefficients = ns_coefficients(oc.muon_ns_coefficients)
        self.ns_dtype = torch.float32 if oc.muon_ns_dtype == "fp32" else torch.bfloat16
        rest = [(m, i) for m, i, c in zip(masters, infos, chosen) if not c]
        ratio = oc.muon_adamw_lr / tr.lr if oc.muon_adamw_lr > 0 else 1.0
        self.adamw = None
        if rest:
            groups = [{"params": [m for m, i in rest if i.decay],
                       "weight_decay": tr.weight_decay},
                      {"params": [m for m, i in rest if not i.decay], "weight_decay": 0.0}]
            self.adamw = adamw([g for g in groups if g["params"]], tr, rest[0][0].device)
        self.adamw_ratio = ratio
        self.adamw_masters = [m for m, _ in rest]
        for m in self.masters:
            self.reset_state(m)

    def _takes(self, name: str, param: torch.Tensor) -> bool:
        return takes(name, param, self.oc.muon_exclude)

    def _update(self, master) -> torch.Tensor:
        """The piece's momentum step, then its (Nesterov) update: made once, when gathered."""
        mu = self.oc.muon_momentum
        grad = self.grad(master)  # one piece's fp32 copy at a time (optim_base.py)
        grad = grad.view(-1) if grad is not None else torch.zeros_like(master.view(-1))
        buf = self.state[master]["momentum"]
        if self.skip is None:
            buf.lerp_(grad, 1 - mu)
        else:  # the new momentum feeds this step's update; the state keeps the old if skipped
            new = buf.lerp(grad, 1 - mu)
            buf.copy_(self.kept(new, buf))
            buf = new
        return grad.lerp(buf, mu) if self.oc.muon_nesterov else buf

    def reset_state(self, master) -> None:
        self.state[master] = {"momentum": torch.zeros(master.numel(), device=master.device)}

    def adamw_reset(self) -> None:
        if self.adamw is not None:
            self.adamw.state.clear()

    def skips_on_device(self) -> bool:
        """The matrices' update selects (`kept`); the other parameters' AdamW skips by its
        fused kernel's found_inf, so only when it is fused."""
        return self.adamw is None or bool(self.adamw.defaults.get("fused"))

    @torch.no_grad()
    def step(self, closure=None):
        self.begin_step()
        oc = self.oc
        updates, plan = {}, {}
        for group in self.param_groups:
            for m in group["params"]:
                info = self.info_of[id(m)]
                updates[info.index] = functools.partial(self._update, m)  # made when gathered
                plan[info.index] = (m, group["lr"], group["weight_decay"])
        # one whole matrix at a time (a collective on every rank), dropped before the next
        for index, whole in self.assembler.each(updates, self.all_infos, self._takes):
            m, lr, wd = plan[index]
            info = self.info_of[id(m)]
            mats = whole.reshape(-1, *info.matrix_shape)
            ortho = torch.stack([newton_schulz(x, self.coefficients, oc.muon_ns_steps,
                                               dtype=self.ns_dtype)
                                 for x in mats]).view(whole.shape)
            del whole, mats
            own = self.assembler.own(info, ortho).to(m.device)
            p = m.view(-1)
            new = p if self.skip is None else p.clone()
            new.mul_(1 - lr * wd)
            new.add_(own, alpha=-adjusted_lr(lr, oc.muon_adjust_lr, info.matrix_shape))
            if self.skip is not None:
                p.copy_(self.kept(new, p))
            del ortho, own, new
        if self.adamw is not None:
            lr = self.param_groups[0]["lr"] * self.adamw_ratio
            for group in self.adamw.param_groups:
                group["lr"] = lr
            if self.found_inf is not None:  # its fused kernel skips by the flag
                self.adamw.found_inf = self.found_inf
            try:
                if self.grads is not None:  # a chunk of the owner's fp32 copies at a time
                    step_torch(self.adamw, self.grads)
                else:
                    self.adamw.step()
            finally:
                if self.found_inf is not None:
                    del self.adamw.found_inf

    # --- checkpoints ----------------------------------------------------------------------
    def owns(self, master) -> bool:
        return id(master) in self.info_of

    def checkpoint_views(self, master, load, convert_from=None) -> dict:
        if self.owns(master):
            return {"momentum": self.state[master]["momentum"]}
        state = self.adamw.state.get(master, {}) if self.adamw is not None else {}
        if load or "exp_avg" not in state:
            state = {"exp_avg": torch.zeros(master.numel(), device=master.device),
                     "exp_avg_sq": torch.zeros(master.numel(), device=master.device)}
            if load:
                self.converting[id(master)] = state
        return {"exp_avg": state["exp_avg"].view(-1), "exp_avg_sq": state["exp_avg_sq"].view(-1)}

    def loaded(self, step: int) -> None:
        if self.adamw is not None:
            fused = self.adamw.defaults.get("fused")
            for m in self.adamw_masters:
                self.adamw.state.pop(m, None)
                temp = self.converting.get(id(m))
                if temp is not None and step > 0:
                    self.adamw.state[m] = {
                        "step": torch.tensor(float(step), device=m.device if fused else "cpu"),
                        "exp_avg": temp["exp_avg"].view(m.shape),
                        "exp_avg_sq": temp["exp_avg_sq"].view(m.shape)}
        super().loaded(step)

    def shaped_states(self, master) -> dict[str, torch.Tensor]:
        views = self.checkpoint_views(master, load=False)
        self.converting = {}
        shape = master.shape
        return {k: v.view(shape).clone() for k, v in views.items()}

    def state_tensors(self) -> list[torch.Tensor]:
        out = [st["momentum"] for st in self.state.values()]
        if self.adamw is not None:
            out += [s for st in self.adamw.state.values() for k, s in st.items()
                    if k in ("exp_avg", "exp_avg_sq")]
        return out
