"""The memory wall on this machine: recompute = auto under budgets beside none / selective /
full, and ZeRO-2/3 gradients reduced per step or per micro-batch.

    python bench/train/memory_wall.py [--rounds 3] [--skip-grad-sync]
    python bench/train/memory_wall.py --planned-only   # seconds: the planner's rows alone

Recompute, on examples/bench-25m.toml (one process, one thread): for each mode, and for
auto at budgets a quarter, half and three quarters of the way from full recomputation's
planned peak to none's, the planned peak allocated, the measured peak (parallel/peak.py's
tracker over the second step, when Adam's moments exist), the chosen per-layer plan and the
step time (median over rounds, modes alternated so drift hits all alike). Then the planner
alone for Llama-3.1-8B on 8 H100s and Llama-3.1-70B on 64: budget → plan → peak → step time.

grad_sync, on the same model at dp 2 (128-token sequences) with 4 micro-batches per rank
(gloo, forked ranks): per
ZeRO stage and setting, the peak bytes of the gradient side (shard, whole .grad, buckets),
the reduce-scatters per step from the ledger, and the step time.

Writes bench/results/memory_wall.json with the machine, versions and git revision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fivefold import config as fconfig
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.peak import PeakTracker
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.hardware import GIB, Assumptions, get_hardware
from fivefold.plan.inputs import training_plan_inputs
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import auto_plan, memory_items, minimum_budget
from fivefold.train.bench import git_revision, machine
from fivefold.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def config(tmp: str, *overrides: str) -> fconfig.Config:
    return fconfig.load(ROOT / "examples" / "bench-25m.toml", [
        "--train.steps", "1000", "--train.eval_every", "0", "--checkpoint.dir", f"{tmp}/ckpt",
        "--checkpoint.every", "0", "--log.dir", f"{tmp}/log", "--log.progress", "false",
        "--log.tensorboard", "false", *overrides])


def planned_allocated(cfg) -> float:
    work, layout = training_plan_inputs(cfg)
    work = dataclasses.replace(work, precision="fp32")
    items, _ = memory_items(work, layout, Assumptions())
    return sum(v for k, v in items.items() if k != "overhead")


def recompute_rows(rounds: int) -> list[dict]:
    tmp = tempfile.mkdtemp()
    base = config(tmp)
    work, layout = training_plan_inputs(base)
    work = dataclasses.replace(work, precision="fp32")
    low = minimum_budget(work, layout) * GIB
    high = planned_allocated(base)
    runs = {mode: ["--train.recompute", mode] for mode in ("none", "selective", "full")}
    for frac in (0.25, 0.5, 0.75):
        budget = (low + frac * (high - low)) / GIB
        runs[f"auto {budget * 1024:.0f} MiB"] = ["--train.recompute", "auto",
                                                 "--train.memory_budget_gib", repr(budget)]
    trainers, rows = {}, {}
    for name, args in runs.items():
        cfg = config(tmp, *args)
        trainer = Trainer(cfg, ParallelDims.single(), quiet=True)
        first = trainer.train_step()["loss"]
        with PeakTracker(trainer.peak_sources()) as tracker:
            second = trainer.train_step()["loss"]
        trainers[name] = trainer
        plan = [c.label() for c in trainer.recompute_policies or []]
        rows[name] = {"mode": name, "budget_mib": None, "planned_peak_mib":
                      planned_allocated(cfg) / MIB, "measured_peak_mib": tracker.peak / MIB,
                      "activations_mib": tracker.item_peaks.get("activations", 0) / MIB,
                      "plan": plan, "losses": [first, second], "step_s": []}
        if "--train.memory_budget_gib" in args:
            rows[name]["budget_mib"] = float(args[-1]) * 1024
    for _ in range(rounds):  # alternate: the machine's drift hits every mode alike
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step()
            rows[name]["step_s"].append(time.perf_counter() - start)
    for trainer in trainers.values():
        trainer.close()
    for row in rows.values():
        row["step_s_median"] = statistics.median(row["step_s"])
    none = rows["none"]["step_s_median"]
    for row in rows.values():
        row["time_vs_none"] = row["step_s_median"] / none
    return list(rows.values())


def planned_rows() -> list[dict]:
    """The planner alone: 8B on 8 H100s (dp 8, ZeRO-3, 8k tokens), 70B on 64 (tp 8, dp 8)."""
    hw, assume = get_hardware("h100-sxm")
    cases = [("llama-3.1-8b", Workload(model=_preset("llama-3.1-8b"), seq_len=8192, gbs=64),
              Layout(dp=8, zero=3, mbs=1)),
             ("llama-3.1-70b", Workload(model=_preset("llama-3.1-70b"), seq_len=8192, gbs=128),
              Layout(dp=8, tp=8, sp=True, zero=3, mbs=1))]
    rows = []
    for name, work, layout in cases:
        plans = {mode: plan_layout(work, dataclasses.replace(layout, recompute=mode), hw,
                                   assume) for mode in ("none", "selective", "full")}
        low = minimum_budget(work, dataclasses.replace(layout, recompute="auto"))
        high = plans["none"].peak_allocated / GIB
        for mode, p in plans.items():
            rows.append({"model": name, "layout": layout.short(), "mode": mode,
                         "peak_allocated_gib": p.peak_allocated / GIB,
                         "step_s": p.time.total, "recompute_s": p.time.recompute})
        for frac in (0.25, 0.5, 0.75):
            budget = low + frac * (high - low)
            w = dataclasses.replace(work, memory_budget_gib=budget)
            lay = dataclasses.replace(layout, recompute="auto")
            p = plan_layout(w, lay, hw, assume)
            rows.append({"model": name, "layout": lay.short(), "mode": "auto",
                         "budget_gib": budget, "plan": auto_plan(p.context[0], lay, 0).summary(),
                         "peak_allocated_gib": p.peak_allocated / GIB, "step_s": p.time.total,
                         "recompute_s": p.time.recompute})
    return rows


def _preset(name: str):
    from fivefold.models.presets import preset

    return preset(name)


def grad_sync_rows() -> list[dict]:
    from tests_harness import run_ranks  # noqa: F401  (see main: tests/ on the path)

    return run_ranks(_grad_sync_rank, 2)[0]


def _grad_sync_rank(rank, world):
    tmp = tempfile.mkdtemp()
    out = []
    for zero in (2, 3):
        for sync in ("step", "microbatch"):
            cfg = config(tmp, "--parallel.dp", "2", "--parallel.zero", str(zero),
                         "--parallel.mbs", "1", "--parallel.grad_sync", sync,
                         "--train.seq_len", "128")
            trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
            reducer = trainer.optimizer.reducer
            layout = trainer.optimizer.layout
            trainer.train_step()
            tracker = PeakTracker({
                "shard": lambda r=reducer: [r.grad_shard],
                "whole": lambda lay=layout: [s.param.grad for s in lay.params],
                "buckets": lambda r=reducer: list(r.staging.values())})
            trainer.dims.ledger.enabled = True
            with tracker:
                start = time.perf_counter()
                trainer.train_step()
                seconds = time.perf_counter() - start
            calls = trainer.dims.ledger.totals()[("dp_cp", "reduce_scatter")]["calls"]
            times = []
            for _ in range(2):
                start = time.perf_counter()
                trainer.train_step()
                times.append(time.perf_counter() - start)
            out.append({"zero": zero, "grad_sync": sync, "micro_batches": 4,
                        "gradient_peak_mib": tracker.peak / MIB,
                        "whole_grad_peak_mib": tracker.item_peaks.get("whole", 0) / MIB,
                        "buckets_peak_mib": tracker.item_peaks.get("buckets", 0) / MIB,
                        "full_gradient_mib": layout.total * 4 / MIB,
                        "reduce_scatters_per_step": calls, "buckets": len(layout.segments),
                        "step_s_median": statistics.median([seconds, *times])})
            trainer.close()
    return out if rank == 0 else None


def print_planned(rows: list[dict]) -> None:
    print("\nplanned (H100 SXM):")
    for r in rows:
        print(f"{r['model']:<14} {r['mode']:<9} budget {r.get('budget_gib', 0):6.1f} GiB  "
              f"peak {r['peak_allocated_gib']:6.1f} GiB  step {r['step_s']:7.3f} s  "
              f"recompute {r['recompute_s']:6.3f} s  {r.get('plan', '')}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-grad-sync", action="store_true")
    ap.add_argument("--planned-only", action="store_true",
                    help="replace the planner's rows alone in bench/results/memory_wall.json")
    args = ap.parse_args()
    out = ROOT / "bench" / "results" / "memory_wall.json"
    if args.planned_only:
        result = json.loads(out.read_text())
        result["recompute_planned"] = planned_rows()
        result["recompute_planned_git_revision"] = git_revision()
        print_planned(result["recompute_planned"])
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {out} (the planner's rows)")
        return
    torch.set_num_threads(1)
    result = {"machine": machine(torch.device("cpu")), "git_revision": git_revision()}
    result["recompute_25m"] = recompute_rows(args.rounds)
    print("recompute on llama-25m (examples/bench-25m.toml), fp32, 1 thread:")
    print(f"{'mode':<18} {'budget':>8} {'planned':>8} {'measured':>9} {'step s':>7} "
          f"{'vs none':>7}  plan")
    for r in result["recompute_25m"]:
        budget = f"{r['budget_mib']:.0f}" if r["budget_mib"] else "-"
        print(f"{r['mode']:<18} {budget:>8} {r['planned_peak_mib']:>8.0f} "
              f"{r['measured_peak_mib']:>9.0f} {r['step_s_median']:>7.3f} "
              f"{r['time_vs_none']:>7.2f}  {', '.join(sorted(set(r['plan']))) or '-'}")
    result["recompute_planned"] = planned_rows()
    print_planned(result["recompute_planned"])
    out.write_text(json.dumps(result, indent=2) + "\n")  # kept if what follows fails
    if not args.skip_grad_sync:
        result["grad_sync_25m_dp2"] = grad_sync_rows()
        print("\ngrad_sync on llama-25m, dp 2, 4 micro-batches per rank:")
        for r in result["grad_sync_25m_dp2"]:
            print(f"ZeRO-{r['zero']} {r['grad_sync']:<10} gradient side peak "
                  f"{r['gradient_peak_mib']:7.1f} MiB (whole .grad {r['whole_grad_peak_mib']:.1f},"
                  f" full gradient {r['full_gradient_mib']:.1f}); reduce-scatters "
                  f"{r['reduce_scatters_per_step']} ({r['buckets']} buckets); step "
                  f"{r['step_s_median']:.3f} s")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    import os

    os.environ.setdefault("FIVEFOLD_TEST_TIMEOUT", "3000")  # the forked ranks' bound
    sys.path.insert(0, str(ROOT / "tests"))
    import harness as tests_harness

    sys.modules["tests_harness"] = tests_harness
    main()
