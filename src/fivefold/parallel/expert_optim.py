"""The optimizer under expert parallelism: dense weights over dp×cp, experts over edp.

A dense weight is held by every rank of dp×cp; an expert's weight only by the ranks of its
expert-data-parallel group edp (dp·cp/ep ranks, one per ep group). So the model's weights
split into two sets, each a `zero.DataParallelOptimizer` over its own group: its own flat
buffers, buckets, ZeRO shards (stages 1-3 shard expert states over edp) and gradient
reductions (plain sums: each micro-batch's loss is already divided by the global batch's
target tokens). One step clips both with one global norm:

    norm² = Σ dense (each element once)  +  Σ experts (each expert once)

ZeRO-1/2/3: dense shards are disjoint over dp×cp and expert shards over edp, with distinct
experts over ep, so one all-reduce of the summed partial squares over dp×cp counts every
element once. Stage 0: the dense gradient is whole on every rank and each ep rank holds
other experts, so the expert part is summed over ep. Then over tp and pp, as for a dense model.
"""

from __future__ import annotations

import torch

from fivefold.parallel import comm
from fivefold.parallel.data import BUCKETS_IN_FLIGHT
from fivefold.parallel.expert import is_expert_param
from fivefold.parallel.update import StepStats, clipped_step, finish_norm, probe_term
from fivefold.parallel.watchdog import Watchdog
from fivefold.parallel.zero import DataParallelOptimizer, optimizer_options


class ExpertParallelOptimizer:
    def __init__(self, named_params, dims, tr, scaler, stage: int = 0, offload: bool = False,
                 bucket_mb: float = 25.0, chunks=None, timeout_s: float = 300.0,
                 watchdog: Watchdog | None = None, buckets_in_flight: int = BUCKETS_IN_FLIGHT,
                 grad_sync: str = "step", nvme_dir: str | None = None, optim=None,
                 nvme_run: str | None = None):
        self.dims, self.tr, self.scaler, self.stage = dims, tr, scaler, stage
        self.owns_watchdog = watchdog is None
        self.watchdog = watchdog or Watchdog(timeout_s)
        common = dict(stage=stage, offload=offload, bucket_mb=bucket_mb, chunks=chunks,
                      watchdog=self.watchdog, buckets_in_flight=buckets_in_flight,
                      grad_sync=grad_sync, nvme_dir=nvme_dir, optim=optim, nvme_run=nvme_run)
        dense = [(n, p) for n, p in named_params if not is_expert_param(p)]
        experts = [(n, p) for n, p in named_params if is_expert_param(p)]
        self.dense = DataParallelOptimizer(dense, dims, tr, scaler, group="dp_cp", **common)
        # A pipeline stage without MoE layers holds no experts (nor do its edp peers, which
        # are in the same stage): it runs the dense part alone.
        self.experts = (DataParallelOptimizer(experts, dims, tr, scaler, group="edp", **common)
                        if experts else None)
        self.parts = [self.dense] + ([self.experts] if self.experts else [])

    # --- the trainer's interface --------------------------------------------------------
    def zero_grad(self) -> None:
        if self.owns_watchdog:
            self.watchdog.arm()
        for part in self.parts:
            part.zero_grad()

    def prepare_backward(self, final_microbatch: bool) -> None:
        for part in self.parts:
            part.prepare_backward(final_microbatch)

    def before_weight_pass(self, params) -> None:
        for part in self.parts:
            part.before_weight_pass(params)

    def finish_grad_sync(self) -> None:
        for part in self.parts:
            part.finish_grad_sync()

    def step(self, lr: float, loss: torch.Tensor | None = None) -> StepStats:
        grads = [part.bind_grads() for part in self.parts]
        stats = clipped_step([(part.optimizer, g) for part, g in zip(self.parts, grads)], lr,
                             self.tr, self.scaler, self.dims["world"], self._global_grad_norm,
                             loss)
        for part in self.parts:
            part.after_step(stats)
        if self.owns_watchdog:
            self.watchdog.disarm()
        return stats

    def _global_grad_norm(self, grads: list, loss=None) -> torch.Tensor:
        sq = self.dense.local_grad_sq(grads[0]) + probe_term(loss, self.dense.device)
        if self.experts is not None:
            expert_sq = self.experts.local_grad_sq(grads[1])
            if self.stage == 0:
                comm.all_reduce(expert_sq, self.dims["ep"])
            sq = sq + expert_sq
        if self.stage >= 1:
            comm.all_reduce(sq, self.dims["dp_cp"])
        for name in ("tp", "pp"):
            comm.all_reduce(sq, self.dims[name])
        return finish_norm(sq)  # reduced in float64, rounded once (update.squared_grad_norm)

    # --- checkpoints and accounting -----------------------------------------------------
    def param_states(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for part in self.parts:
            out.update(part.param_states())
        return out

    def shard_states(self, load: bool = False, convert_from: str | None = None) -> list[tuple]:
        return [piece for part in self.parts for piece in part.shard_states(load, convert_from)]

    def loaded(self, step: int) -> None:
        for part in self.parts:
            part.loaded(step)

    def peak_sources(self) -> dict:
        """Both parts' storages, by planner item (see `zero.DataParallelOptimizer`)."""
        sources = [part.peak_sources() for part in self.parts]
        return {item: (lambda item=item: [t for s in sources for t in s[item]()])
                for item in sources[0]}

    def step_count(self) -> int:
        return self.dense.step_count()

    def memory_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in self.parts:
            for key, value in part.memory_bytes().items():
                out[key] = out.get(key, 0) + value
        return out

    def close(self) -> None:
        for part in self.parts:
            part.reducer.remove_hooks()
            if part.gatherer is not None:
                part.gatherer.remove_hooks()
        self.watchdog.close()


def build_expert_parallel_optimizer(model, named_params, dims, cfg, scaler,
                                    watchdog: Watchdog | None = None) -> ExpertParallelOptimizer:
    return ExpertParallelOptimizer(named_params, dims, cfg.train, scaler,
                                   **optimizer_options(model, cfg, watchdog))
