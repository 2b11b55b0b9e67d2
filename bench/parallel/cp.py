"""Context parallelism on CPU gloo: step time of cp 2 and cp 4 against one process, at the
same sequence length, and how much of the ring's communication the attention hides.

Every run trains the `tiny` preset (4 layers, hidden 128, 4 heads, 2 kv heads) on one
sequence of `--seq` tokens per step (fp32, one thread per process), timing whole training
steps (forward, backward, gradient reduction over dp×cp, AdamW) as the trainer runs them;
the median of the timed steps after warm-up. cp = 1 is one process; cp = n is n gloo ranks.
Besides wall time it reports CPU time per step (the process's, gloo's threads included; for
cp, the busiest rank's): on a machine whose cores are oversubscribed, wall time mostly
measures the scheduler, while CPU time estimates the step on dedicated cores (it leaves out
time spent waiting for a transfer, which `comm waits` shows).

Hidden communication: every wait on a ring transfer is timed inside the step (`waits`);
then the same transfers are timed alone, back to back, with nothing to overlap (`alone`).
A wait also absorbs the other ranks being late (skew: a busy, shared CPU deschedules them),
so hidden = 1 − min(waits, alone) / alone is a lower bound of what the overlap hides, and
alone / step bounds what the ring could cost if nothing were hidden at all.

    python bench/parallel/cp.py                 # seq 8192: cp 1, 2, 4; writes bench/results/cp.json
    python bench/parallel/cp.py --seq 32768 --degrees 4 --schemes ring --no-single --steps 1 \
        --warmup 0 --out bench/results/cp_32k.json   # a 32k-token sequence at cp 4

The cores may be shared with other work: compare the ratios of one run, not absolute times.
Each cp run alternates step by step with a cp = 1 run on rank 0 (the other ranks wait at a
barrier), and its ratio is taken against that cp = 1 run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fivefold.host import cpu_model

ROOT = Path(__file__).resolve().parents[2]


class TimedWork:
    """A communication handle whose waits add to a shared clock."""

    def __init__(self, work, clock: list[float]):
        self.work, self.clock = work, clock

    def wait(self):
        start = time.perf_counter()
        out = self.work.wait()
        self.clock[0] += time.perf_counter() - start
        return out

    def is_completed(self):
        return self.work.is_completed()


def config(tmp: Path, args, cp: int, comm: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from common import small_config

    return small_config(
        tmp, "--model.preset", "tiny", "--model.hidden_size", "128",
        "--model.intermediate_size", "384", "--model.num_layers", "4", "--model.num_heads",
        "4", "--model.num_kv_heads", "2", "--model.max_seq_len", str(args.seq),
        "--train.seq_len", str(args.seq), "--train.gbs", "1", "--parallel.mbs", "1",
        "--parallel.cp", str(cp), "--parallel.cp_comm", comm, "--train.steps", "1000")


def install_timers(clock: list[float]) -> None:
    """Time every wait on a cp transfer (ring) and every cp collective call (all-gather)."""
    from fivefold.parallel import comm

    send_recv = comm.batch_p2p

    def batch_p2p(ops, group):
        works = send_recv(ops, group)
        return [TimedWork(w, clock) for w in works] if group.name == "cp" else works

    comm.batch_p2p = batch_p2p
    def timer(fn):
        def timed(*a, **kw):
            group = a[2] if len(a) > 2 else kw["group"]
            start = time.perf_counter()
            out = fn(*a, **kw)
            if group.name == "cp":
                clock[0] += time.perf_counter() - start
            return out

        return timed

    for name in ("all_gather", "reduce_scatter"):
        setattr(comm, name, timer(getattr(comm, name)))


def transfers_alone(trainer, repeats: int) -> float:
    """Seconds of one step's ring transfers run back to back with no compute between."""
    from fivefold.parallel import comm

    dims = trainer.dims
    dims.ledger.enabled = True
    dims.ledger.reset()
    trainer.train_step()
    dims.ledger.enabled = False
    sends = [e for e in dims.ledger.entries if e.op == "send" and e.group == "cp"]
    group = dims["cp"]
    rank, cp = group.rank, group.size
    best = float("inf")
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        for e in sends:
            dtype = getattr(torch, e.dtype)
            out, inp = torch.empty(e.elements, dtype=dtype), torch.zeros(e.elements, dtype=dtype)
            for h in comm.batch_p2p([comm.P2P("send", inp, (rank + 1) % cp),
                                     comm.P2P("recv", out, (rank - 1) % cp)], group):
                h.wait()
        best = min(best, time.perf_counter() - start)
    return best


