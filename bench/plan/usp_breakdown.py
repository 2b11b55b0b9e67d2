"""The planner's tokens/s error on the Ultra-Scale Playbook's runs by GPU count, tp and pp.

    python bench/plan/usp_breakdown.py            # writes bench/results/usp_breakdown.json
    python bench/plan/usp_breakdown.py --out PATH

Ok runs the planner plans (`--convention nanotron`, its factors as they stand), grouped by
each of n_gpus, tp and pp: runs, median predicted/measured, median absolute error and the
share within 20%. It imports only planner names older revisions have too, so a previous
revision's planner can be scored with it:

    git archive 05aa091 src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python bench/plan/usp_breakdown.py --rev 05aa091 \
        --out bench/results/usp_breakdown_05aa091.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

from usp_calibration import HW, ROOT, _cpu_model, load, run

OUT = ROOT / "bench" / "results" / "usp_breakdown.json"
DIMENSIONS = ("n_gpus", "tp", "pp")


def breakdown(rows: list[dict], preds: list[dict]) -> dict:
    """{dimension: {value: {runs, median_ratio, median_abs_error, within_20pct}}}."""
    out: dict = {}
    for dim in DIMENSIONS:
        groups: dict[int, list[float]] = defaultdict(list)
        for row, p in zip(rows, preds):
            if row["status"] == "ok" and p["plannable"]:
                groups[int(row[dim])].append(p["tokens_per_s_per_gpu"]
                                             / float(row["tokens_per_s_per_gpu"]))
        out[dim] = {str(k): {"runs": len(v), "median_ratio": statistics.median(v),
                             "median_abs_error": statistics.median(abs(x - 1) for x in v),
                             "within_20pct": sum(abs(x - 1) <= 0.2 for x in v) / len(v)}
                    for k, v in sorted(groups.items())}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rev", help="the revision the planner on PYTHONPATH is (default: git's "
                    "HEAD where it lies)")
    args = ap.parse_args(argv)
    rows = load()
    table = breakdown(rows, run(rows, hw_overrides=HW))
    import fivefold

    src = Path(fivefold.__file__).resolve().parent.parent.parent
    rev = args.rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, cwd=src).stdout.strip()
    for dim, groups in table.items():
        for value, g in groups.items():
            print(f"{dim} {value:>4}: {g['runs']:>3} runs, predicted/measured "
                  f"{g['median_ratio']:.2f}, median error {g['median_abs_error']:.1%}, "
                  f"within 20% {g['within_20pct']:.0%}")
    out = {"machine": {"host": platform.node(), "cpu": _cpu_model(),
                       "python": platform.python_version()}, "git": rev, "by": table}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
