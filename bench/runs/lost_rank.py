"""How long survivors take to name a lost rank: the watchdog's speed, which the tests bound
only loosely (tests/test_zero.py asserts < 30 s, far below gloo's 120 s, so a loaded machine
cannot fail them).

    python bench/runs/lost_rank.py [--runs 3] [--timeout-s 3]

Each run forks 4 gloo ranks training a small model at dp 4 / ZeRO-2 (the fault test's run,
`tests/test_zero.py::_fault_run`), SIGKILLs (`kill`) or SIGSTOPs (`stop`) rank 2 in its
backward at step 2, and measures from that signal to the last survivor's exit. Every
survivor must name rank 2, or the run counts as a failure. Prints the median and the worst
per kind against parallel.timeout_s, and writes bench/results/lost_rank.json with the
machine, torch version and git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from fivefold.host import cpu_label

HERE = Path(__file__).resolve().parents[1]  # bench/
sys.path.insert(0, str(HERE.parent / "tests"))  # the fault run the tests use


def _git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    from test_zero import _fault_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=3.0, help="parallel.timeout_s")
    args = ap.parse_args()
    device = cpu_label()
    rows = {}
    for how in ("kill", "stop"):
        took, named = [], 0
        for _ in range(args.runs):
            _, errors, seconds = _fault_run(how, timeout_s=args.timeout_s)
            took.append(seconds)
            named += all("lost rank 2" in errors[r] for r in (0, 1, 3))
        rows[how] = {"median_s": statistics.median(took), "worst_s": max(took),
                     "runs": args.runs, "every_survivor_named_rank_2": named}
        print(f"{how:>4}: survivors ended {statistics.median(took):.2f} s (median), "
              f"{max(took):.2f} s (worst) after the fault; timeout_s {args.timeout_s:g}, "
              f"ratio {statistics.median(took) / args.timeout_s:.2f}; every survivor named "
              f"rank 2 in {named} of {args.runs} runs")
    result = {"device": device, "torch": torch.__version__, "git": _git_revision(),
              "load": "2 CPU cores shared with other jobs" if (os.cpu_count() or 1) <= 2 else "",
              "timeout_s": args.timeout_s, "world": 4, "rows": rows}
    path = HERE / "results" / "lost_rank.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
