"""Muon and Adafactor under ZeRO: what a rank holds gathered in the optimizer step, measured
and planned, one tensor at a time against the whole-model gather it replaced.

    python bench/train/optimizer_gather.py [--optimizers muon adafactor] [--zero 1 3]

The 25M example (examples/bench-25m.toml: fp32 on CPU, 8 sequences of 256 tokens a step, as
2 ranks x 1 micro-batch of 4) on 2 forked gloo ranks (one thread each), `parallel.zero` 1
and 3. Each run takes one step, then one each way under the engine's peak tracker
(parallel/peak.py: the bytes of the distinct storages a rank holds, item by item, at each
point a peak can occur). Printed and saved, per run and rank 0 (the ranks agree):

- `comm_buffers`: the item that holds the gathered tensor (with ZeRO-3's gathered units and
  gradient buckets earlier in the step), measured against the planner's
  (plan/comm_buffers.py `dp_comm_buffer_bytes`, which plans the largest gathered tensor:
  plan/optimizer.py `gathered_bytes`);
- `gathered`: the most comm_buffers holds at the optimizer step's gathers (the tracker's
  `optimizer gather` points; nothing else is in flight then), against `gathered_bytes`;
- the whole tracked peak, and the total at the optimizer step's gather;
- the optimizer step's time (median of `--repeats` steps each way, taking turns in one
  run, so that the shared machine's noise falls on both alike).

`before` runs the same step with `parallel.zero_rules.WHOLE_MODEL_GATHER` (the whole flat
shard all-gathered at once, as before: a full fp32 copy of the model on every rank). Writes
bench/results/optimizer_gather.json with the machine, versions and git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from fivefold import config  # noqa: E402
from fivefold.parallel import zero_rules  # noqa: E402
from fivefold.parallel.mesh import ParallelDims  # noqa: E402
from fivefold.parallel.peak import PeakTracker  # noqa: E402
from fivefold.train.bench import git_revision, machine  # noqa: E402
from fivefold.train.loop import planned_peak_bytes  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402

EXAMPLE = ROOT / "examples" / "bench-25m.toml"


class GatherTracker(PeakTracker):
    """The peak tracker, also keeping the most comm_buffers held at an optimizer gather."""

    gathered = 0

    def sample(self, point: str) -> None:
        super().sample(point)
        if point == "optimizer gather":
            now = sum(t.untyped_storage().nbytes() for t in self.sources["comm_buffers"]())
            self.gathered = max(self.gathered, now)


def _tracked(trainer, dims, work, layout) -> dict:
    from fivefold.plan.comm_buffers import dp_comm_buffer_bytes
    from fivefold.plan.optimizer import gathered_bytes

    with GatherTracker(trainer.peak_sources()) as tracker:
        trainer.train_step()
    return {"peak": tracker.peak, "at": tracker.at, "items_at_peak": tracker.items_at_peak,
            "comm_buffers": tracker.item_peaks.get("comm_buffers", 0),
            "gathered": tracker.gathered,
            "at_gather": tracker.points.get("optimizer gather", 0),
            "planned_comm_buffers": dp_comm_buffer_bytes(work, layout, dims.pp_rank),
            "planned_gathered": gathered_bytes(work, layout, dims.pp_rank),
            "planned_items": planned_peak_bytes(trainer),
            "model_fp32_bytes": 4 * trainer.optimizer.layout.total}


def _run(optimizer: str, zero: int, repeats: int, tmp: Path) -> dict[str, dict]:
    """One trainer; each step gathers one way or the other (the switch is read per step)."""
    from fivefold.plan.inputs import training_plan_inputs

    run = tmp / f"{optimizer}-z{zero}"
    cfg = config.load(str(EXAMPLE), [
        "--parallel.dp", "2", "--parallel.zero", str(zero), "--parallel.mbs", "4",
        "--train.optimizer", optimizer, "--train.steps", str(3 + 2 * repeats),
        "--train.eval_every", "0", "--checkpoint.dir", str(run / "ck"),
        "--checkpoint.every", "0", "--log.dir", str(run), "--log.progress", "false",
        "--log.tensorboard", "false"])
    dims = ParallelDims.from_config(cfg.parallel)
    out = {}
    with Trainer(cfg, dims, quiet=True) as trainer:
        work, layout = training_plan_inputs(trainer.cfg)
        trainer.train_step()  # the states exist from here on, as in any later step
        for whole in (False, True):
            zero_rules.WHOLE_MODEL_GATHER = whole
            out[whole] = _tracked(trainer, dims, work, layout)
        # the optimizer step's own time, the two ways taking turns step by step
        opt, took = trainer.optimizer, {False: [], True: []}
        step = opt.step

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                took[zero_rules.WHOLE_MODEL_GATHER].append(time.perf_counter() - start)

        opt.step = timed
        for r in range(repeats):
            for whole in ((False, True) if r % 2 == 0 else (True, False)):
                zero_rules.WHOLE_MODEL_GATHER = whole
                trainer.train_step()
        opt.step = step
    zero_rules.WHOLE_MODEL_GATHER = False
    for whole in (False, True):
        out[whole]["optimizer_step_s"] = statistics.median(took[whole])
        out[whole]["optimizer_step_each_s"] = took[whole]
    return {f"{optimizer} zero{zero} {'before' if w else 'after'}": out[w]
            for w in (False, True)}


def _rank(rank, world, init_file, runs, repeats, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, zero in runs:
            results.update(_run(optimizer, zero, repeats, Path(tmp) / str(rank)))
    Path(f"{out_path}.{rank}").write_text(json.dumps(results, default=float))
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", nargs="+", default=["muon", "adafactor"],
                   choices=["muon", "adafactor"])
    p.add_argument("--zero", nargs="+", type=int, default=[1, 3], choices=[1, 2, 3])
    p.add_argument("--repeats", type=int, default=3, help="timed steps each way")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "optimizer_gather.json"))
    args = p.parse_args(argv)
    runs = [(o, z) for o in args.optimizers for z in args.zero]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results")
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "rdv"), runs, args.repeats, out),
                           nprocs=2, start_method="fork")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    mib = 2**20
    print("25M example (examples/bench-25m.toml), dp2, fp32, CPU; MiB on rank 0 "
          "(rank 1 agrees: checked below)")
    print(f"{'run':<24} {'comm_buffers meas/plan':>23} {'gathered meas/plan':>19} "
          f"{'peak':>7} {'at gather':>9}  peak at")
    for key, r in ranks[0].items():
        print(f"{key:<24} {r['comm_buffers'] / mib:>10.2f} / "
              f"{r['planned_comm_buffers'] / mib:<10.2f} {r['gathered'] / mib:>8.2f} / "
              f"{r['planned_gathered'] / mib:<8.2f}"
              f" {r['peak'] / mib:>7.1f} {r['at_gather'] / mib:>9.1f}  {r['at']}")
    agree = all(ranks[1][k]["comm_buffers"] == r["comm_buffers"] and
                ranks[1][k]["gathered"] == r["gathered"] for k, r in ranks[0].items())
    exact = {k: r["comm_buffers"] == r["planned_comm_buffers"] and
             r["gathered"] == r["planned_gathered"]
             for k, r in ranks[0].items() if k.endswith("after")}
    print(f"ranks agree: {agree}; measured = planned (after, to the byte): {exact}")
    for o, z in runs:
        before, after = ranks[0][f"{o} zero{z} before"], ranks[0][f"{o} zero{z} after"]
        print(f"{o} zero{z}: gathered {before['gathered'] / mib:.2f} -> "
              f"{after['gathered'] / mib:.2f} MiB (the model in fp32: "
              f"{after['model_fp32_bytes'] / mib:.2f}); total at the gather "
              f"{before['at_gather'] / mib:.1f} -> {after['at_gather'] / mib:.1f} MiB; "
              f"peak {before['peak'] / mib:.1f} -> {after['peak'] / mib:.1f} MiB; optimizer "
              f"step {before['optimizer_step_s']:.3f} -> {after['optimizer_step_s']:.3f} s")
    record = {"machine": machine(torch.device("cpu")), "git_revision": git_revision(),
              "config": "examples/bench-25m.toml", "dp": 2,
              "command": "python bench/train/optimizer_gather.py " + " ".join(
                  ["--optimizers", *args.optimizers, "--zero", *map(str, args.zero),
                   "--repeats", str(args.repeats)]),
              "ranks_agree": agree, "measured_equals_planned": exact, "runs": ranks[0],
              "rank1": ranks[1]}
    Path(args.out).write_text(json.dumps(record, indent=1, default=float) + "\n")
    print(f"wrote {os.path.relpath(args.out, ROOT)}")


if __name__ == "__main__":
    main()
