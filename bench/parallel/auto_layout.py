"""Measured regret of parallel.layout = auto: where the planner's pick ranks among the measured
step times of every feasible layout, on this machine.

    python bench/parallel/auto_layout.py --profile PROFILE.json [--ranks 4] [--rounds 2] [--steps 2]
        [--warmup 1] [--cases 25m-gbs4,25m-gbs8,deep-gbs4,deep-gbs8] [--no-sp]
        [--more [--only-missing]] [--all] [--rescore] [--stat min|median]
        [--check CASE:LAYOUT;LAYOUT]

PROFILE.json comes from `fivefold calibrate --out PROFILE.json --world 4 --max-hidden 1024
--threads 1` (each rank of a CPU run computes on one thread). For each case (a model and a
global batch) the layouts measured are those of the auto search (plan/auto_layout.py) with
recomputation off and ZeRO stage 0 or 1 (memory is plentiful here, so recomputation only
adds time, and ZeRO-2/3 move the same bytes as ZeRO-1 on one node), schedule 1f1b, that the
engine accepts, one per shape (dp, tp, pp, sp) at the planner's fastest ZeRO stage and
micro-batch for it (every micro-batch of every shape would take hours on 2 cores), plus
auto's own pick and runner-up from the whole space. Each layout trains
`--steps` timed steps after `--warmup` untimed ones on `--ranks` forked gloo ranks (one thread each,
the same seed and batches); layouts take turns round by round, in a shuffled order, so the
shared machine's noise falls on all of them alike; a layout's time is the median of its
timed steps over all rounds (rank 0's wall clock per step). Reported per case: the pick's
rank and regret (its measured time over the measured best, minus 1), and Spearman's rank
correlation of the planned against the measured times. Results: bench/results/auto_layout.json
with the profile, the CPU model, torch and the git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from fivefold import config  # noqa: E402
from fivefold.host import cpu_model  # noqa: E402
from fivefold.plan import auto_layout as planner  # noqa: E402
from fivefold.plan.evaluate import plan_layout  # noqa: E402
from fivefold.plan.hardware import load_profile  # noqa: E402
from fivefold.plan.search import enumerate_layouts  # noqa: E402

# The 25M example, and a deeper, narrower model of about the same size (16 layers of 256).
MODELS = {"25m": [], "deep": ["--model.hidden_size", "256", "--model.intermediate_size", "688",
                              "--model.num_layers", "16", "--model.num_heads", "4",
                              "--model.num_kv_heads", "4"]}
CORES = len(os.sched_getaffinity(0))  # the ranks share them: planner.shared_cores_time
STATS = {"median": statistics.median, "min": min}
BUDGET_GIB = 4.0  # per rank: 4 ranks in this machine's 24 GiB, far above any layout's need


def case_config(name: str, root: Path, layout_args: list[str]):
    model, gbs = name.split("-gbs")
    args = [*MODELS[model], "--train.gbs", gbs, "--train.eval_every", "0",
            "--train.warmup_steps", "0", "--train.memory_budget_gib", str(BUDGET_GIB),
            "--checkpoint.every", "0", "--checkpoint.dir", str(root / "ck"),
            "--log.dir", str(root / "log"), "--log.progress", "false",
            "--log.tensorboard", "false", *layout_args]
    return config.load(str(ROOT / "examples" / "bench-25m.toml"), args)


def candidates(name: str, ranks: int, hw, assume, root: Path, sp: bool = True,
               every: bool = False):
    """(config, workload, auto's pick and runner-up, the layouts to measure, how many the
    1F1B space holds, every layout of the space under any schedule by name) of one case:
    one layout per shape, or with `every` each feasible layout of the space (every
    micro-batch and ZeRO stage), plus the pick and runner-up."""
    cfg = case_config(name, root, ["--parallel.layout", "auto"])
    for key in ("parallel.mbs",):  # the example's own micro-batch: searched here
        config.given_keys(cfg).discard(key)
    pick = planner.choose(cfg, ranks, hw, assume, "fp32", "train.memory_budget_gib",
                          "the profile", on_cpu=True, cores=CORES)
    work, judged = planner.workload(cfg, "fp32", BUDGET_GIB)
    space = planner.search_space(cfg, planner.constraints(cfg), True, planner._accepts(judged))
    space.recompute, space.zero = ("none",), (0, 1)
    # every schedule: what --rescore looks a measured layout up in (an earlier pick)
    named = {lay.short(): lay for lay in enumerate_layouts(work, ranks, hw, space)
             if space.allowed(lay)}
    space.schedule = ("1f1b",)
    feasible = [lay for lay in named.values() if space.allowed(lay)]
    # One layout per shape (dp, tp, pp, sp): the planner's fastest ZeRO stage and micro-batch
    # of it. Measuring every micro-batch and stage of every shape takes hours on 2 cores.
    shapes: dict = {}
    for lay in feasible:
        if lay.sp and not sp:
            continue
        key = (lay.dp, lay.tp, lay.pp, lay.sp)
        t = pick.step_time(plan_layout(work, lay, hw, assume))
        if key not in shapes or t < shapes[key][0]:
            shapes[key] = (t, lay)
    layouts = [lay for _, lay in shapes.values()]
    if every:
        layouts = [lay for lay in feasible if sp or not lay.sp]
    for plan in (pick.best, pick.runner_up):
        if plan is not None and plan.layout not in layouts:
            layouts.append(plan.layout)
    return cfg, work, pick, layouts, len(feasible), named


def _rank(rank, world, init_file, cfg, steps, warmup, out):
    torch.set_num_threads(1)
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    dims = ParallelDims.from_config(cfg.parallel)
    times = []
    with Trainer(cfg, dims, quiet=True) as trainer:
        for _ in range(steps + warmup):
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times[warmup:]))
    dist.destroy_process_group()


def measure(cfg, ranks: int, steps: int, warmup: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(ranks, os.path.join(tmp, "init"), cfg, steps, warmup,
                                             out),
                           nprocs=ranks, join=True, start_method="fork")
        return json.loads(Path(out).read_text())


def spearman(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation of the ranks (ties share their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cases", default="25m-gbs4,25m-gbs8,deep-gbs4,deep-gbs8")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--more", action="store_true",
                    help="add --rounds rounds to the samples already in --out")
    ap.add_argument("--only-missing", action="store_true",
                    help="with --more: measure only the layouts without samples (a new pick)")
    ap.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                    help="add the samples of these earlier results files (same layouts)")
    ap.add_argument("--all", action="store_true",
                    help="measure every feasible layout of the space, not one per shape")
    ap.add_argument("--rescore", action="store_true",
                    help="measure nothing: plan the layouts already measured in --out again "
                         "(this revision's planner and --profile) and rewrite the scores")
    ap.add_argument("--stat", choices=sorted(STATS), default="median",
                    help="a layout's time from its samples: their median (default), or their "
                         "minimum where other jobs share the machine (they only add time)")
    ap.add_argument("--check", metavar="CASE:LAYOUT;LAYOUT", help="time only these layouts "
                    "(as the results name them) of one case, --steps each, and write "
                    "bench/results/auto_layout_check.json: a spot check on a quiet machine")
    ap.add_argument("--no-sp", dest="sp", action="store_false",
                    help="measure no sequence-parallel shapes (unless auto picks one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "auto_layout.json"))
    args = ap.parse_args()
    profile = load_profile(args.profile)
    hw, assume = planner.auto_hardware(None, args.ranks, BUDGET_GIB, profile, on_cpu=True)
    started = time.time()
    root = Path(tempfile.mkdtemp())
    if args.check:
        check(args, hw, assume, profile, root)
        return
    cases = {}
    for name in args.cases.split(","):
        cfg, work, pick, layouts, feasible, _ = candidates(name, args.ranks, hw, assume, root,
                                                            args.sp, args.all)
        plans = {lay: plan_layout(work, lay, hw, assume) for lay in layouts}
        cases[name] = {"cfg": cfg, "pick": pick, "plans": plans, "feasible": feasible,
                       "times": {lay: [] for lay in layouts}}
        print(f"{name}: {len(layouts)} layouts measured (of {feasible} feasible); auto "
              f"picks {pick.best.layout.short()}", flush=True)
    earlier = 0
    args.kept_cases = {}
    if args.rescore:  # the samples of --out, planned again
        before = json.loads(Path(args.out).read_text())
        args.kept_cases = {k: v for k, v in before["cases"].items() if k not in cases}
        for name, result in before["cases"].items():
            if name not in cases:
                continue
            _, work, _, _, _, named = candidates(name, args.ranks, hw, assume, root, True, True)
            case = cases[name]
            shown = {**named, **{lay.short(): lay for lay in case["times"]}}
            for row in result["rows"]:
                lay = shown.get(row["layout"])
                if lay is None:  # measured before, out of the space now: not scored
                    print(f"{name}: {row['layout']} is no longer a candidate", flush=True)
                    continue
                case["plans"].setdefault(lay, plan_layout(work, lay, hw, assume))
                case["times"].setdefault(lay, [])
                case["times"][lay] += row["samples_s"]
            case["plans"] = {lay: plan for lay, plan in case["plans"].items()
                             if case["times"][lay]}
            if case["pick"].best.layout not in case["plans"]:
                print(f"{name}: auto now picks {case['pick'].best.layout.short()}, not "
                      f"measured (measure it with --more --only-missing)", flush=True)
        write(args, cases, profile, started, before["rounds"])
        return
    if args.more and Path(args.out).is_file():  # add rounds to the samples already there
        before = json.loads(Path(args.out).read_text())
        earlier = before["rounds"]
        args.kept_cases = {k: v for k, v in before["cases"].items() if k not in cases}
        for name, result in before["cases"].items():
            if name in cases:
                shown = {lay.short(): lay for lay in cases[name]["times"]}
                for row in result["rows"]:
                    if row["layout"] in shown:
                        cases[name]["times"][shown[row["layout"]]] += row["samples_s"]
    for other in args.merge:  # samples of earlier runs of the same layouts (another file)
        for name, result in json.loads(Path(other).read_text())["cases"].items():
            if name in cases:
                shown = {lay.short(): lay for lay in cases[name]["times"]}
                for row in result["rows"]:
                    if row["layout"] in shown:
                        cases[name]["times"][shown[row["layout"]]] += row["samples_s"]
    rng = random.Random(earlier)
    for rnd in range(earlier, earlier + args.rounds):
        for name, case in cases.items():
            order = list(case["plans"])
            rng.shuffle(order)
            for lay in order:
                if args.only_missing and case["times"][lay]:
                    continue
                run_cfg = planner.apply(case["cfg"], case["plans"][lay], BUDGET_GIB)
                run_cfg.parallel.layout = "manual"
                config.validate_layout(run_cfg)
                t = measure(run_cfg, args.ranks, args.steps, args.warmup)
                case["times"][lay] += t
                print(f"round {rnd + 1} {name} {lay.short():<36} "
                      + " ".join(f"{x:.2f}" for x in t), flush=True)
                write(args, cases, profile, started, rnd + 1)  # what is measured survives
    if args.merge or not args.rounds:
        write(args, cases, profile, started, earlier + args.rounds)


def check(args, hw, assume, profile: dict, root: Path) -> None:
    name, _, wanted = args.check.partition(":")
    cfg, work, pick, layouts, _, _ = candidates(name, args.ranks, hw, assume, root, True, True)
    shown = {lay.short(): lay for lay in layouts}
    rows = []
    for want in wanted.split(";"):
        if want not in shown:
            raise SystemExit(f"--check: {want!r} is not a feasible layout of {name}")
        plan = plan_layout(work, shown[want], hw, assume)
        run_cfg = planner.apply(cfg, plan, BUDGET_GIB)
        run_cfg.parallel.layout = "manual"
        samples = measure(run_cfg, args.ranks, args.steps, args.warmup)
        rows.append({"layout": want, "planned_s": pick.step_time(plan), "samples_s": samples})
        print(f"{name} {want}: planned {rows[-1]['planned_s']:.2f} s, measured "
              + " ".join(f"{x:.2f}" for x in samples), flush=True)
    out = ROOT / "bench" / "results" / "auto_layout_check.json"
    out.write_text(json.dumps({"machine": machine(), "case": name, "steps": args.steps,
                               "load_average_at_end": os.getloadavg(), "profile": profile,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


def machine() -> dict:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "git_rev": rev}


def write(args, cases: dict, profile: dict, started: float, rounds_done: int) -> None:
    results = {}
    for name, case in cases.items():
        rows = []
        for lay, plan in case["plans"].items():
            if not case["times"][lay]:
                continue
            rows.append({"layout": lay.short(),
                         "planned_s": case["pick"].step_time(plan),
                         "planned_own_cores_s": plan.time.total,
                         "measured_s": STATS[args.stat](case["times"][lay]),
                         "samples_s": case["times"][lay]})
        if len(rows) < len(case["plans"]):
            continue
        rows.sort(key=lambda r: r["measured_s"])
        best = rows[0]["measured_s"]
        chosen = case["pick"].best.layout.short()
        rank = next((i for i, r in enumerate(rows) if r["layout"] == chosen), -1) + 1
        # 0: a rescore's new pick, not measured yet (--more --only-missing measures it)
        pick_s = rows[rank - 1]["measured_s"] if rank else float("nan")
        rho = spearman([r["planned_s"] for r in rows], [r["measured_s"] for r in rows])
        rho_own = spearman([r["planned_own_cores_s"] for r in rows],
                           [r["measured_s"] for r in rows])
        results[name] = {"pick": chosen, "pick_rank": rank, "layouts": len(rows),
                         "feasible_in_space": case["feasible"],
                         "runner_up": (case["pick"].runner_up.layout.short()
                                       if case["pick"].runner_up else None),
                         "pick_measured_s": pick_s, "best": rows[0]["layout"],
                         "best_measured_s": best, "regret": pick_s / best - 1,
                         "spearman": rho, "spearman_own_cores": rho_own,
                         "cores": case["pick"].cores, "rows": rows}
        print(f"{name}: pick {chosen} ranks {rank or 'unmeasured'} of {len(rows)}, "
              f"{pick_s:.2f} s vs best "
              f"{rows[0]['layout']} {best:.2f} s: regret {100 * (pick_s / best - 1):.1f}%; "
              f"Spearman {rho:.2f} ({rho_own:.2f} as if each rank had its own core)", flush=True)
    payload = {"merged": args.merge, "machine": {**machine(),
                                                 "load_average_at_end": os.getloadavg()},
               "ranks": args.ranks, "rounds": rounds_done, "steps": args.steps,
               "statistic": args.stat,
               "budget_gib": BUDGET_GIB, "elapsed_s": time.time() - started,
               "profile": profile, "cases": {**args.kept_cases, **results}}
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