def _rank_main(rank, world, args, out_dir):
    """Rounds of: one cp step per scheme on all ranks, then (unless --no-single) one step of
    the single-process run on rank 0 while the others wait. The runs alternate, so a change
    of load on a shared machine hits them alike."""
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.trainer import Trainer

    clock = [0.0]
    install_timers(clock)
    runs = {}
    for scheme in args.schemes:
        cfg = config(Path(tempfile.mkdtemp()), args, world, scheme)
        runs[scheme] = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    if rank == 0 and not args.no_single:
        cfg = config(Path(tempfile.mkdtemp()), args, 1, "ring")
        runs["single"] = Trainer(cfg, ParallelDims.single(), quiet=True)
    times = {name: [] for name in [*args.schemes, "single"]}
    cpu = {name: [] for name in [*args.schemes, "single"]}
    waits = {name: [] for name in args.schemes}
    for i in range(args.warmup + args.steps):
        for name in [*args.schemes, "single"]:
            torch.distributed.barrier()
            if name not in runs:  # the single run's turn, on rank 0 only
                continue
            clock[0] = 0.0
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name].train_step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                if name in waits:
                    waits[name].append(clock[0])
    rows = []
    if "single" in runs:
        rows.append({"cp": 1, "scheme": "-", "step_s": statistics.median(times["single"]),
                     "cpu_s": statistics.median(cpu["single"])})
    for scheme in args.schemes:
        step_s = statistics.median(times[scheme])
        row = {"cp": world, "scheme": scheme, "step_s": step_s,
               "cpu_s": statistics.median(cpu[scheme]),
               "comm_waits_s": statistics.median(waits[scheme]),
               "peak_rss_mib_last_rank": None}
        if scheme == "ring":
            alone = transfers_alone(runs[scheme], 3)
            row.update(comm_alone_s=alone, alone_share_of_step=alone / step_s,
                       hidden_lower_bound=1 - min(row["comm_waits_s"], alone) / alone)
        rows.append(row)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "rss": rss}))


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--degrees", default="2,4", help="cp degrees besides the single run")
    parser.add_argument("--schemes", default="ring,allgather")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-single", action="store_true", help="skip the cp = 1 run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cp.json"))
    args = parser.parse_args(argv)
    degrees = [int(d) for d in args.degrees.split(",") if d]
    args.schemes = args.schemes.split(",")
    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_ranks

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in degrees:
            run_ranks(_rank_main, cp, args, tmp)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(cp)]
            first = ranks[0]["rows"]
            single = next((r for r in first if r["cp"] == 1), None)
            for r in first:
                r["peak_rss_mib_last_rank"] = ranks[-1]["rss"] if r["cp"] > 1 else None
                if r["cp"] > 1:  # the slowest rank sets the pace
                    r["cpu_s"] = max(row["cpu_s"] for k in ranks for row in k["rows"]
                                     if row["cp"] > 1 and row["scheme"] == r["scheme"])
                if single:
                    r["ratio_to_cp1"] = r["step_s"] / single["step_s"]
                    r["cpu_ratio_to_cp1"] = r["cpu_s"] / single["cpu_s"]
                r["group"] = cp
            rows += first
    print(f"tiny model, seq {args.seq}, one sequence per step, fp32, gloo, 1 thread per "
          f"process, {os.cpu_count()} CPUs (shared, load {os.getloadavg()[0]:.1f}), median of "
          f"{args.steps} steps" + ("" if args.no_single else
                                   "; each cp run alternates with a cp 1 run beside it"))
    print(f"{'cp':>3} {'scheme':<10} {'step s':>8} {'vs cp 1':>8} {'CPU s':>7} {'vs cp 1':>8} "
          f"{'comm waits s':>13} "
          f"{'ring alone s':>13} {'alone/step':>10} {'hidden ≥':>9} {'RSS MiB':>8}")
    for r in rows:
        ratio = f"{r['ratio_to_cp1']:.2f}" if "ratio_to_cp1" in r else "-"
        alone = f"{r['comm_alone_s']:.3f}" if "comm_alone_s" in r else "-"
        hidden = f"{100 * r['hidden_lower_bound']:.0f}%" if "comm_alone_s" in r else "-"
        share = f"{100 * r['alone_share_of_step']:.1f}%" if "comm_alone_s" in r else "-"
        waits = f"{r['comm_waits_s']:.3f}" if "comm_waits_s" in r else "-"
        rss = f"{r['peak_rss_mib_last_rank']:.0f}" if r.get("peak_rss_mib_last_rank") else "-"
        cpu_ratio = f"{r['cpu_ratio_to_cp1']:.2f}" if "cpu_ratio_to_cp1" in r else "-"
        print(f"{r['cp']:>3} {r['scheme']:<10} {r['step_s']:>8.3f} {ratio:>8} {r['cpu_s']:>7.2f} "
              f"{cpu_ratio:>8} {waits:>13} "
              f"{alone:>13} {share:>10} {hidden:>9} {rss:>8}")
    record = {"device": cpu_model(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "git": git_revision(),
              "load_average": os.getloadavg(),
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
