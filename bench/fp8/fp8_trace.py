"""The trace of one FP8 linear, forward + backward, per recipe: kernels and bytes against
bf16's, on the fused casts (a GPU's path) and on the step-by-step path the CPU keeps.

    python3 bench/fp8/fp8_trace.py [--tokens 8192 --k 4096 --n 4096] [--gpu h100]

The trace runs on the meta device taking the GPU's branches (fivefold.trace): no GPU is
needed and nothing is timed; kernels and bytes are what the traced GPU would launch and
move (each op's inputs read and outputs written). tests/test_fp8_trace.py holds the budgets
at the default shape. Rows: the three recipes with dynamic scaling, tensorwise with delayed
scaling (lowp/delayed.py; its steady state, and its first step, which is dynamic), and
rowwise_gw_hp (torchao's ROWWISE_WITH_GW_HP). Writes bench/results/fp8_trace.json (shape,
torch, git revision).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def trace_linear(tokens: int, k: int, n: int, recipe, gpu: str, state=None) -> tuple[int, int]:
    from fivefold.lowp.linear import fp8_linear
    from fivefold.trace import trace_callable

    x = torch.empty(tokens, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(n, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(tokens, n, device="meta", dtype=torch.bfloat16)
    if recipe is None:
        t = trace_callable(lambda: torch.nn.functional.linear(x, w).backward(g), gpu=gpu)
    else:
        t = trace_callable(lambda: fp8_linear(x, w, None, recipe, None, state).backward(g),
                           gpu=gpu)
    return t.kernels, sum(e.bytes_read + e.bytes_written for e in t.events if e.kind == "kernel")


# the recipes, and delayed scaling in its steady state and on its first step (no history)
ROWS = ("tensorwise", "rowwise", "blockwise", "tensorwise_delayed",
        "tensorwise_delayed_first_step", "rowwise_gw_hp")


def recipe_of(name: str):
    """(the recipe as an sm90 GPU runs it, the amax-history state for delayed scaling)."""
    from fivefold.lowp.delayed import DelayedState
    from fivefold.lowp.linear import FP8Recipe

    if name.startswith("tensorwise_delayed"):
        filled = [not name.endswith("first_step")] * 3
        state = DelayedState(torch.zeros(3, 16, device="meta"), filled, record=True)
        return FP8Recipe.from_name("tensorwise", scaling="delayed"), state
    recipe = FP8Recipe.from_name(name)
    if name == "blockwise":  # the sm90 GPU's blockwise GEMM (lowp/convert.py's choice)
        recipe = dataclasses.replace(recipe, kernel="scaled_mm")
    return recipe, None


def main() -> int:
    from fivefold.train.bench import git_revision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    from fivefold.lowp import fused

    _, bf16 = trace_linear(args.tokens, args.k, args.n, None, args.gpu)
    result = {"shape": [args.tokens, args.k, args.n], "gpu": args.gpu, "torch": torch.__version__,
              "git": git_revision(), "bf16_bytes": bf16, "recipes": {}}
    print(f"FP8 linear {args.tokens}x{args.k}->{args.n}, forward + backward, traced as "
          f"{args.gpu}: kernels, bytes / bf16's ({bf16 / 2**20:.0f} MiB in 3 kernels)")
    print(f"{'recipe':>29}  {'step-by-step casts':>20}  {'fused casts':>14}")
    for name in ROWS:
        row = {}
        for label, on in (("step_by_step", False), ("fused", True)):
            fused.FUSED_ON_DEVICE = on
            recipe, state = recipe_of(name)
            kernels, nbytes = trace_linear(args.tokens, args.k, args.n, recipe, args.gpu,
                                           state)
            row[label] = {"kernels": kernels, "bytes": nbytes, "x_bf16": nbytes / bf16}
        fused.FUSED_ON_DEVICE = True
        result["recipes"][name] = row
        a, b = row["step_by_step"], row["fused"]
        print(f"{name:>29}  {a['kernels']:>6} {a['x_bf16']:>6.2f}x{'':7}  "
              f"{b['kernels']:>4} {b['x_bf16']:>6.2f}x")
    out = ROOT / "bench/results/fp8_trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
