"""The training run: steps, progress display, validation, checkpoints, final summary."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

from fivefold.config import Config
from fivefold.config.parallel import offload_value
from fivefold.config.train import resolve_compile
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.watchdog import is_comm_failure
from fivefold.text import count
from fivefold.train import checkpoint as ckpt
from fivefold.train.lifecycle import StopSignal, Terminated
from fivefold.train.metrics import MetricsWriter
from fivefold.train.rundir import memory_warning, start_notes
from fivefold.train.trainer import Trainer


def _size(n: float) -> str:
    """Bytes in the plan line's units: MiB below a GiB, GiB from there."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _fmt(rec: dict) -> str:
    """The step line. Memory: the peak allocated bytes (what the plan's `peak ... allocated`
    predicts), and on a CPU the process's resident size beside it, labelled `rss` (it holds
    the Python interpreter, torch's libraries and the allocator's free pages too). MFU is
    left out where it is unknown (a CPU has no catalogued peak)."""
    mfu = f"  mfu {100 * rec['mfu']:.1f}%" if rec.get("mfu") is not None else ""
    alloc = rec.get("peak_allocated_bytes")
    mem = f"peak {_size(alloc)} allocated" if alloc is not None else ""
    if "memory_reserved_bytes" not in rec:  # a CPU: memory_bytes is the resident size
        mem = ", ".join(filter(None, [mem, f"rss {_size(rec['memory_bytes'])}"]))
    skip = ""
    if rec.get("skipped"):
        skip = " (skipped: non-finite loss or gradient)" if rec.get("bad") else \
            " (skipped, fp16 overflow)"
    return (f"step {rec['step']:>6}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
            f"grad_norm {rec['grad_norm']:.3f}  tok/s {rec['tokens_per_s']:,.0f}{mfu}  "
            f"{mem}{skip}" + (f"  experts max/mean {rec['moe_imbalance']:.2f}"
                                          f"  aux {rec['moe_aux_loss']:.4f}"
                                          if "moe_imbalance" in rec else ""))


