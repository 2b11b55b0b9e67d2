"""`fivefold plan`'s options: the parser, and the flags turned into Workload fields
(plan/layout.py) for plan/cli_entry.py to plan."""

from __future__ import annotations

import argparse
import dataclasses

from fivefold.config.fp8 import FP8_RECIPES, FP8_SCALINGS
from fivefold.errors import ArgumentParser, ConfigError
from fivefold.plan.conventions import CONVENTIONS
from fivefold.plan.hardware import CATALOG, GIB


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog="fivefold plan",
        description="Predict memory, communication, step time and MFU of a training layout, "
                    "or search for the fastest layouts that fit.")
    src = ap.add_argument_group("what to plan")
    src.add_argument("--model", help="a preset name, a Hugging Face config.json (or its "
                     "directory), or a training .toml (its [model] section)")
    src.add_argument("--config", help="a training .toml: check that its layout fits "
                     "(add --search to rank alternatives on the same GPUs)")
    src.add_argument("--layout", help="explain one layout, e.g. tp=8,pp=2,zero=1,mbs=1,"
                     "recompute=selective,schedule=1f1b (dp follows from --gpus)")
    src.add_argument("--search", action="store_true", help="with --config: search instead")
    src.add_argument("--space", default="", help="restrict the search, e.g. 'tp=4,8 pp=1,2 "
                     "zero=1,3 recompute=selective schedule=1f1b,interleaved uneven_pp=true'")
    src.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    src.add_argument("--convention", default="fivefold", help="plan another engine's run "
                     f"with its defaults: {', '.join(CONVENTIONS)} (flags still override)")
    src.add_argument("--params", type=float, help="plan a model from its parameter count "
                     "(e.g. 7.5e9) with a standard GPT-3 shape, instead of --model")
    src.add_argument("--serve", action="store_true", help="plan serving instead: KV blocks, "
                     "concurrent sequences, decode roofline (fivefold plan --serve --help)")
    run = ap.add_argument_group("whole run")
    run.add_argument("--tokens", type=float, help="training budget in tokens (e.g. 15e12): "
                     "days, GPU-hours and, with --hw price_per_gpu_hour=..., cost")
    run.add_argument("--flops-rule", default="6ND", choices=("6ND", "8ND"),
                     help="rule-of-thumb compute: 6·N·D, or 8·N·D with full recomputation")
    run.add_argument("--achieved-tflops", type=float, help="achieved TFLOP/s per GPU for the "
                     "rule of thumb (default: the plan's own model TFLOP/s per GPU)")
    hw = ap.add_argument_group("hardware")
    hw.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(CATALOG)}")
    hw.add_argument("--gpus", type=int, default=8, help="number of GPUs (default 8)")
    hw.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                    help="override a hardware figure or assumption, e.g. memory_gib=94, "
                    "inter_node_gbps=100, gpus_per_node=4, matmul_efficiency=0.6")
    hw.add_argument("--hw-profile", metavar="FILE", help="a profile from `fivefold calibrate`: "
                    "measured matmul, attention and collective speeds replace the peaks")
    hw.add_argument("--list-gpus", action="store_true", help="print the catalog and exit")
    tr = ap.add_argument_group("training shape")
    tr.add_argument("--seq-len", type=int, default=4096,
                    help="tokens per training sequence (default 4096)")
    batch = tr.add_mutually_exclusive_group()
    batch.add_argument("--gbs", type=int, help="global batch in sequences (default: about "
                       "4M tokens, rounded to GPUs × a power of two so every dp divides it)")
    batch.add_argument("--gbs-tokens", type=float, help="global batch in tokens (e.g. 4e6)")
    tr.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"),
                    help="the training precision (default bf16; fp8: bf16 with FP8 GEMMs)")
    tr.add_argument("--optimizer", choices=(
        "adamw", "adam", "sgd", "adamw8bit", "adamw4bit", "adafactor", "muon"),
        help="the optimizer whose states and update are planned (default: --config's "
        "train.optimizer, else adamw)")
    tr.add_argument("--grad-dtype-bytes", type=int, choices=(2, 4),
                    help="4: fp32 gradients (Megatron's 18 bytes/param)")
    tr.add_argument("--fp32-grad-accum", action="store_true",
                    help="a separate fp32 accumulation buffer (nanotron's 20 bytes/param)")
    tr.add_argument("--math-attention", action="store_true",
                    help="attention saves its s×s scores (no flash attention)")
    tr.add_argument("--dropout", action="store_true", help="count dropout masks (GPT-3 style)")
    tr.add_argument("--causal-flops", action="store_true",
                    help="count half the attention FLOPs in MFU (Megatron ≥ 2025)")
    tr.add_argument("--recompute", choices=("none", "selective", "full", "auto"),
                    help="activation recomputation of --layout, --config or the search; auto: "
                    "per layer, the fastest set under --memory-budget-gib")
    tr.add_argument("--memory-budget-gib", type=float, help="recompute auto: the peak "
                    "allocated GiB per GPU (default: the GPU's memory less the context and "
                    "the allocator's share)")
    tr.add_argument("--grad-sync", choices=("auto", "step", "microbatch"),
                    help="ZeRO-2/3 reduce-scatter once per step or per micro-batch; auto "
                    "(default; with --config, the config's parallel.grad_sync): per "
                    "micro-batch where the step is at most 2%% slower or once per step "
                    "does not fit")
    tr.add_argument("--fp8-allgather", action="store_true",
                    help="with --precision fp8: ZeRO-3 gathers the FP8 linears' weights in "
                    "FP8, tensorwise (parallel.fp8_allgather)")
    tr.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                    help="with --precision fp8: the recipe (train.fp8_recipe; default "
                    "blockwise, the engine's; tensorwise under --fp8-allgather)")
    tr.add_argument("--fp8-scaling", choices=FP8_SCALINGS, default=None,
                    help="with --precision fp8, tensorwise: dynamic (default) or delayed "
                    "(train.fp8_scaling: amax histories, one all-reduce of records a step)")
    tr.add_argument("--fp8-keep-out", default="", metavar="PATTERNS",
                    help="with --precision fp8: linears left in bf16, a comma list of "
                    "module-name patterns (train.fp8_keep_out), e.g. layers.0,o_proj")
    ft = ap.add_argument_group("fine-tuning")
    ft.add_argument("--lora-rank", type=int, default=0,
                    help="plan LoRA of this rank on a frozen base (0: full training)")
    ft.add_argument("--lora-base", default="none", choices=("none", "nf4", "int8"),
                    help="how the frozen base is stored (nf4: QLoRA)")
    ft.add_argument("--lora-targets",
                    default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    help="the linears with adapters (comma list, or all-linear)")
    out = ap.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", metavar="PATH",
                     help="write JSON (to stdout without a PATH)")
    out.add_argument("--plot", metavar="DIR", help="write memory.png and time.png into DIR")
    return ap


