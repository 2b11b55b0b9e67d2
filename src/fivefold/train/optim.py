"""Learning-rate schedules and the single-replica optimizer with master weights.

`MasterWeightOptimizer` is the single-replica optimizer (no data parallelism, or plain data
parallelism whose gradients were already summed): it keeps fp32 master weights when the model
computes in bf16/fp16, unscales fp16 gradients, computes the exact global gradient norm across
tensor- and pipeline-parallel ranks, clips, steps AdamW and copies the result back into the
model. The update itself (decay groups, norm shares, AdamW, `clipped_step`) lives in
`parallel/update.py`, shared with the DP/ZeRO optimizers of `parallel/zero.py`, which keep
this interface.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fivefold.errors import ConfigError
from fivefold.parallel import comm
from fivefold.parallel.buffers import storage_bytes
from fivefold.parallel.step_grads import StepGrads
from fivefold.parallel.update import (  # noqa: F401  (re-exported)
    StepStats,
    adamw,
    clipped_step,
    decays,
    finish_norm,
    norm_share,
    probe_term,
    squared_grad_norm,
)


def lr_at(step: int, tr) -> float:
    """Learning rate for optimizer step `step` (0-based) under train config `tr`.

    Linear warmup (train.warmup_steps, at most a tenth of the run) up to lr, then: cosine
    (Loshchilov & Hutter 2017) or linear decay to min_lr over the remaining steps, or WSD —
    warmup, stable at lr, then a linear decay over the last `decay_fraction` of the steps
    (Hu et al. 2024, MiniCPM) — or constant. Every decay ends exactly at min_lr on the last
    step, steps − 1.
    """
    warmup = min(tr.warmup_steps, tr.steps // 10)
    if warmup and step < warmup:
        return tr.lr * (step + 1) / warmup
    if tr.lr_schedule == "constant":
        return tr.lr
    # Steps warmup … steps − 1 span steps − 1 − warmup intervals: progress 0 → 1 over them.
    progress = min((step - warmup) / max(tr.steps - 1 - warmup, 1), 1.0)
    if tr.lr_schedule == "cosine":
        return tr.min_lr + 0.5 * (tr.lr - tr.min_lr) * (1 + math.cos(math.pi * progress))
    if tr.lr_schedule == "linear":
        return tr.lr + (tr.min_lr - tr.lr) * progress
    decay_steps = max(int(round(tr.steps * tr.decay_fraction)), 1)
    decay_start = tr.steps - decay_steps
    if step < decay_start:
        return tr.lr
    return tr.lr + (tr.min_lr - tr.lr) * min((step - decay_start + 1) / decay_steps, 1.0)


class MasterWeightOptimizer:
    """AdamW over fp32 master weights (or over the parameters themselves in fp32)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], tr, dims, scaler,
                 optim=None):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.dims, self.tr, self.scaler = dims, tr, scaler
        self.mixed = self.params[0].dtype != torch.float32
        if self.mixed:
            self.master = [p.detach().float().clone() for p in self.params]
        else:
            self.master = self.params
        self.own_rule = getattr(tr, "optimizer", "adamw") != "adamw"  # optim_base.py
        if self.own_rule:
            self.optimizer = self._piece_optimizer(named_params, optim)
        else:
            groups = [
                {"params": [m for n, p, m in zip(self.names, self.params, self.master)
                            if decays(n, p)], "weight_decay": tr.weight_decay},
                {"params": [m for n, p, m in zip(self.names, self.params, self.master)
                            if not decays(n, p)], "weight_decay": 0.0},
            ]
            self.optimizer = adamw([g for g in groups if g["params"]], tr,
                                   self.params[0].device)
        # on the device once, here: the norm multiplies by them every step without a copy
        self.shares = torch.tensor([norm_share(p, dims.tp) for p in self.params],
                                   dtype=torch.float64, device=self.params[0].device)
        self.step_grads: StepGrads | None = None  # during a step: its fp32 gradients

    def _piece_optimizer(self, named_params, optim):
        """fivefold's own rule over whole local tensors (pieces = parameters)."""
        from fivefold.config.optim import OptimSection
        from fivefold.parallel.optim_base import PieceInfo
        from fivefold.parallel.optimizers import build_piece_optimizer, check_muon_matrices

        optim = optim or OptimSection()
        if self.tr.optimizer == "muon":
            check_muon_matrices(named_params, optim)
        infos = [PieceInfo(i, n, p, 0, p.numel(), decays(n, p))
                 for i, (n, p) in enumerate(named_params)]
        assembler = TensorParallelAssembler(self.dims) if self.dims.tp > 1 else None
        return build_piece_optimizer(self.tr.optimizer, self.master, infos, self.tr, optim,
                                     assembler)

    # --- the interface the trainer uses -------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def prepare_backward(self, final_microbatch: bool) -> None:
        """Nothing to do without data parallelism (ZeRO and DP reduce on the final one)."""

    def before_weight_pass(self, params: list[nn.Parameter]) -> None:
        """Nothing to gather: every weight is whole here."""

    def finish_grad_sync(self) -> None:
        """Nothing to wait for without data parallelism."""

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def global_grad_norm(self, grads: list[StepGrads], loss=None) -> torch.Tensor:
        """sqrt of the sum of squares over every logical element, each counted once (NaN if
        any rank's `loss` is not finite: `probe_term`)."""
        sq = squared_grad_norm(grads[0], self.shares, grads[0].device)  # float64
        sq += probe_term(loss, sq.device)
        for name in ("tp", "pp"):
            comm.all_reduce(sq, self.dims[name])
        return finish_norm(sq)

    def step(self, lr: float, loss: torch.Tensor | None = None) -> StepStats:
        """With fp32 masters each parameter's fp32 gradient is made where the step uses it
        (parallel/step_grads.py), never all at once; in fp32 the gradients are the `.grad`."""
        grads = self._grads()
        self.step_grads = StepGrads(grads, self.params[0].device, self.mixed, self.master,
                                    self.params if self.mixed else None)
        if not self.mixed:
            self.step_grads.bind()
        step_grads = self.step_grads
        try:
            stats = clipped_step([(self.optimizer, step_grads)], lr, self.tr,
                                 self.scaler, self.dims["world"], self.global_grad_norm, loss)
        finally:
            self.step_grads = None
        # a step skipped on the device (`update.skips_on_device`) left the masters as they
        # were: copying them gives the parameters the values they hold (bf16/fp16 of them);
        # those the update wrote itself (parallel/adamw_kernel.py) are not copied again
        if self.mixed and stats.found is not True:
            rest = [i for i in range(len(self.params)) if i not in step_grads.written]
            if rest:
                with torch.no_grad():
                    torch._foreach_copy_([self.params[i] for i in rest],
                                         [self.master[i] for i in rest])
        return stats

    # --- checkpoints and accounting -----------------------------------------------------
    def param_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per parameter (by name, in its local tensor-parallel shape): the model's weight
        ("param", in the compute dtype), fp32 "master", "exp_avg" and "exp_avg_sq"."""
        out = {}
        for name, p, master in zip(self.names, self.params, self.master):
            entry = {"param": p.detach(), "master": master.detach()}
            if self.own_rule:
                out[name] = {**entry, **self.optimizer.shaped_states(master)}
                continue
            state = self.optimizer.state.get(master, {})
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = state[key] if key in state else torch.zeros_like(master)
            out[name] = entry
        return out

    def shard_states(self, load: bool = False, convert_from: str | None = None) -> list[tuple]:
        """(name, parameter, 0, numel, {key: flat view}) per parameter: the whole local tensor
        and its optimizer state, as views. For a load the views are filled in place, then
        `loaded(step)` installs them (in fp32 the master *is* the parameter: read once).
        fivefold's own optimizers name their states (optim_base.py): a view may then be a
        (descriptor, lo, hi, flat) of a state shaped unlike the parameter."""
        if self.own_rule:
            return self._own_shard_states(load, convert_from)
        out, self._loading = [], []
        for name, p, master in zip(self.names, self.params, self.master):
            state = self.optimizer.state.get(master, {})
            if load or "exp_avg" not in state:
                moments = (torch.zeros_like(master), torch.zeros_like(master))
            else:
                moments = (state["exp_avg"], state["exp_avg_sq"])
            if load:
                self._loading.append(moments)
            views = {"param": p.detach().view(-1), "master": master.detach().view(-1),
                     "exp_avg": moments[0].view(-1), "exp_avg_sq": moments[1].view(-1)}
            if load and not self.mixed:
                del views["param"]
            out.append((name, p, 0, p.numel(), views))
        return out

    def _own_shard_states(self, load: bool, convert_from: str | None) -> list[tuple]:
        out = []
        for name, p, master in zip(self.names, self.params, self.master):
            views = {"param": p.detach().view(-1), "master": master.detach().view(-1),
                     **self.optimizer.checkpoint_views(master, load, convert_from)}
            if load and not self.mixed:
                del views["param"]
            out.append((name, p, 0, p.numel(), views))
        return out

    def loaded(self, step: int) -> None:
        """The views of `shard_states(load=True)` are filled: make them the optimizer's."""
        if self.own_rule:
            return self.optimizer.loaded(step)
        fused = self.optimizer.defaults.get("fused")
        step_device = self.master[0].device if fused else torch.device("cpu")
        for master, (avg, avg_sq) in zip(self.master, self._loading):
            self.optimizer.state.pop(master, None)
            if step > 0:
                self.optimizer.state[master] = {
                    "step": torch.tensor(float(step), device=step_device),
                    "exp_avg": avg, "exp_avg_sq": avg_sq}
        self._loading = []

    def step_count(self) -> int:
        if self.own_rule:
            return self.optimizer.steps_taken()
        for state in self.optimizer.state.values():
            return int(state["step"])
        return 0

    def peak_sources(self) -> dict:
        """What this rank holds, by planner item, for a `parallel.peak.PeakTracker`."""
        return {
            "params": lambda: self.params,
            "grads": lambda: [*(p.grad for p in self.params),
                              *(self.step_grads.live_tensors() if self.step_grads else [])],
            "master": lambda: self.master if self.mixed else [],
            "optimizer": self._state_tensors,
            "comm_buffers": self._gathered}

    def _gathered(self) -> list[torch.Tensor]:
        """The whole tensor-parallel matrix the optimizer holds gathered now, if any."""
        return list(getattr(getattr(self.optimizer, "assembler", None), "live", ()))

    def _state_tensors(self) -> list[torch.Tensor]:
        if self.own_rule:
            return self.optimizer.state_tensors()
        return [s for st in self.optimizer.state.values() for k, s in st.items()
                if k in ("exp_avg", "exp_avg_sq")]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per rank, counted from the tensors' storages (views of one once)."""
        size = storage_bytes
        states = self._state_tensors()
        return {
            "params": size(self.params),
            "grads": size([p.grad for p in self.params if p.grad is not None]),
            "master": size(self.master) if self.mixed else 0,
            "optimizer": size(states),
        }


