"""The parity tests under every CPU kernel family and thread count of this machine.

Two float32 runs that differ only in the order of their sums are what a parity test
compares; another CPU changes that order for the single-process oracle too. This machine
can change it in two ways: ATEN_CPU_CAPABILITY picks torch's vectorised kernels (the best
the CPU has, avx2, or the scalar `default`), and the thread count splits each reduction
differently. Each combination runs `pytest -m "parity and not slow"` (add --slow for all)
with FIVEFOLD_PARITY_LOG set, so besides pass/fail it records every check's error over its
bound (tests/tolerances.py): the worst ratio is the margin left on that kernel.

    python3 bench/parallel/parity_kernels.py                 # 3 capabilities × 1 and 2 threads
    python3 bench/parallel/parity_kernels.py --capabilities avx2 --threads 1

Writes bench/results/parity_kernels.json.
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
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from fivefold.host import cpu_label  # noqa: E402
from fivefold.train.bench import git_revision  # noqa: E402


def run_combination(capability: str, threads: int, marker: str, extra: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    if capability != "native":
        env["ATEN_CPU_CAPABILITY"] = capability
    else:
        env.pop("ATEN_CPU_CAPABILITY", None)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "parity.jsonl"
        env["FIVEFOLD_PARITY_LOG"] = str(log)
        probe = subprocess.run([sys.executable, "-c", "import torch; print("
                                "torch.backends.cpu.get_cpu_capability(), "
                                "torch.get_num_threads())"], env=env, capture_output=True,
                               text=True)
        start = time.perf_counter()
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", marker, "-p",
                               "no:cacheprovider", f"--junitxml={junit}", "-rfE", *extra,
                               str(ROOT / "tests")],
                              env=env, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        checks = [json.loads(line) for line in log.open()] if log.exists() else []
        suite = ET.parse(junit).getroot() if junit.exists() else None
    suite = suite.find("testsuite") if suite is not None and suite.tag == "testsuites" else suite
    got = {k: int(suite.get(k, 0)) if suite is not None else 0
           for k in ("tests", "failures", "errors", "skipped")}
    counts = {"passed": got["tests"] - got["failures"] - got["errors"] - got["skipped"],
              "failed": got["failures"], "error": got["errors"], "skipped": got["skipped"]}
    tail = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
            f"{counts['skipped']} skipped")
    worst = max(checks, key=lambda c: c["err"] / c["bound"], default=None)
    failures = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return {
        "capability_asked": capability,
        "capability_used": probe.stdout.split()[0] if probe.stdout else "?",
        "threads": threads, "exit_code": proc.returncode, "summary": tail,
        "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
        "errors": counts["error"], "skipped": counts["skipped"], "failures": failures,
        "checks": len(checks),
        "worst_ratio": round(worst["err"] / worst["bound"], 4) if worst else None,
        "worst_check": worst, "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capabilities", nargs="+", default=["native", "avx2", "default"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--slow", action="store_true", help="include the slow parity tests")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "parity_kernels.json"))
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args()
    marker = "parity" if args.slow else "parity and not slow"
    rows = []
    record = {
        "benchmark": "parity_kernels", "machine": cpu_label(), "git": git_revision(),
        "python": platform.python_version(), "torch": torch.__version__,
        "native_capability": torch.backends.cpu.get_cpu_capability(),
        "marker": marker, "rows": rows,
    }
    for threads in args.threads:  # every kernel at one thread first: the cheapest spread
        for capability in args.capabilities:
            row = run_combination(capability, threads, marker, args.pytest_args)
            row["load_average_1m"] = os.getloadavg()[0]
            rows.append(row)
            print(f"{capability:>8} ({row['capability_used']}) threads {threads}: "
                  f"{row['summary']}; worst error/bound {row['worst_ratio']} over "
                  f"{row['checks']} checks ({(row['worst_check'] or {}).get('label')}); "
                  f"{row['seconds']} s", flush=True)
            # written after every combination, so a long sweep keeps what it finished
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {Path(args.out).relative_to(ROOT)}")
    sys.exit(1 if any(r["exit_code"] != 0 for r in rows) else 0)


if __name__ == "__main__":
    main()