class Progress:
    """A rich progress bar on a terminal; plain log lines every `log.every` steps otherwise."""

    def __init__(self, total: int, start: int, enabled: bool, every: int):
        self.enabled, self.every = enabled, every
        self.bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), TextColumn("{task.description}"))
            self.task = self.bar.add_task("", total=total, completed=start)
            self.bar.start()

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], description=(
                f"loss {rec['loss']:.4f} lr {rec['lr']:.1e} gn {rec['grad_norm']:.2f} "
                f"tok/s {rec['tokens_per_s']:,.0f}"))
            if rec["step"] % self.every == 0:
                self.bar.console.log(_fmt(rec))
        elif rec["step"] % self.every == 0 or rec["step"] == 1:
            print(_fmt(rec), flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.log(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


STATE_ITEMS = ("params", "grads", "master", "optimizer")


def attention_backend(trainer: Trainer) -> str:
    from fivefold.train.metrics import sdpa_backend

    mc, tp = trainer.model_cfg, trainer.cfg.parallel.tp
    return sdpa_backend(trainer.device, trainer.dtype, mc.num_heads // tp,
                        max(mc.num_kv_heads // tp, 1), mc.dim_per_head)


def planned_model_states(trainer: Trainer) -> dict[str, float]:
    """The planner's model-state bytes for this rank, for the layout being run."""
    from fivefold.plan.model_states import model_state_bytes

    par = trainer.cfg.parallel
    states = model_state_bytes(
        trainer.model_cfg, tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep, zero=par.zero,
        offload=par.offload, precision=trainer.precision,
        pp_rank=trainer.dims.pp_rank,
        schedule=par.schedule, virtual_stages=par.virtual_stages,
        lora_rank=trainer.cfg.lora.rank, lora_base=trainer.cfg.lora.base,
        lora_targets=trainer.cfg.lora.targets)
    return {k: getattr(states, k) for k in STATE_ITEMS}


def planned_peak_bytes(trainer: Trainer) -> dict[str, float]:
    """The planner's itemised bytes at this rank's peak for the run's own layout and
    precision, without its allowance for the CUDA context and fragmentation (what
    `torch.cuda.max_memory_allocated` can be compared with)."""
    import dataclasses

    from fivefold.plan.hardware import Assumptions
    from fivefold.plan.inputs import training_plan_inputs
    from fivefold.plan.memory import memory_items

    work, layout = training_plan_inputs(trainer.cfg)
    work = dataclasses.replace(work, model=trainer.model_cfg, precision=trainer.precision)
    items, _ = memory_items(work, layout, Assumptions(), rank=trainer.dims.pp_rank)
    items.pop("overhead")
    return items


def compare_states(planned: dict, measured: dict, nvme: bool = False) -> str:
    """Planned against measured model-state bytes. Under parallel.offload = nvme the
    optimizer's states live in files: what memory holds of them is the staging slots (two
    slots of a chunk of the three fp32 states, parallel/nvme.py), named as such."""
    mib = 2**20
    names = {"optimizer": "optimizer (NVMe files; in memory: 2 staging slots)"} if nvme else {}
    parts = [f"{names.get(k, k)} {planned[k] / mib:.2f}/{measured.get(k, 0) / mib:.2f}"
             for k in STATE_ITEMS]
    return "model states per rank, planned/measured MiB: " + ", ".join(parts)


def run(cfg: Config, dims: ParallelDims | None = None) -> list[dict]:
    """Train for `train.steps` steps (from a checkpoint if asked); return the step records.
    However it ends, the trainer's threads are stopped and the metrics files closed."""
    stop = StopSignal().install()
    try:
        with Trainer(cfg, dims) as trainer:
            try:
                return _train(cfg, trainer, stop)
            except RuntimeError as e:  # a collective outside the watchdog's waits: explained
                if trainer.watchdog.active and is_comm_failure(e):
                    raise trainer.watchdog.explain(e, f"step {trainer.step + 1}") from e
                raise
    finally:
        stop.restore()


def layout_line(cfg: Config) -> str:
    """The whole layout the run uses, as the keys name it (pipeline schedule with pp > 1,
    sequence parallelism with tp > 1, the cp split with cp > 1)."""
    par = cfg.parallel
    parts = [f"dp={par.dp}", f"tp={par.tp}", f"pp={par.pp}", f"cp={par.cp}", f"ep={par.ep}",
             f"zero={par.zero}" + {"none": "", "cpu": " offload"}.get(offload_value(par.offload),
                                                                   f" offload={par.offload}"),
             f"mbs={par.mbs}"]
    if par.tp > 1:
        parts.append(f"sp={'on' if par.sp else 'off'}")
    if par.pp > 1:
        parts.append(f"schedule={par.schedule}" + (f" virtual_stages={par.virtual_stages}"
                                                   if par.virtual_stages > 1 else ""))
    if par.cp > 1:
        parts.append(f"cp_layout={par.cp_layout} cp_comm={par.cp_comm}")
    return "layout " + " ".join(parts)


def layout_notes(cfg: Config) -> list[str]:
    """Settings the layout accepts but does not use, said once at the start."""
    par = cfg.parallel
    notes = []
    # (offload rides on the ZeRO optimizer: on one rank it is what moves the states)
    if par.zero > 0 and par.dp * par.cp == 1 and par.ep == 1 and offload_value(
            par.offload) == "none":
        notes.append(f"note: parallel.zero = {par.zero} shards over the data-parallel ranks, "
                     f"and parallel.dp × cp = 1: nothing is sharded (it runs as zero = 0 "
                     f"would); raise parallel.dp to shard")
    return notes


def recompute_line(cfg: Config, policies) -> str:
    """recompute = auto's choice, layer by layer in forward order, runs of equal choices
    merged: 'recompute auto under 0.05 GiB: 1× none; 1× keep q,k,v,core'."""
    runs = [(label, len(list(group))) for label, group in
            itertools.groupby(c.label() for c in policies)]
    return (f"recompute auto under {cfg.train.memory_budget_gib:g} GiB, per layer: "
            + "; ".join(f"{n}× {label}" for label, n in runs))


def log_records(records, writer: MetricsWriter, progress: Progress) -> None:
    """Steps' records just read from the device: to metrics.jsonl and the progress line."""
    for rec in records:
        writer.write(dict(rec))
        progress.update(rec)
        if rec["bad"]:
            progress.message(f"step {rec['step']} skipped: non-finite loss or gradient "
                             f"({rec.bad_in_a_row} in a row)")


def _train(cfg: Config, trainer: Trainer, stop: StopSignal) -> list[dict]:
    log = trainer.is_logger
    if trainer.resumed_from and trainer.step >= cfg.train.steps:
        if log:
            print(f"nothing to do: checkpoint at step {trainer.step} ≥ train.steps "
                  f"{cfg.train.steps} ({trainer.resumed_from}); raise train.steps to train "
                  f"further", flush=True)
        return []
    writer = MetricsWriter(cfg.log.dir, cfg.log.tensorboard, enabled=log,
                           resume_step=trainer.step if trainer.resumed_from else None)
    progress = Progress(cfg.train.steps, trainer.step, cfg.log.progress and log, cfg.log.every)
    if trainer.resumed_from:
        progress.message(f"resumed from {trainer.resumed_from} at step {trainer.step}")
    elif log:
        n = trainer.model_cfg.num_params()
        progress.message(f"model {trainer.model_cfg.name}: {n / 1e6:.2f}M parameters "
                         f"({n:,}), {trainer.precision}, device {trainer.device}, "
                         f"{layout_line(cfg)}")
        mc = trainer.model_cfg
        progress.message(f"attention: SDPA {attention_backend(trainer)} kernel"
                         + (", blocks compiled (train.compile)"
                            if resolve_compile(cfg.train.compile, trainer.device.type) else ""))
        if mc.num_experts:
            progress.message(f"mixture of experts: {mc.num_moe_layers} MoE layers of "
                             f"{mc.num_experts} experts, top-{mc.experts_top_k}; "
                             f"{mc.num_active_params() / 1e6:.2f}M parameters active per "
                             f"token: MFU counts the active ones (6·N_active + attention)")
    if log and trainer.lora:  # adapters, and trainable / total parameters
        progress.message(trainer.lora_summary)
    if log and trainer.recompute_policies:
        progress.message(recompute_line(cfg, trainer.recompute_policies))
    warmup = cfg.train.warmup_steps
    if warmup > cfg.train.steps // 10:
        progress.message(f"note: train.warmup_steps = {warmup} is capped at a tenth of "
                         f"train.steps: {cfg.train.steps // 10} steps of warmup")
    planned = planned_model_states(trainer) if log else None
    peak = planned_peak_bytes(trainer) if log else None
    if log:
        for note in start_notes(cfg, trainer.resumed_meta, trainer.step) + layout_notes(cfg):
            print(note, flush=True)
        low = memory_warning(sum(peak.values()), trainer.dims.world_size)
        if low and trainer.device.type == "cpu":
            print(low, file=sys.stderr, flush=True)
    if planned:
        total = sum(planned.values()) / 2**20
        rest = {"activations": peak["activations"], "logits": peak["logits_loss"],
                "other": sum(peak.values()) - peak["activations"] - peak["logits_loss"]
                - sum(planned.values())}
        progress.message(f"plan: model states {total:.2f} MiB per rank ("
                         + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in planned.items())
                         + f"); peak {sum(peak.values()) / 2**20:.2f} MiB allocated ("
                         + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in rest.items())
                         + "); `fivefold plan --config` itemises it")
    records = []
    started = time.perf_counter()
    try:
        while trainer.step < cfg.train.steps:
            rec = trainer.train_step()
            records.append(rec)
            step = trainer.step
            ev, every = cfg.train.eval_every, cfg.checkpoint.every
            evaluate = trainer.val_loader is not None and ev and (
                step % ev == 0 or step == cfg.train.steps)
            saved = (every and step % every == 0) or step == cfg.train.steps
            # The records are read from the device at the logging cadence (and before a
            # validation, a save or a stop): train/step_metrics.py. A SIGTERM is agreed on
            # there too, where the host waits for the device anyway (lifecycle.StopSignal)
            reads = step % cfg.log.every == 0 or step == 1 or evaluate or saved
            stopping = stop.agreed(trainer.dims["world"], check=reads)
            if reads or stopping:
                log_records(trainer.settle(check=False), writer, progress)
                trainer.book.check_bad_steps()  # after the bad steps are logged
            if planned and len(records) == 1:
                measured = trainer.optimizer.memory_bytes()
                if trainer.lora:  # the frozen base: model state the optimizer does not hold
                    from fivefold.finetune.attach import frozen_state
                    from fivefold.parallel.buffers import storage_bytes

                    measured["params"] += storage_bytes(frozen_state(trainer.model.chunks))
                progress.message(compare_states(
                    planned, measured, offload_value(cfg.parallel.offload) == "nvme"))
                if trainer.device.type == "cuda":
                    want = sum(peak.values())
                    progress.message(f"peak allocated, planned/measured MiB: {want / 2**20:.1f}"
                                     f"/{rec['memory_bytes'] / 2**20:.1f}")
            if cfg.log.ledger and log:
                progress.message(trainer.dims.ledger.summary())
            if evaluate:
                val = trainer.evaluate()
                writer.write(val)
                progress.message(f"step {val['step']:>6}  val_loss {val['val_loss']:.4f}  "
                                 f"perplexity {val['val_perplexity']:.2f}")
            if saved:
                trainer.save_checkpoint()
            if stopping:
                path = None
                if cfg.checkpoint.save_on_signal:
                    if not saved:
                        trainer.save_checkpoint()
                    path = str(ckpt.step_dir(Path(cfg.checkpoint.dir), trainer.step))
                raise Terminated(trainer.step, path)
    finally:
        progress.close()
        writer.close()
    if log and records:
        first, last = records[0]["loss"], records[-1]["loss"]
        print(f"done: {count(len(records), 'step')} in {time.perf_counter() - started:.1f} s, loss "
              f"{first:.4f} -> {last:.4f}; checkpoint in {cfg.checkpoint.dir}", flush=True)
    return records
