"""The bad-input sweep as a table: every case of tests/safety_cases.py after one completed run.

    python3 bench/runs/bad_inputs.py               # in-process (fast), as the test runs them
    python3 bench/runs/bad_inputs.py --processes   # each case a real `python -m fivefold.cli`

Prints one row per case (exit code, lines on stderr, whether the completed run stayed
byte-identical, the line itself) and writes bench/results/bad_inputs.json.
"""

import argparse
import contextlib
import io
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from safety_cases import SMALL, cases, dirs, make_world

from fivefold.cli import main
from fivefold.host import cpu_label


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file()}


def in_process(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def note_cases(root: Path) -> list[tuple[str, list[str], str]]:
    """Harmless settings: the command does its work (exit 0) and prints one note."""
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me, na\xefve\n".encode("latin-1"))
    one = ["train", *SMALL, "--train.steps", "1"]
    return [
        ("zero 3 at dp 1", [*one, "--parallel.zero", "3", *dirs(root / "n1")],
         "nothing is sharded"),
        ("recompute auto's plan", [*one, "--train.recompute", "auto",
                                   "--train.memory_budget_gib", "0.01", "--log.progress",
                                   "true", *dirs(root / "n2")],  # with the run's other lines
         "recompute auto under"),
        ("prepare non-UTF-8 text", ["prepare", str(root / "latin1.txt"), "-o",
                                    str(root / "latin1.bin")], "not valid UTF-8"),
    ]


def run_notes(root: Path) -> list[dict]:
    rows = []
    for name, argv, words in note_cases(root):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = main(argv)
        lines = [ln for ln in out.getvalue().splitlines() if words in ln]
        rows.append({"case": name, "command": argv[0], "exit": code, "want": 0,
                     "ok": code == 0 and len(lines) == 1,
                     "line": (lines[0] if lines else "").replace(str(root), "…")})
    return rows


def as_process(argv: list[str]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "fivefold.cli", *argv], capture_output=True,
                          text=True)
    return proc.returncode, proc.stderr


def main_bench() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", action="store_true", help="run each case as a process")
    args = ap.parse_args()
    run_case = as_process if args.processes else in_process
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = root / "run"
        code, err = in_process(["train", *SMALL, "--train.steps", "4", "--checkpoint.every",
                                "2", *dirs(run)])
        assert code == 0, err
        (root / "world").mkdir()
        world = make_world(root / "world", run)
        rows, start = [], time.perf_counter()
        for name, argv, want_code, want_text in cases(world):
            before = snapshot(run)
            code, err = run_case(argv)
            lines = err.strip().splitlines()
            ok = (code == want_code and len(lines) == 1 and want_text in lines[0]
                  and "Traceback" not in err and snapshot(run) == before)
            rows.append({"case": name, "command": argv[0], "exit": code, "want": want_code,
                         "stderr_lines": len(lines), "run_intact": snapshot(run) == before,
                         "ok": ok, "line": (lines[0] if lines else "").replace(str(root), "…")})
        elapsed = time.perf_counter() - start
        notes = run_notes(root)
    print(f"{'case':<28} {'cmd':<9} exit lines intact  line")
    for r in rows:
        mark = "" if r["ok"] else "  <-- FAIL"
        line = r["line"].replace(str(root), "…")
        print(f"{r['case']:<28} {r['command']:<9} {r['exit']:>4} {r['stderr_lines']:>5} "
              f"{'yes' if r['run_intact'] else 'NO':>6}  {line[:110]}{mark}")
    for r in notes:
        line = r["line"].replace(str(root), "…")
        print(f"{r['case']:<28} {r['command']:<9} {r['exit']:>4}  note  {line[:110]}"
              + ("" if r["ok"] else "  <-- FAIL"))
    passed = sum(r["ok"] for r in rows)
    print(f"{passed}/{len(rows)} cases pass ({'processes' if args.processes else 'in-process'}, "
          f"{elapsed:.1f} s)")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=Path(__file__).parent).stdout.strip()
    import torch

    out = Path(__file__).resolve().parents[1] / "results" / "bad_inputs.json"
    out.write_text(json.dumps({
        "device": cpu_label(),
        "python": platform.python_version(), "torch": torch.__version__, "git": rev,
        "mode": "processes" if args.processes else "in-process", "seconds": elapsed,
        "passed": passed, "cases": rows, "notes": notes}, indent=1))
    print(f"wrote {out}")
    return 0 if passed == len(rows) and all(r["ok"] for r in notes) else 1


if __name__ == "__main__":
    sys.exit(main_bench())
