"""The data-parallel optimizer: DP (stage 0) and ZeRO stages 1, 2, 3, with CPU offload.

Bytes per parameter held on each of N ranks in bf16 (Rajbhandari et al. 2020, "ZeRO", §5,
Figure 1, with K = 12: fp32 master 4 + Adam moments 4 + 4):

    stage 0   2 + 2 + 12        params, grads, master + Adam: everything replicated
    stage 1   2 + 2 + 12/N      master weights and Adam moments sharded
    stage 2   2 + (2 + 12)/N    gradients sharded too (full only per bucket in flight)
    stage 3   (2 + 2 + 12)/N    parameters sharded too (full only per block in use)

plus the padding that makes every bucket divisible by N (under N elements per bucket).
In fp32 the master *is* the parameter (0 extra bytes) unless offloaded.

Communication per step, per rank, in elements of the model (P, padded), on `dp_cp`:

    stage 0     all-reduce P (one call per bucket)
    stage 1, 2  reduce-scatter P + all-gather P (one call per bucket each)
    stage 3     all-gather 2P per micro-batch (forward, backward) + reduce-scatter P
    stages 1-3  one extra all-reduce of 1 float64: the squared gradient norm of the shards

Offload (ZeRO-Offload, Ren et al. 2021): fp32 master weights and Adam moments live on the
CPU and the AdamW step runs there; the reduced gradient shard goes down, the updated
compute-dtype parameters come back. On a CPU-only machine it changes where nothing lives,
but takes the same path: a separate fp32 master copy, a copied fp32 gradient (made a piece
at a time where the step uses it, `step_grads.StepGrads`, never the whole shard at once).

The optimizer keeps `MasterWeightOptimizer`'s interface (train/optim.py) and its update
(`update.clipped_step`).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config.parallel import offload_value
from fivefold.parallel import comm, peak
from fivefold.parallel.buffers import FlatLayout, bucket_groups, storage_bytes
from fivefold.parallel.data import BUCKETS_IN_FLIGHT, GradReducer
from fivefold.parallel.nvme import run_tag
from fivefold.parallel.step_grads import StepGrads
from fivefold.parallel.update import (
    StepStats,
    adamw,
    clipped_step,
    decays,
    finish_norm,
    norm_share,
    probe_term,
    squared_grad_norm,
)
from fivefold.parallel.watchdog import Watchdog


class DataParallelOptimizer:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], dims, tr, scaler,
                 stage: int = 0, offload: bool = False, bucket_mb: float = 25.0,
                 chunks: list[nn.Module] | None = None, timeout_s: float = 300.0,
                 watchdog: Watchdog | None = None, buckets_in_flight: int = BUCKETS_IN_FLIGHT,
                 group: str = "dp_cp", grad_sync: str = "step", nvme_dir: str | None = None,
                 optim=None, nvme_run: str | None = None):
        self.nvme_run, self.group_name = nvme_run, group  # names the offload directories
        self.optim = optim  # [optim]: the keys of a rule other than AdamW (zero_rules.py)
        self.own_rule = getattr(tr, "optimizer", "adamw") != "adamw"
        self.dims, self.tr, self.scaler, self.stage, self.offload = dims, tr, scaler, stage, offload
        self.nvme_dir = nvme_dir  # offload = "nvme": the states stream from files (nvme.py)
        self.group = dims[group]  # the ranks holding these weights: dp_cp, or edp for experts
        self.names = [n for n, _ in named_params]
        params = [p for _, p in named_params]
        self.dtype, self.device = params[0].dtype, params[0].device
        # The trainer owns the run's watchdog and arms it around the whole step; used on its
        # own (tests, benchmarks), the optimizer keeps one and arms it around its part.
        self.owns_watchdog = watchdog is None
        self.watchdog = watchdog or Watchdog(timeout_s)
        shards = self.group.size if stage >= 1 else 1
        self.rank = self.group.rank if shards > 1 else 0
        if stage == 3:
            from fivefold.parallel.zero3 import zero3_units

            groups, units = zero3_units(chunks, named_params)
        else:
            groups = bucket_groups(named_params, bucket_mb * 1e6, params[0].element_size())
        from fivefold.parallel.optimizers import layout_alignment

        self.layout = FlatLayout(named_params, groups, shards,
                                 layout_alignment(getattr(tr, "optimizer", "adamw")))
        self.pieces = self.layout.pieces(self.rank)
        self.gatherer = None
        if stage == 3:
            from fivefold.parallel.zero3 import ParamGatherer

            self.gatherer = ParamGatherer(self.layout, units, self.group, self.dtype,
                                          self.device, self.watchdog)
            self.param_flat = None
        else:
            self.param_flat = self._bind_params()
        self.frozen = None  # a frozen base's block weights, sharded too (LoRA, QLoRA)
        if stage == 3:
            from fivefold.parallel.zero3_frozen import frozen_gatherer

            self.frozen = frozen_gatherer(units, self.group, self.device, self.watchdog)
        order = self.gatherer.backward_order() if self.gatherer is not None else None
        self.reducer = GradReducer(self.layout, self.group, stage, self.dtype, self.device,
                                   self.watchdog, order, buckets_in_flight, grad_sync)
        if self.gatherer is not None:
            self.reducer.segment_done.append(self.gatherer.free)
        self.step_grads: StepGrads | None = None  # during a step: its fp32 gradients
        self._build_states()

    def _bind_params(self) -> torch.Tensor:
        """Move every parameter into one flat buffer; its .data becomes a view of it."""
        flat = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, slot in enumerate(self.layout.params):
                view = self.layout.view(flat, i)
                view.copy_(slot.param.detach())
                slot.param.data = view
        return flat

    def _build_states(self) -> None:
        """fp32 master pieces and Adam moments over this rank's flat shard."""
        if self.nvme_dir is not None:
            return self._build_nvme_states()
        shard_numel = self.layout.total // self.layout.shards
        self.state_device = torch.device("cpu") if self.offload else self.device
        self.separate_master = self.dtype != torch.float32 or self.offload
        pin = self.offload and self.device.type == "cuda"
        if self.separate_master:
            self.master_flat = torch.zeros(shard_numel, dtype=torch.float32,
                                           device=self.state_device, pin_memory=pin)
            self.master_flat.copy_(self._param_shard_flat())
            source, by_flat = self.master_flat, False
        else:  # fp32 on the device: the master is the parameter itself
            self.master_flat = None
            source = self.gatherer.shard if self.gatherer is not None else self.param_flat
            by_flat = self.gatherer is None
        self.master_pieces = []
        for pc in self.pieces:
            at = pc.flat if by_flat else pc.shard
            self.master_pieces.append(source[at:at + pc.hi - pc.lo])
        if self.own_rule:  # its states per piece (zero_rules.py)
            from fivefold.parallel.zero_rules import build_rule

            self.exp_avg = self.exp_avg_sq = None
            self.optimizer = build_rule(self, self.optim)
            return self._build_shares()
        self.exp_avg = torch.zeros(shard_numel, dtype=torch.float32, device=self.state_device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        decay, no_decay = [], []
        for pc, m in zip(self.pieces, self.master_pieces):
            slot = self.layout.params[pc.slot]
            (decay if decays(slot.name, slot.param) else no_decay).append(m)
        groups = [{"params": decay, "weight_decay": self.tr.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = adamw([g for g in groups if g["params"]], self.tr, self.state_device)
        self._reset_moments(step=0)
        self._build_shares()

    def _build_shares(self) -> None:
        self.shares = torch.tensor([norm_share(self.layout.params[pc.slot].param,
                                               self.dims.tp) for pc in self.pieces],
                                   dtype=torch.float32, device=self.state_device)

    def _build_nvme_states(self) -> None:
        """The master and moments in files under offload_dir, streamed by `NvmeAdamW`."""
        from fivefold.parallel.nvme import NvmeAdamW

        self.state_device, self.separate_master = torch.device("cpu"), True
        self.master_flat = self.exp_avg = self.exp_avg_sq = None
        self.master_pieces, self.loading = [], None
        self.optimizer = NvmeAdamW(self, self.nvme_dir)
        self._build_shares()

    def _state_flats(self, load: bool) -> tuple:
        """(master, exp_avg, exp_avg_sq) flat shards: resident, or read from the offload
        files (for a load: fresh buffers, written to the files by `loaded`)."""
        if self.nvme_dir is None:
            return self.master_flat, self.exp_avg, self.exp_avg_sq
        if load:
            numel = self.layout.total // self.layout.shards
            self.loading = {k: torch.zeros(numel) for k in ("master", "exp_avg", "exp_avg_sq")}
            flats = self.loading
        else:
            flats = self.optimizer.read_states()
        return flats["master"], flats["exp_avg"], flats["exp_avg_sq"]

    def _reset_moments(self, step: int) -> None:
        if self.nvme_dir is not None:
            self.optimizer.load_states(self.loading, step)
            self.loading = None
            return
        # Adam's moments are views of two flat buffers: torch's AdamW initialises a state
        # only when it is empty, so filling it here keeps the storage flat and countable.
        # Fused AdamW (CUDA) reads its step counters on the device; foreach keeps them on CPU.
        fused = self.optimizer.defaults.get("fused")
        for pc, m in zip(self.pieces, self.master_pieces):
            n = pc.hi - pc.lo
            self.optimizer.state[m] = {
                "step": torch.tensor(float(step), device=m.device if fused else "cpu"),
                "exp_avg": self.exp_avg[pc.shard:pc.shard + n],
                "exp_avg_sq": self.exp_avg_sq[pc.shard:pc.shard + n]}

    def _param_shard_flat(self) -> torch.Tensor:
        """This rank's owned parameter values, as one flat tensor in shard order."""
        if self.gatherer is not None:
            return self.gatherer.shard
        return torch.cat([self.param_flat[slice(*seg.owned(self.rank, self.layout.shards))]
                          for seg in self.layout.segments])

    # --- the interface the trainer uses -------------------------------------------------
    def zero_grad(self) -> None:
        if self.owns_watchdog:  # a training step starts: from here a silent peer is lost
            self.watchdog.arm()
        self.reducer.zero_grad()
        if self.gatherer is not None:  # FP8 all-gather: scales from this step's weights
            self.gatherer.weights_changed()

    def prepare_backward(self, final_microbatch: bool) -> None:
        self.reducer.prepare_backward(final_microbatch)

    def before_weight_pass(self, params: list[nn.Parameter]) -> None:
        """A split backward's W is about to accumulate these parameters' gradients."""
        if self.gatherer is not None:
            self.gatherer.ensure_params(params)

    def finish_grad_sync(self) -> None:
        self.reducer.finish()
        if self.gatherer is not None:
            self.gatherer.free_all()
        if self.frozen is not None:
            self.frozen.free_all()

    def step(self, lr: float, loss: torch.Tensor | None = None) -> StepStats:
        grads = self.bind_grads()
        stats = clipped_step([(self.optimizer, grads)], lr, self.tr, self.scaler,
                             self.dims["world"], self._global_grad_norm, loss)
        self.after_step(stats)
        return stats

    def bind_grads(self) -> StepGrads:
        """The reduced gradients of this rank's pieces for the step. With a separate fp32
        master each piece's fp32 copy is made where it is used (step_grads.py), never all at
        once; without, the reduced fp32 gradients are the masters' `.grad`."""
        self.step_grads = StepGrads(self.reducer.owned_grads(self.pieces), self.state_device,
                                    self.separate_master, self.master_pieces)
        if not self.separate_master:
            self.step_grads.bind()
        peak.sample("optimizer step")
        return self.step_grads

    def after_step(self, stats: StepStats) -> None:
        for m in self.master_pieces:
            m.grad = None
        self.step_grads = None
        # a step skipped on the device left the masters as they were: publishing them again
        # gives the parameters the values they hold (nvme: the step wrote the parameters)
        if stats.found is not True:
            self._publish_params(from_master=self.nvme_dir is None)
        self._disarm()

    def _disarm(self) -> None:
        if self.owns_watchdog:
            self.watchdog.disarm()

    def _global_grad_norm(self, grads: list[StepGrads], loss=None) -> torch.Tensor:
        """sqrt(sum of squares), every logical element counted once: ZeRO shards are
        disjoint (summed over dp_cp); tp/pp replicas carry `norm_share` (train/optim.py)."""
        sq = self.local_grad_sq(grads[0]) + probe_term(loss, self.device)  # NaN: bad loss
        # Waited through the watchdog like every other collective of the step, so that a peer
        # lost as the optimizer step begins is named (exit 3), not reported as a bare error.
        groups = [self.dims["tp"], self.dims["pp"]]
        if self.layout.shards > 1:
            groups.insert(0, self.group)
        for group in groups:
            self.watchdog.wait(comm.all_reduce(sq, group, async_op=True),
                               "gradient-norm all-reduce")
        return finish_norm(sq)  # reduced in float64, rounded once (update.squared_grad_norm)

    def local_grad_sq(self, grads: StepGrads) -> torch.Tensor:
        """This rank's share of the squared gradient norm, before any reduction."""
        return squared_grad_norm(grads, self.shares, self.device,
                                 [pc.lo for pc in self.pieces])

    def _publish_params(self, from_master: bool = True) -> None:
        """Copy the updated master into the parameters; ZeRO-1/2 then all-gather them."""
        with torch.no_grad():
            if self.gatherer is not None:
                if self.separate_master and from_master:
                    self.gatherer.shard.copy_(self.master_flat, non_blocking=True)
                self.gatherer.weights_changed()
                return  # gathered at the next forward
            handles = []
            for seg in self.layout.segments:
                lo, hi = seg.owned(self.rank, self.layout.shards)
                owned = self.param_flat[lo:hi]
                if self.separate_master and from_master:
                    owned.copy_(self.layout.segment_shard(self.master_flat, seg))
                if self.layout.shards > 1:  # in place: our range is already where it belongs
                    full = self.param_flat[seg.start:seg.start + seg.size]
                    handles.append(comm.all_gather(full, owned, self.group, async_op=True))
            for h in handles:
                self.watchdog.wait(h, "ZeRO parameter all-gather")

    # --- checkpoints and accounting -----------------------------------------------------
    def shard_states(self, load: bool = False, convert_from: str | None = None) -> list[tuple]:
        """(name, parameter, lo, hi, {key: flat view}) for each piece this rank owns: the
        elements [lo, hi) of the flattened local parameter, its fp32 master and Adam moments,
        as views of the flat shards (nothing gathered, nothing copied). A load fills them in
        place and then calls `loaded(step)`. In fp32 the master *is* the parameter: a load
        reads it once, from the master. A rule of fivefold's own names its states itself
        (zero_rules.shard_views)."""
        if self.own_rule:
            from fivefold.parallel.zero_rules import shard_views

            return shard_views(self, load, convert_from)
        params = self.gatherer.shard if self.gatherer is not None else self.param_flat
        master, avg, avg_sq = self._state_flats(load)
        out = []
        for pc in self.pieces:
            n = pc.hi - pc.lo
            at = pc.shard if self.gatherer is not None else pc.flat
            views = {"param": params[at:at + n]}
            views["master"] = (master[pc.shard:pc.shard + n] if self.separate_master
                               else views["param"])
            views["exp_avg"] = avg[pc.shard:pc.shard + n]
            views["exp_avg_sq"] = avg_sq[pc.shard:pc.shard + n]
            if load and not self.separate_master:
                del views["param"]
            slot = self.layout.params[pc.slot]
            out.append((slot.name, slot.param, pc.lo, pc.hi, views))
        return out

    def loaded(self, step: int) -> None:
        """The owned pieces are filled: gather the parameters' other ranges (ZeRO-1/2 keep
        whole parameters; ZeRO-3 gathers at the next forward) and restore the moments."""
        self._publish_params(from_master=False)
        if self.own_rule:
            return self.optimizer.loaded(step)
        self._reset_moments(step)

    def _full_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """Gather a flat shard (this rank's) into the full flat tensor, on the device."""
        shard = shard.to(self.device)
        if self.layout.shards == 1:
            return shard
        full = torch.empty(self.layout.total, dtype=shard.dtype, device=self.device)
        for seg in self.layout.segments:
            comm.all_gather(full[seg.start:seg.start + seg.size],
                            self.layout.segment_shard(shard, seg), self.group)
        return full

    def param_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's full local state, gathered onto every rank: for tests and
        comparisons only (checkpoints use `shard_states`, which gathers nothing)."""
        param_full = self.param_flat if self.gatherer is None else self._full_flat(
            self.gatherer.shard)
        if self.own_rule:
            from fivefold.parallel.zero_rules import gathered_states

            master = self.master_flat if self.separate_master else None
            states = gathered_states(self)
        else:
            master, avg, avg_sq = self._state_flats(load=False)
            states = {"exp_avg": self._full_flat(avg), "exp_avg_sq": self._full_flat(avg_sq)}
        master_full = self._full_flat(master) if self.separate_master else param_full
        out = {}
        for i, slot in enumerate(self.layout.params):
            out[slot.name] = {
                "param": self.layout.view(param_full, i).detach().clone(),
                "master": self.layout.view(master_full, i).float().clone(),
                **{k: self.layout.view(v, i).clone() for k, v in states.items()}}
        return out

    def step_count(self) -> int:
        if self.own_rule:
            return self.optimizer.steps_taken()
        if self.nvme_dir is not None:
            return self.optimizer.step_count
        for state in self.optimizer.state.values():
            return int(state["step"])
        return 0

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held on this rank, counted from the storages (views of a buffer once)."""
        params = ([self.param_flat] if self.gatherer is None
                  else self.gatherer.gathered_tensors())
        if self.frozen is not None:  # the frozen base's shard (its blocks' views are freed)
            params = [*params, *self.frozen.gathered_tensors()]
        return {"params": storage_bytes(params),
                "grads": storage_bytes(self.reducer.tensors()),
                "master": storage_bytes([self.master_flat]),
                "optimizer": storage_bytes(self._resident_moments())}

    def _resident_moments(self) -> list[torch.Tensor]:
        """Adam's moments as held in memory: the flat buffers, or nvme's staging slots."""
        if self.nvme_dir is not None:
            return self.optimizer.store.staging()
        if self.own_rule:
            return self.optimizer.state_tensors()
        return [self.exp_avg, self.exp_avg_sq]

    def peak_sources(self) -> dict[str, peak.Source]:
        """What this rank holds, by planner item, for a `peak.PeakTracker`."""
        reducer, gatherer = self.reducer, self.gatherer
        frozen = [] if self.frozen is None else [self.frozen.shard]

        def grad_buffer():  # ZeRO-2/3: .grad accumulating whole over the micro-batches
            return [] if reducer.keep_full else [s.param.grad for s in self.layout.params]

        return {
            "params": lambda: [self.param_flat if gatherer is None else gatherer.shard,
                               *frozen],
            "grads": lambda: [reducer.grad_buffer, reducer.grad_shard,
                              *(m.grad for m in self.master_pieces), *self._step_copies()],
            "master": lambda: [self.master_flat],
            "optimizer": self._resident_moments,
            "grad_buffer": grad_buffer,
            "comm_buffers": lambda: [*reducer.staging.values(),
                                     *(gatherer.full if gatherer is not None else []),
                                     *(gatherer.fp8_buffers() if gatherer is not None else []),
                                     *(self.frozen.full if self.frozen is not None else []),
                                     *self._optimizer_gathered()]}

    def _optimizer_gathered(self) -> list[torch.Tensor]:
        """The whole tensor a rule of fivefold's own holds gathered now (zero_rules.py)."""
        return list(getattr(getattr(self.optimizer, "assembler", None), "live", ()))

    def _step_copies(self) -> list[torch.Tensor]:
        """The fp32 gradient copies the optimizer step holds now (step_grads.py)."""
        return self.step_grads.live_tensors() if self.step_grads is not None else []

    def close(self) -> None:
        """Detach the hooks and stop the watchdog (tests build many optimizers per process)."""
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        if self.frozen is not None:
            self.frozen.remove_hooks()
        if self.nvme_dir is not None:  # the offload files go with the run
            self.optimizer.close()
        self.watchdog.close()


def build_data_parallel_optimizer(model, named_params, dims, cfg, scaler,
                                  watchdog: Watchdog | None = None) -> DataParallelOptimizer:
    """The optimizer for dp_cp > 1 or ZeRO (called by train/trainer.py build_optimizer)."""
    return DataParallelOptimizer(named_params, dims, cfg.train, scaler,
                                 **optimizer_options(model, cfg, watchdog))


def optimizer_options(model, cfg, watchdog: Watchdog | None) -> dict:
    """The `[parallel]` settings every data-parallel optimizer takes (dense and expert)."""
    par = cfg.parallel
    tier = offload_value(par.offload)  # a config built in code may still hold a boolean
    return dict(stage=par.zero, offload=tier != "none", bucket_mb=par.bucket_mb,
                chunks=model.chunks, timeout_s=par.timeout_s, watchdog=watchdog,
                buckets_in_flight=par.buckets_in_flight,
                # "auto" is resolved by the trainer (plan/inputs.py); unresolved, it is "step"
                grad_sync="microbatch" if par.grad_sync == "microbatch" else "step",
                nvme_dir=par.offload_dir if tier == "nvme" else None,
                nvme_run=run_tag(cfg.checkpoint.dir) if tier == "nvme" else None,
                optim=getattr(cfg, "optim", None))