class TensorParallelAssembler:
    """Whole logical tensors from tensor-parallel slices (shards.full_tensor) and back, one
    at a time (optim_base.Assembler.each): a rank holds one gathered tensor at a time."""

    def __init__(self, dims):
        self.dims = dims
        self.live: list[torch.Tensor] = []

    def each(self, values, infos, wanted=None):
        from fivefold.parallel import peak
        from fivefold.parallel.optim_base import made
        from fivefold.parallel.shards import full_tensor

        # every tp rank holds the same tensors and passes the same ones, in the same order
        for i, v in values.items():
            local = made(v).view(infos[i].param.shape)
            whole = full_tensor(infos[i].param, local, self.dims)
            del local
            if whole.shape != infos[i].param.shape:  # gathered (else the piece itself)
                self.live = [whole]
                peak.sample("optimizer gather")
            yield i, whole
            del whole
            self.live = []

    def own(self, info, full):
        from fivefold.parallel.shards import local_piece

        return local_piece(info.param, full).reshape(-1)[info.lo:info.hi]


def resume_conversion(meta: dict, cfg, path) -> str | None:
    """The optimizer whose states the checkpoint holds, when this run's differs and the
    difference has a conversion (adamw -> adamw8bit/adamw4bit: its moments are quantised);
    another optimizer is a one-line ConfigError. None: the same optimizer."""
    saved = meta.get("config", {}).get("train", {}).get("optimizer", "adamw")
    wanted = cfg.train.optimizer
    if saved == wanted:
        return None
    if saved == "adamw" and wanted in ("adamw8bit", "adamw4bit"):
        return saved
    raise ConfigError(f"checkpoint {path} holds train.optimizer = {saved} states, but this "
                      f"run asks for {wanted}; resume with {saved} (only adamw -> adamw8bit "
                      f"or adamw4bit converts) or start a new checkpoint.dir")
