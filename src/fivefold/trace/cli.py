"""`fivefold trace`: the GPU cost of one training step, counted on this machine.

    fivefold trace [--config FILE] [--section.key VALUE ...] [--gpu h100] [--json OUT]
                   [--steps 2] [--launch-us 10.9] [--view-us 2.3] [--ops 12]

Runs real training steps of the config on the meta device (no data, no memory: any model
size), counts the kernels, bytes, FLOPs and host syncs of the last one per part, and
predicts its time on the GPU from the planner's device table, the planner's own prediction
beside it. One rank, eager. See docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fivefold.config import ArgumentParser, ConfigError


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="fivefold trace",
        description="Count the kernels, bytes, FLOPs and host syncs of one training step of "
                    "a config (run on the meta device, any size) and predict its time on a "
                    "GPU of the planner's catalog. Config keys are overridden as "
                    "--section.key VALUE, as in `fivefold train`.")
    parser.add_argument("--config", help="a TOML file as for `fivefold train`")
    parser.add_argument("--gpu", default="h100", help="a GPU of the planner's catalog "
                                                      "(`fivefold plan --help` lists them)")
    parser.add_argument("--json", default="", metavar="OUT", help="write the trace as JSON")
    parser.add_argument("--steps", type=int, default=2,
                        help="steps to run; the last is traced (2: the optimizer's states exist)")
    parser.add_argument("--launch-us", type=float, default=None,
                        help="host time per kernel launch, us (default: the H100 profile's)")
    parser.add_argument("--view-us", type=float, default=None,
                        help="host time per op that launches nothing (a view), us")
    parser.add_argument("--ops", type=int, default=12, help="the most frequent kernels to list")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 1:
        raise ConfigError(f"--steps = {args.steps} must be >= 1")
    for key in ("launch_us", "view_us"):
        if getattr(args, key) is not None and getattr(args, key) < 0:
            raise ConfigError(f"--{key.replace('_', '-')} = {getattr(args, key)} must be >= 0")
    if args.ops < 0:
        raise ConfigError(f"--ops = {args.ops} must be >= 0")
    from fivefold.trace.report import summary, table
    from fivefold.trace.roofline import DEFAULT_LAUNCH_US, DEFAULT_VIEW_US, device_for
    from fivefold.trace.step import load_config, trace_step

    device_for(args.gpu)  # an unknown GPU: one line before the config is read
    cfg = load_config(args.config, overrides)
    out = Path(args.json) if args.json else None
    if out is not None and out.exists() and out.is_dir():
        raise ConfigError(f"--json {out} is a directory; give a file name")

    def progress(text: str) -> None:
        print(f"trace: {text}", file=sys.stderr, flush=True)

    trace = trace_step(cfg, gpu=args.gpu, steps=args.steps, progress=progress,
                       launch_us=DEFAULT_LAUNCH_US if args.launch_us is None
                       else args.launch_us,
                       view_us=DEFAULT_VIEW_US if args.view_us is None else args.view_us)
    print(table(trace))
    if args.ops:
        print("kernels by op: " + ", ".join(
            f"{op.removeprefix('aten.')} {n:,}" for op, n in trace.ops.most_common(args.ops)))
    print(summary(trace), flush=True)
    if out is not None:
        import platform

        import torch

        from fivefold.host import cpu_model
        from fivefold.train.bench import git_revision

        record = {"kind": "trace", "git_revision": git_revision(),
                  "command": "fivefold trace " + " ".join(argv),
                  "machine": {"host_cpu": cpu_model(), "python": platform.python_version(),
                              "torch": torch.__version__,
                              "note": "traced on the meta device: no time measured here"},
                  **trace.to_json()}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}", flush=True)
    return 0
