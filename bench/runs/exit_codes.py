"""Exit codes of real torchrun jobs: how many of N consecutive 2- and 4-rank runs exit 0.

    python bench/runs/exit_codes.py [--runs 50] [--worlds 2 4] [--timeout-s 5] [--src DIR]

Each run is `torchrun --standalone --nproc-per-node W -m fivefold.cli train` with the issue's
layouts (W = 4: tp 2 × dp 2, ZeRO-1; W = 2: dp 2, ZeRO-1), a small model, 3 fp32 steps and
a checkpoint at the end. `--timeout-s` sets parallel.timeout_s, which also sets the
watchdog's heartbeat interval (timeout / 20, at least 0.05 s, at most 2 s): the default
of 5 s beats every 0.25 s, eight times as often as a default run, so a heartbeat thread still
inside a store call at interpreter exit (the SIGABRT after "done") shows up in tens of runs,
not hundreds. (Much lower timeouts end healthy runs on a heavily shared machine: a rank
starved of CPU for longer than the timeout during a step is, to the watchdog, lost.)
A run counts as clean when torchrun exits 0 and no rank printed "terminate called" or a
traceback. `--src` runs another tree's sources (e.g. an older
revision checked out elsewhere) for a before/after comparison.

The per-run wall time is reported as well; the machine is shared, so it is only indicative.
Results go to bench/results/exit_codes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fivefold.host import cpu_model

SMALL = ["--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "2", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "32",
         "--train.gbs", "8", "--train.steps", "3", "--train.warmup_steps", "0",
         "--train.eval_every", "0", "--train.precision", "fp32", "--train.device", "cpu",
         "--log.progress", "false", "--log.tensorboard", "false"]
LAYOUTS = {2: ["--parallel.dp", "2", "--parallel.zero", "1"],
           4: ["--parallel.tp", "2", "--parallel.dp", "2", "--parallel.zero", "1"]}


def one_run(world: int, src: str, timeout_s: float, workdir: Path) -> tuple[bool, str, float]:
    out = Path(tempfile.mkdtemp(dir=workdir))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "fivefold.cli", "train", *SMALL, *LAYOUTS[world],
           "--parallel.timeout_s", str(timeout_s), "--checkpoint.dir", str(out / "ck"),
           "--log.dir", str(out)]
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    took = time.perf_counter() - started
    text = (proc.stdout + proc.stderr).replace(sys.executable, "python3")  # no machine path
    clean = proc.returncode == 0 and "terminate called" not in text and "Traceback" not in text
    why = "" if clean else f"exit {proc.returncode}: " + " | ".join(
        ln for ln in text.splitlines() if "terminate called" in ln or "exitcode" in ln)[:300]
    return clean, why, took


def git_revision(src: str) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per world size")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--timeout-s", type=float, default=5.0, help="parallel.timeout_s")
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2] / "src"))
    parser.add_argument("--rev", help="the git revision of --src (default: asked of git)")
    parser.add_argument("--out", default="exit_codes.json")
    args = parser.parse_args()
    results = {"device": f"{cpu_model()}, {os.cpu_count()} CPU "
                         f"cores (shared)", "torch": torch.__version__,
               "python": platform.python_version(), "src": Path(args.src).name,
               "git": args.rev or git_revision(args.src), "parallel.timeout_s": args.timeout_s,
               "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            clean, failures, times = 0, [], []
            for i in range(args.runs):
                ok, why, took = one_run(world, args.src, args.timeout_s, Path(tmp))
                clean += ok
                times.append(round(took, 2))
                if not ok:
                    failures.append(f"run {i + 1}: {why}")
                    print(f"  {world} ranks, run {i + 1}: FAILED {why}", flush=True)
            print(f"{world} ranks: {clean}/{args.runs} runs exited 0 cleanly "
                  f"(median {sorted(times)[len(times) // 2]:.1f} s per run)", flush=True)
            results["worlds"][str(world)] = {"runs": args.runs, "clean": clean,
                                             "failures": failures, "seconds": times}
    path = Path(__file__).resolve().parents[1] / "results" / args.out
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
