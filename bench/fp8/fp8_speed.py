"""FP8 vs bf16 speed of a stack of Llama blocks, forward + backward, in one process.

    python bench/fp8/fp8_speed.py                         # Llama-3.1-8B blocks on a GPU
    python bench/fp8/fp8_speed.py --shape tiny --layers 2 --tokens 2048   # a CPU smoke run

The stack is `--layers` transformer blocks of the preset's shape (models/llama.py `Block`,
bf16 weights, RoPE tables, SDPA), fed `--tokens` tokens as one sequence batch, timed over
`--steps` forward + backward passes after `--warmup`; bf16 and each FP8 recipe take turns
for `--rounds` rounds and the median is kept. It prints tokens/s and the ratio to bf16
(the issue's goal on an H100: >= 1.3x for tensorwise and rowwise; blockwise is reported),
and writes bench/results/fp8_speed-<device>.json with the device name, versions and git
revision. On CPU the FP8 GEMMs are emulated: a CPU run checks the script, not FP8's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from fivefold.host import cpu_label
from fivefold.lowp.convert import choose_kernel, convert_to_fp8
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.llama import Block, Rotary
from fivefold.models.presets import preset

VARIANTS = ("bf16", "tensorwise", "rowwise", "blockwise")


def build(shape: str, layers: int, variant: str, device: torch.device) -> torch.nn.Module:
    cfg = preset(shape)
    torch.manual_seed(0)
    stack = torch.nn.ModuleList(Block(cfg, i) for i in range(layers)).to(device, torch.bfloat16)
    if variant != "bf16":  # blockwise takes the kernel the engine would pick on this device
        recipe = FP8Recipe.from_name(variant)
        linears = [m for m in stack.modules() if isinstance(m, torch.nn.Linear)]
        kernel, line = choose_kernel("auto", recipe, linears, device)
        convert_to_fp8(stack, dataclasses.replace(recipe, kernel=kernel))
        print(line)
    stack.cfg = cfg
    return stack


def time_steps(stack, tokens: int, steps: int, warmup: int, device) -> float:
    cfg = stack.cfg
    seq = min(tokens, 8192)
    batch = max(tokens // seq, 1)
    x = torch.randn(batch, seq, cfg.hidden_size, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    rotary = Rotary(cfg).to(device)
    cos, sin = rotary(torch.arange(seq, device=device), torch.bfloat16)

    def step():
        h = x
        for block in stack:
            h = block(h, cos, sin)
        h.float().square().mean().backward()

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return batch * seq * steps / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        cpu_label())
    stacks = {v: build(args.shape, args.layers, v, device) for v in args.variants}
    rates: dict[str, list[float]] = {v: [] for v in args.variants}
    for _ in range(args.rounds):  # the variants take turns, so drift hits them alike
        for v, stack in stacks.items():
            rates[v].append(time_steps(stack, args.tokens, args.steps, args.warmup, device))
    median = {v: statistics.median(r) for v, r in rates.items()}
    base = median.get("bf16")
    for v, rate in median.items():
        ratio = f"  {rate / base:.2f}x bf16" if base else ""
        print(f"{v:>10}: {rate:,.0f} tokens/s{ratio}")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    result = {"device": name, "torch": torch.__version__, "git": rev, "shape": args.shape,
              "layers": args.layers, "tokens": args.tokens, "steps": args.steps,
              "rounds": args.rounds, "tokens_per_s": median, "all_rounds": rates,
              "ratio_vs_bf16": {v: r / base for v, r in median.items()} if base else {}}
    out = Path(f"bench/results/fp8_speed-{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
