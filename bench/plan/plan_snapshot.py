"""The planner's outputs on a fixed set of inputs, written to one file: a refactor of plan/
that must not change behaviour diffs the file from before against the one from after.

    PYTHONPATH=src python3 bench/plan/plan_snapshot.py --out before.txt
    ... change plan/ ...
    PYTHONPATH=src python3 bench/plan/plan_snapshot.py --out after.txt && diff before.txt after.txt

Runs `fivefold plan` in-process (explain, search, --config, --serve, --json, conventions,
LoRA, FP8, MoE, recompute auto, offload, bad inputs) and `parallel.layout = auto`'s choice
(plan/auto_layout.py) on a few configs. Wall-clock figures (a search's elapsed seconds) are
masked and the search's progress lines on stderr dropped: everything else must be
byte-identical.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import sys
import time
from pathlib import Path

CONFIG = "examples/llama-8b-h100.toml"

PLAN_RUNS = [
    # explain one layout
    "--model llama-3.1-8b --gpus 8 --seq-len 8192 --gbs 64 --layout tp=2,zero=1,mbs=1",
    "--model llama-3.1-8b --gpus 8 --seq-len 8192 --gbs 64 --layout tp=2,zero=1,mbs=1 --json",
    "--model llama-3.1-70b --gpus 64 --layout tp=8,pp=2,zero=1,recompute=selective",
    "--model llama-3.1-70b --gpus 64 --layout tp=8,pp=4,zero=1,schedule=interleaved,"
    "virtual_stages=2 --json",
    "--model llama-3.1-70b --gpus 64 --layout tp=4,pp=4,zero=1,schedule=zb --gbs 64",
    "--model llama-3.1-70b --gpus 64 --layout tp=4,pp=4,zero=1,schedule=dualpipev --gbs 64",
    "--model llama-3.1-70b --gpus 32 --layout tp=8,zero=3,mbs=1,recompute=full --json",
    "--model llama-3.1-8b --gpus 8 --layout zero=1,offload=true,mbs=2",
    "--model llama-3.1-8b --gpus 8 --layout zero=2,mbs=1 --grad-sync microbatch --json",
    "--model llama-3.1-8b --gpus 8 --layout cp=2,tp=2,zero=1 --seq-len 32768 --gbs 16",
    "--model llama-3.1-8b --gpus 8 --layout cp=4,zero=1,cp_comm=allgather --seq-len 32768"
    " --gbs 16",
    "--model llama-3.1-8b --gpus 8 --gpu h100 --precision fp8 --layout zero=3,mbs=1",
    "--model llama-3.1-8b --gpus 8 --gpu h100 --precision fp8 --layout zero=3,mbs=1"
    " --fp8-allgather --json",
    "--model llama-3.1-8b --gpus 4 --layout pp=2,zero=1 --recompute auto --memory-budget-gib 40",
    "--model llama-3.1-8b --gpus 4 --layout pp=2,zero=1 --recompute auto --memory-budget-gib 60"
    " --json",
    "--model llama-3.1-8b --gpus 1 --lora-rank 16 --lora-base nf4 --layout mbs=1",
    "--model mixtral-8x7b --gpus 64 --layout ep=8,tp=2,pp=2,zero=1 --gbs 256",
    "--model qwen3-30b-a3b --gpus 16 --layout ep=8,zero=1,mbs=1 --gbs 64 --json",
    "--model llama-3.1-8b --gpus 8 --optimizer muon --layout zero=1,mbs=1",
    "--model llama-3.1-8b --gpus 8 --optimizer adafactor --layout zero=3,mbs=1",
    "--model llama-3.1-8b --gpus 16 --hw gpus_per_node=4 --hw inter_node_gbps=25"
    " --layout tp=4,pp=2,zero=1",
    "--params 82e9 --gpu a100-80gb --gpus 1024 --seq-len 2048 --gbs 1536"
    " --layout tp=8,pp=8,zero=1 --tokens 1e12 --hw price_per_gpu_hour=2",
    # conventions
    "--model llama-3.1-8b --gpus 8 --convention torchtitan --layout dp=8,zero=3,mbs=1,"
    "recompute=selective --seq-len 8192 --gbs 8",
    "--model llama-3.1-8b --gpus 512 --convention nanotron --layout dp=64,tp=8,mbs=1,zero=1"
    " --seq-len 4096 --gbs 256 --json",
    "--model llama-3.1-70b --gpus 64 --convention megatron --layout tp=8,pp=2,mbs=1"
    " --seq-len 4096 --gbs 128",
    "--model llama-3.1-8b --gpus 16 --convention deepspeed --layout zero=3,mbs=1 --gbs 64",
    # search
    "--model llama-3.1-8b --gpus 8 --seq-len 8192 --gbs 64",
    "--model llama-3.1-8b --gpus 8 --seq-len 8192 --gbs 64 --json",
    "--model llama-3.1-70b --gpus 64 --seq-len 8192 --gbs 128 --top 5",
    "--model llama-3.1-70b --gpus 512 --seq-len 8192 --gbs-tokens 4e6 --top 3",
    "--model mixtral-8x7b --gpus 32 --gbs 128 --top 4 --json",
    "--model llama-3.1-8b --gpus 8 --convention nanotron --gbs 64 --top 4",
    "--model llama-3.1-8b --gpus 8 --gbs 64 --space 'tp=1,2 pp=1,2 recompute=auto,none'"
    " --memory-budget-gib 30 --top 4",
    "--model llama-3.1-8b --gpus 8 --gbs 64 --space 'offload=false,true,nvme zero=1,3'"
    " --top 4 --json",
    "--model llama-3.1-70b --gpus 8 --gbs 64 --top 3",
    "--model llama-3.1-8b --gpus 12 --gbs 977",
    "--model llama-3.1-8b --gpus 1 --lora-rank 16 --lora-base nf4",
    "--model llama-3.1-405b --gpus 8 --gbs 64 --top 3",
    # a training config
    f"--config {CONFIG}",
    f"--config {CONFIG} --json",
    f"--config {CONFIG} --parallel.tp 1 --parallel.dp 8 --parallel.sp false"
    " --train.recompute none",
    f"--config {CONFIG} --search --top 4",
    # serving
    "--serve --model llama-3.1-8b --context 2048 --output 256",
    "--serve --model llama-3.1-70b --gpu h100-sxm --tp 4",
    "--serve --model llama-3.1-8b --gpu h100-sxm --pp 2 --tp 2",
    "--serve --model llama-3.1-8b --kv-cache-dtype fp8 --context 2048 --output 256 --json -",
    # bad input: one line, exit 2
    "--model llama-3.1-8b --convention nope --layout tp=2",
    "--model llama-3.1-8b --gpus 8 --layout tp=3",
    "--model llama-3.1-8b --gpus 8 --layout tp=2 --gpus 16",
    "--model llama-3.1-8b --hw memory_gib=-1 --layout tp=2",
]

# parallel.layout = auto: (config overrides, ranks, budget GiB, on CPU, cores)
TINY = ["--model.preset", "tiny", "--model.hidden_size", "32", "--model.intermediate_size",
        "64", "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--train.seq_len", "32", "--train.gbs", "8", "--train.precision", "fp32",
        "--train.device", "cpu", "--data.tokenizer", "byte", "--parallel.layout", "auto"]
AUTO_RUNS = [
    (TINY, 1, 1.0, True, 0),
    (TINY, 2, 1.0, True, 0),
    (TINY, 4, 1.0, True, 2),
    (TINY + ["--parallel.tp", "2"], 4, 1.0, True, 0),
    (TINY + ["--train.recompute", "full"], 4, 1e-4, True, 0),
    (TINY + ["--parallel.pp", "3"], 4, 1.0, True, 0),
    (["--parallel.layout", "auto", "--model.preset", "llama-3.1-8b", "--train.seq_len",
      "8192", "--train.gbs", "64", "--train.precision", "bf16"], 8, 80.0, False, 0),
    (["--parallel.layout", "auto", "--model.preset", "llama-3.1-8b", "--train.seq_len",
      "4096", "--train.gbs", "32", "--train.precision", "bf16"], 16, 40.0, False, 0),
    (["--parallel.layout", "auto", "--model.preset", "llama-3.1-8b", "--train.seq_len",
      "4096", "--train.gbs", "32", "--train.precision", "bf16"], 4, 10.0, False, 0),
]


def _masked(text: str) -> str:
    text = re.sub(r"\(bound\); [0-9.]+ s", "(bound); <elapsed> s", text)
    text = re.sub(r'"elapsed_s": [0-9.e+-]+', '"elapsed_s": "<elapsed>"', text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("searching: "))


def plan_run(argv: list[str]) -> str:
    from fivefold.plan.cli_entry import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return (f"exit {code}\n--- stdout\n{_masked(out.getvalue())}\n"
            f"--- stderr\n{_masked(err.getvalue())}")


def auto_run(overrides: list[str], world: int, budget: float, on_cpu: bool, cores: int) -> str:
    from fivefold import config
    from fivefold.errors import ConfigError
    from fivefold.plan import auto_layout as planner
    from fivefold.plan.hardware import CATALOG

    cfg = config.load(None, overrides)
    base = None if on_cpu else CATALOG["h100-sxm"]
    hw, assume = planner.auto_hardware(base, min(world, 8), budget, None, on_cpu,
                                       0.0 if on_cpu else 200.0)
    precision = cfg.train.precision
    lines = []
    try:
        planner.check_ranks(cfg, world, min(world, 8), on_cpu, precision)
        pick = planner.choose(cfg, world, hw, assume, precision, "train.memory_budget_gib",
                              "the catalog", on_cpu, cores)
    except ConfigError as e:
        return f"ConfigError: {e}"
    lines += planner.describe(pick)
    lines.append(json.dumps(planner.record(pick), sort_keys=True, default=float))
    applied = planner.apply(cfg, pick.best, budget)
    lines.append(json.dumps({k: getattr(applied.parallel, k) for k in (
        "dp", "tp", "pp", "cp", "ep", "zero", "mbs", "schedule", "grad_sync")}, default=str))
    plan, why = planner.kept(cfg, planner.record(pick), world, hw, assume, precision)
    lines.append(f"kept: {plan.layout.short() if plan else None} {why!r}")
    lines.append(json.dumps(pick.best.to_dict(), sort_keys=True, default=float))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the file the outputs go to")
    args = ap.parse_args()

    start = time.perf_counter()
    parts = []
    for i, line in enumerate(PLAN_RUNS):
        parts.append(f"=== plan {i}: {line}\n{plan_run(shlex.split(line))}")
    for i, (overrides, world, budget, on_cpu, cores) in enumerate(AUTO_RUNS):
        parts.append(f"=== auto {i}: {' '.join(overrides)} world={world} budget={budget} "
                     f"cpu={on_cpu} cores={cores}\n"
                     f"{auto_run(overrides, world, budget, on_cpu, cores)}")
    Path(args.out).write_text("\n".join(parts) + "\n")
    print(f"{len(PLAN_RUNS)} plan runs and {len(AUTO_RUNS)} auto choices in "
          f"{time.perf_counter() - start:.1f} s -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
