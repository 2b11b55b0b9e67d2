"""`fivefold trace` of another revision's engine: its step counted with this tree's tracer.

    python bench/train/trace_revision.py REV [--job blocks_8b|default] [--gpu h100] [--out FILE]
                   [--launch-us 10.9] [--view-us 2.3] [--section.key VALUE ...]

REV's src/ is extracted (git archive) into a temporary directory and put first on the path
of a child process; the child imports the engine from there and the tracer (src/fivefold/
trace/, new code that REV lacks) from this tree, then traces one step of a job as `fivefold
trace` does: `blocks_8b` (bench/gpu.py's BLOCKS_8B, the 8B-shaped 2-block step, 8192 tokens,
bf16; GPU item train_8b_blocks) or `default` (the default config; item train_default), or
the config the overrides give. Where bench/results/ holds a GPU run of REV (gpu-*-REV.json)
with the job's item, the trace's predicted step time is set beside the measured one and the
error stated.

At 24463d9 the H100 profile (bench/results/gpu-profile-nvidia-h100-80gb-hbm3-efcc609.txt)
counted 31,563 `add_` kernels in the step (the chunked loss's); the JSON's
`loss_add_kernels` is the trace's count of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
BLOCKS_8B = ["--model.preset", "llama-3.1-8b", "--model.num_layers", "2", "--data.tokenizer",
             "byte", "--train.seq_len", "8192", "--train.gbs", "1", "--parallel.mbs", "1"]
JOBS = {"blocks_8b": (BLOCKS_8B, "train_8b_blocks"), "default": ([], "train_default")}

CHILD = r"""
import importlib.util, json, sys
tracer_dir, gpu, out, costs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
overrides = sys.argv[5:]
launch_us, view_us = (float(v) for v in costs.split(","))
import fivefold
spec = importlib.util.spec_from_file_location(
    "fivefold.trace", tracer_dir + "/__init__.py", submodule_search_locations=[tracer_dir])
module = importlib.util.module_from_spec(spec)
sys.modules["fivefold.trace"] = module
spec.loader.exec_module(module)
from fivefold.trace.report import summary, table
engine = fivefold.__file__
t = module.trace_step(module.load_config(None, overrides), gpu=gpu, launch_us=launch_us,
                      view_us=view_us,
                      progress=lambda s: print("trace:", s, file=sys.stderr, flush=True))
print(table(t))
print(summary(t), flush=True)
record = t.to_json()
record["engine_file"] = engine
json.dump(record, open(out, "w"))
"""


def measured_step(rev: str, item_name: str) -> tuple[float | None, str | None]:
    """The step time of item `item_name` in a GPU run of `rev` under bench/results, and its
    file."""
    for path in sorted((ROOT / "bench" / "results").glob("gpu-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not str(data.get("git_revision", "")).startswith(rev):
            continue
        item = data.get("items", {}).get(item_name, {})
        if item.get("status") == "ok":
            return item["step_time_s"], str(path.relative_to(ROOT))
    return None, None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rev", help="a git revision of this repository, e.g. 24463d9")
    parser.add_argument("--job", choices=sorted(JOBS), default="blocks_8b",
                        help="the config traced (overrides given: that config, no item)")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--launch-us", type=float, default=None,
                        help="host time per kernel, us (default: fivefold trace's)")
    parser.add_argument("--view-us", type=float, default=None,
                        help="host time per op that launches nothing, us")
    parser.add_argument("--out", default="", help="default: bench/results/trace-REV.json")
    args, overrides = parser.parse_known_args()
    from revisions import baseline_src

    rev = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    item = None if overrides else JOBS[args.job][1]
    overrides = overrides or JOBS[args.job][0]
    with tempfile.TemporaryDirectory() as tmp:
        src = baseline_src(rev, Path(tmp))
        out = Path(tmp) / "trace.json"
        env = {**os.environ, "PYTHONPATH": str(src)}
        from fivefold.trace import DEFAULT_LAUNCH_US, DEFAULT_VIEW_US

        costs = (f"{DEFAULT_LAUNCH_US if args.launch_us is None else args.launch_us},"
                 f"{DEFAULT_VIEW_US if args.view_us is None else args.view_us}")
        subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "src" / "fivefold" / "trace"),
                        args.gpu, str(out), costs, *overrides], env=env, check=True, cwd=ROOT)
        trace = json.loads(out.read_text())
    if not trace.pop("engine_file").startswith(str(src)):
        raise SystemExit("the child imported the engine from elsewhere than the extracted "
                         "revision")
    import torch

    from fivefold.host import cpu_model
    from fivefold.train.bench import git_revision

    loss_adds = trace["parts"].get("loss", {}).get("ops", {}).get("aten.add_", 0)
    measured, source = measured_step(rev[:12], item) if item else (None, None)
    predicted = trace["time"]["step_s"]
    record = {
        "kind": "trace_revision", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "traced_revision": rev, "git_revision": git_revision(),
        "command": "python bench/train/trace_revision.py " + " ".join(sys.argv[1:]),
        "machine": {"host_cpu": cpu_model(), "arch": platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "note": "the trace runs on the meta device: no time is measured here"},
        "job": args.job if item else None, "gpu_item": item, "overrides": overrides,
        "loss_add_kernels": loss_adds,
        "step_add_kernels": trace["ops"].get("aten.add_", 0),
        "predicted_step_s": predicted, "measured_step_s": measured, "measured_in": source,
        "error": None if measured is None else predicted / measured - 1.0,
        "trace": trace}
    print(f"{rev[:12]}: loss add_ kernels {loss_adds:,} (step {record['step_add_kernels']:,}),"
          f" {trace['totals']['kernels']:,} kernels, {trace['totals']['syncs']} syncs; "
          f"predicted {predicted:.3f} s on {trace['gpu']}"
          + (f", measured {measured:.3f} s ({source}): error {record['error']:+.1%}"
             if measured is not None else ", no GPU run of this config and revision under "
                                          "bench/results"))
    name = f"trace-{rev[:12]}" + (f"-{args.job}" if item else "-custom")
    path = Path(args.out or ROOT / "bench" / "results" / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
