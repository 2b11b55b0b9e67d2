"""Context parallelism on CPU gloo: step time of cp 2 and cp 4 against one process, at the
same sequence length, and how much of the ring's communication the attention hides.

Every run trains the `tiny` preset (4 layers, hidden 128, 4 heads, 2 kv heads) on one
sequence of `--seq` tokens per step (fp32, one thread per process), timing whole training
steps (forward, backward, gradient reduction over dp×cp, AdamW) as the trainer runs them;
the median of the timed steps after warm-up. cp = 1 is one process; cp = n is n gloo ranks.

Hidden communication: every wait on a ring transfer is timed inside the step (`waits`);
then the same transfers are timed alone, back to back, with nothing to overlap (`alone`).
A wait also absorbs the other ranks being late (skew: a busy, shared CPU deschedules them),
so hidden = 1 − min(waits, alone) / alone is a lower bound of what the overlap hides, and
alone / step bounds what the ring could cost if nothing were hidden at all.

    python bench/cp.py                          # seq 8192: cp 1, 2, 4; writes bench/results/cp.json
    python bench/cp.py --seq 32768 --degrees 4 --steps 1 --warmup 0 --out bench/results/cp_32k.json

The cores may be shared with other work: compare the ratios of one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


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


def time_steps(trainer, args, clock):
    times, waits = [], []
    for i in range(args.warmup + args.steps):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        clock[0] = 0.0
        start = time.perf_counter()
        trainer.train_step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            waits.append(clock[0])
    return statistics.median(times), statistics.median(waits)


def transfers_alone(trainer, repeats: int) -> float:
    """Seconds of one step's ring transfers run back to back with no compute between."""
    from fivefold.parallel import comm

    ledger = trainer.dims.ledger
    sends = [e for e in ledger.entries if e.op == "send" and e.group == "cp"]
    group = trainer.dims["cp"]
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
    from fivefold.parallel import comm
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.trainer import Trainer

    clock = [0.0]
    original = comm.batch_p2p
    comm.batch_p2p = lambda ops, group: [TimedWork(w, clock) for w in original(ops, group)]
    rows = []
    for scheme in args.schemes:
        tmp = Path(tempfile.mkdtemp())
        cfg = config(tmp, args, world, scheme)
        trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
        if scheme == "allgather":  # a collective: time its whole call instead of the waits
            for name in ("all_gather", "reduce_scatter"):
                fn = getattr(comm, name)

                def timed(*a, _fn=fn, **kw):
                    start = time.perf_counter()
                    out = _fn(*a, **kw)
                    clock[0] += time.perf_counter() - start
                    return out

                setattr(comm, name, timed)
        step_s, exposed_s = time_steps(trainer, args, clock)
        row = {"cp": world, "scheme": scheme, "step_s": step_s, "comm_exposed_s": exposed_s,
               "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if scheme == "ring":
            trainer.dims.ledger.enabled = True
            trainer.dims.ledger.reset()
            trainer.train_step()
            trainer.dims.ledger.enabled = False
            comm.batch_p2p = original
            row["comm_alone_s"] = transfers_alone(trainer, 3)
            comm.batch_p2p = lambda ops, group: [TimedWork(w, clock)
                                                 for w in original(ops, group)]
            alone = row["comm_alone_s"]
            row["hidden_lower_bound"] = 1 - min(exposed_s, alone) / alone
            row["alone_share_of_step"] = alone / step_s
        rows.append(row)
    if rank == 0:
        Path(out_dir, f"cp{world}.json").write_text(json.dumps(rows))


def single_process(args) -> dict:
    """The cp = 1 run in a fresh process with one thread, like each rank of the others."""
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); import cp; "
            f"print(json.dumps(cp.single_main({json.dumps(vars(args))!r})))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def single_main(arg_json: str) -> dict:
    from fivefold.train.trainer import Trainer

    torch.set_num_threads(1)
    args = argparse.Namespace(**json.loads(arg_json))
    cfg = config(Path(tempfile.mkdtemp()), args, 1, "ring")
    step_s, _ = time_steps(Trainer(cfg, quiet=True), args, [0.0])
    return {"cp": 1, "scheme": "-", "step_s": step_s,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


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

    rows = [] if args.no_single else [single_process(
        argparse.Namespace(seq=args.seq, steps=args.steps, warmup=args.warmup))]
    with tempfile.TemporaryDirectory() as tmp:
        for cp in degrees:
            run_ranks(_rank_main, cp, args, tmp)
            rows += json.loads(Path(tmp, f"cp{cp}.json").read_text())
    base = rows[0]["step_s"] if not args.no_single else None
    print(f"tiny model, seq {args.seq}, one sequence per step, fp32, gloo, 1 thread per "
          f"process, {os.cpu_count()} CPUs (shared), median of {args.steps} steps")
    print(f"{'cp':>3} {'scheme':<10} {'step s':>8} {'vs cp 1':>8} {'comm waits s':>13} "
          f"{'ring alone s':>13} {'alone/step':>10} {'hidden ≥':>9} {'max RSS MiB':>12}")
    for r in rows:
        ratio = f"{r['step_s'] / base:.2f}" if base else "-"
        alone = f"{r['comm_alone_s']:.3f}" if "comm_alone_s" in r else "-"
        hidden = f"{100 * r['hidden_lower_bound']:.0f}%" if "comm_alone_s" in r else "-"
        share = f"{100 * r['alone_share_of_step']:.1f}%" if "comm_alone_s" in r else "-"
        exposed = f"{r['comm_exposed_s']:.3f}" if "comm_exposed_s" in r else "-"
        print(f"{r['cp']:>3} {r['scheme']:<10} {r['step_s']:>8.3f} {ratio:>8} {exposed:>13} "
              f"{alone:>13} {share:>10} {hidden:>9} {r['max_rss_mib']:>12.0f}")
        if base:
            r["ratio_to_cp1"] = r["step_s"] / base
    record = {"device": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "git": git_revision(),
              "load_average": os.getloadavg(),
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
