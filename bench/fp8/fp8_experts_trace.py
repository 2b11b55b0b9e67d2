"""The trace of routed experts, forward + backward, per FP8 recipe: kernels and bytes against
the bf16 grouped matmul, before (per-expert loop, weights indexed `w[e]`) and after (rowwise
grouped; tensorwise and blockwise per expert on `unbind`).

    python3 bench/fp8/fp8_experts_trace.py [--experts 8 --tokens 8192 --hidden 4096
                                            --inter 14336] [--gpu h100]

The trace runs on the meta device taking the GPU's branches (fivefold.trace), as an sm90 GPU
would run them: the fused casts, `torch._scaled_grouped_mm` for rowwise, cuBLASLt's
blockwise GEMM. Nothing is timed. The default shape is Mixtral-8x7B's experts with 8192
routed token copies spread evenly (1024 per expert). tests/test_fp8_experts.py holds the
budgets at this shape. Writes bench/results/fp8_experts_trace.json (shape, torch, git
revision, the machine it ran on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("tensorwise", "rowwise", "blockwise")


def indexed_loop_forward(self, x_sorted, counts):
    """The FP8 experts' forward before the grouped path (rev a5f9755): per expert, each
    weight taken as w[e] (whose backward writes a zero-filled stacked weight each time)."""
    from fivefold.lowp.linear import fp8_linear

    r, outs = self.fp8_recipe, []
    for e, rows in enumerate(x_sorted.split(counts.tolist())):
        if rows.shape[0] == 0:
            outs.append(rows.new_zeros(0, self.hidden))
            continue
        h = F.silu(fp8_linear(rows, self.w_gate[e], None, r)) * fp8_linear(
            rows, self.w_up[e], None, r)
        outs.append(fp8_linear(h, self.w_down[e], None, r))
    return torch.cat(outs)


def recipe_for(name: str):
    from fivefold.lowp.linear import FP8Recipe

    recipe = FP8Recipe.from_name(name)
    if name == "blockwise":  # the sm90 GPU's blockwise GEMM (lowp/convert.py's choice)
        recipe = dataclasses.replace(recipe, kernel="scaled_mm")
    return recipe


def trace_experts(experts: int, tokens: int, hidden: int, inter: int, recipe, gpu: str,
                  before: bool = False, grouped_casts: bool = False,
                  timeline: bool = False) -> tuple:
    """(kernels, bytes) of one forward + backward of the routed experts on meta, and with
    `timeline` the roofline's predicted milliseconds on `gpu` (fivefold.trace)."""
    from fivefold.lowp.convert import convert_to_fp8
    from fivefold.models.moe import GroupedExperts
    from fivefold.trace import trace_callable

    with torch.device("meta"):
        module = GroupedExperts(experts, hidden, inter).to(torch.bfloat16)
    x = torch.empty(tokens, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(tokens, hidden, device="meta", dtype=torch.bfloat16)
    counts = torch.full((experts,), tokens // experts)
    counts[: tokens % experts] += 1
    module.use_grouped_mm(x)  # its one-time probe, outside the trace
    if recipe is not None:
        convert_to_fp8(module, recipe)
        module.fp8_grouped_casts = grouped_casts
        if before:
            module.forward = indexed_loop_forward.__get__(module)
    t = trace_callable(lambda: module(x, counts).backward(g), gpu=gpu)
    nbytes = sum(e.bytes_read + e.bytes_written for e in t.events if e.kind == "kernel")
    return (t.kernels, nbytes, t.timeline.step_s * 1e3) if timeline else (t.kernels, nbytes)


def main() -> int:
    from fivefold.train.bench import git_revision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    if min(args.experts, args.tokens, args.hidden, args.inter) < 1:
        print("fp8_experts_trace: --experts, --tokens, --hidden and --inter must be >= 1",
              file=sys.stderr)
        return 2
    shape = (args.experts, args.tokens, args.hidden, args.inter)
    kernels, bf16, bf16_ms = trace_experts(*shape, None, args.gpu, timeline=True)
    result = {"shape": {"experts": args.experts, "tokens": args.tokens, "hidden": args.hidden,
                        "inter": args.inter}, "gpu": args.gpu, "torch": torch.__version__,
              "git": git_revision(), "machine": platform.machine(),
              "python": platform.python_version(),
              "bf16": {"kernels": kernels, "bytes": bf16, "roofline_ms": bf16_ms}, "recipes": {}}
    print(f"routed experts {args.experts} x {args.hidden}->{args.inter}, {args.tokens} tokens, "
          f"forward + backward, traced as {args.gpu}: kernels, bytes / bf16's "
          f"(bf16 grouped matmul: {kernels} kernels, {bf16 / 2**30:.2f} GiB, {bf16_ms:.2f} ms "
          f"on the roofline)")
    print(f"{'recipe':>24}  {'before':>16}  {'after':>16}  {'roofline ms':>14}")
    variants = [(name, name, False) for name in RECIPES]
    variants.append(("blockwise, grouped casts", "blockwise", True))
    for label, name, grouped_casts in variants:
        row = {}
        for when, before in (("before", True), ("after", False)):
            k, nbytes, ms = trace_experts(*shape, recipe_for(name), args.gpu, before,
                                          grouped_casts, timeline=True)
            row[when] = {"kernels": k, "bytes": nbytes, "x_bf16": nbytes / bf16,
                         "roofline_ms": ms}
        result["recipes"][label] = row
        a, b = row["before"], row["after"]
        print(f"{label:>24}  {a['kernels']:>6} {a['x_bf16']:>7.2f}x  "
              f"{b['kernels']:>6} {b['x_bf16']:>7.2f}x  {a['roofline_ms']:>6.2f} "
              f"{b['roofline_ms']:>6.2f}")
    out = ROOT / "bench/results/fp8_experts_trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