def workload_options(args) -> dict:
    return {**({"optimizer": args.optimizer} if args.optimizer else {}),
            "grad_dtype_bytes": args.grad_dtype_bytes,
                "fp32_grad_accum": args.fp32_grad_accum, "flash": not args.math_attention,
                "dropout": args.dropout, "causal_flops": args.causal_flops,
                **({"grad_sync": args.grad_sync} if args.grad_sync else {}),
                **({"fp8_allgather": True, "fp8_recipe": "tensorwise"}
                   if args.fp8_allgather else {}),
                **({"fp8_recipe": args.fp8_recipe} if args.fp8_recipe else {}),
                **({"fp8_scaling": args.fp8_scaling} if args.fp8_scaling else {}),
                **({"fp8_keep_out": args.fp8_keep_out} if args.fp8_keep_out else {}),
                **lora_options(args)}


def lora_options(args) -> dict:
    """--lora-rank/--lora-base/--lora-targets as Workload fields (plan/lora.py)."""
    if args.lora_rank < 0:
        raise ConfigError(f"--lora-rank {args.lora_rank} must be >= 0 (0: full training)")
    if args.lora_rank == 0:
        if args.lora_base != "none":
            raise ConfigError(f"--lora-base {args.lora_base} needs --lora-rank R > 0")
        return {}
    return {"lora_rank": args.lora_rank, "lora_base": args.lora_base,
            "lora_targets": args.lora_targets}


def explicit_workload(args) -> set[str]:
    """Workload fields a flag set, which a convention leaves alone."""
    given = set()
    if args.grad_dtype_bytes is not None:
        given.add("grad_dtype_bytes")
    if args.fp32_grad_accum:
        given.add("fp32_grad_accum")
    if args.causal_flops:
        given.add("causal_flops")
    return given


def recompute_options(args, work, hw, assume):
    """--recompute and --memory-budget-gib: the budget goes into the workload (default: what
    the GPU leaves for allocated bytes, memory less context, over 1 + fragmentation)."""
    budget = args.memory_budget_gib
    if budget is not None and budget <= 0:
        raise ConfigError(f"--memory-budget-gib {budget:g} must be > 0")
    if budget is None and not work.memory_budget_gib:
        budget = ((hw.memory_bytes - assume.context_gib * GIB) / (1 + assume.fragmentation)
                  / GIB)
    return dataclasses.replace(work, memory_budget_gib=budget or work.memory_budget_gib)
