"""Everything fivefold has not yet measured on a GPU, in one command of at most 8 minutes on
one H100, each item on its own (one failing records its one-line reason; the rest run):

    python bench/gpu.py                # on a CUDA machine: bench/results/gpu-<device>-<rev>.json
    python bench/gpu.py --dry-run      # on CPU, tiny shapes, the same code paths where a CPU
                                       # has them (tests/test_gpu_script.py runs this)

Items (bench/gpu_items.py; FP8 in bench/gpu_fp8.py; serve_* in bench/gpu_serve.py, the
decode profile first):
  train_default          a bf16 training step of the default job's model (Trainer, as
                         `fivefold train` runs it) inside a world of one: NCCL on CUDA
  train_8b_blocks        the same for a Llama-3.1-8B-shaped model of 2 blocks, 8192 tokens
  mfu_vs_plan            that run's bf16 MFU beside the planner's prediction (same shape and
                         device; the planner's catalogue has GPUs only)
  step_before_after      the 8B-shaped step: chunked loss, fused loss, fused + compiled blocks,
  hf_peer_compiled       transformers' Llama of that shape compiled, step_profile: one step's
                         profiler table, adamw_one_pass: the one-pass AdamW on bf16 against
                         torch's fused AdamW, and its time (bench/gpu_step.py)
  trace_vs_measured      `fivefold trace`'s predicted step beside both train items' measured
                         ones (bench/gpu_trace.py)
  fp8_gather_unpack      ZeRO-3's FP8 gather of one Llama-3-8B layer over 8 ranks: the
                         shard cast and the unpack, eager torch ops vs one fused kernel
                         each, timed, and the fused bytes checked equal to the eager ones
  fp8_gemms              one linear, forward + backward, bf16 vs FP8 tensorwise, rowwise,
                         blockwise, tensorwise with delayed scaling and rowwise_gw_hp on
                         Llama-3-8B's GEMMs (8192 tokens x 4096->4096, 4096->14336,
                         14336->4096): tokens/s and ratio, and which kernel ran
  fp8_block_stack        the same on a stack of 2 Llama-3.1-8B blocks (bench/fp8/fp8_speed.py)
  fp8_experts            routed experts (Mixtral-8x7B's shape), bf16 grouped matmul vs the
                         FP8 experts: rowwise grouped (torch._scaled_grouped_mm) and per
                         expert (before), blockwise per expert (casts per expert or for
                         all tokens)
  fp8_kernel_float64     tests/test_fp8_kernel.py's GPU test: the blockwise FP8 linear on
                         cuBLASLt's kernel against the float64 reference
  cp_ring_vs_sdpa        context parallelism's portable ring kernel vs SDPA (flash on CUDA):
                         time and the relative error of output and gradients
  peak_memory_vs_plan    peak allocated vs the planner, item by item, for full recomputation,
                         selective recomputation and FP8 (the 8B-shaped 2-block model)
  serve_vs_transformers  the Engine's greedy decoding vs transformers' generate: the same
                         requests, tokens/s, how many outputs agree
  qlora_step             a QLoRA step (NF4 base), its peak memory vs the plan
  serve_decode_profile, serve_16_requests, serve_async, serve_128_mixed: serving at GPU
                         speed
                         (bench/gpu_serve.py's docstring)

`--budget-s` (default 480) stops starting new items once spent (they record why). The JSON
holds the device name, driver, torch, CUDA and cuDNN versions, the host CPU, the git
revision and each item's seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gpu_fp8  # noqa: E402
import gpu_items as items  # noqa: E402
import gpu_serve  # noqa: E402
import gpu_step  # noqa: E402
import gpu_trace  # noqa: E402

from fivefold.train.bench import git_revision  # noqa: E402

# (name, function, has a CPU path: a dry run must give numbers for it)
ITEMS = [("serve_decode_profile", gpu_serve.serve_decode_profile, True),  # first: it aims
         ("train_default", items.train_default, True),
         ("train_8b_blocks", items.train_8b_blocks, True),
         ("mfu_vs_plan", items.mfu_vs_plan, False),
         ("step_before_after", gpu_step.step_before_after, True),
         ("hf_peer_compiled", gpu_step.hf_peer_compiled, True),
         ("step_profile", gpu_step.step_profile, True),
         ("adamw_one_pass", gpu_step.adamw_one_pass, False),
         ("trace_vs_measured", gpu_trace.trace_vs_measured, True),
         ("fp8_cast_bytes", gpu_fp8.fp8_cast_bytes, False),
         ("fp8_gather_unpack", gpu_fp8.fp8_gather_unpack, True),
         ("fp8_gemms", gpu_fp8.fp8_gemms, True),
         ("fp8_block_stack", gpu_fp8.fp8_block_stack, True),
         ("fp8_experts", gpu_fp8.fp8_experts, True),
         ("fp8_kernel_float64", gpu_fp8.fp8_kernel_float64, False),
         ("cp_ring_vs_sdpa", items.cp_ring_vs_sdpa, True),
         ("peak_memory_vs_plan", items.peak_memory_vs_plan, True),
         ("serve_vs_transformers", items.serve_vs_transformers, True),
         ("qlora_step", items.qlora_step, True),
         ("serve_16_requests", gpu_serve.serve_16_requests, True),
         ("serve_async", gpu_serve.serve_async, True),
         ("serve_128_mixed", gpu_serve.serve_128_mixed, True)]

BLOCKS_8B = ["--model.preset", "llama-3.1-8b", "--model.num_layers", "2", "--data.tokenizer",
             "byte", "--train.seq_len", "8192", "--train.gbs", "1", "--parallel.mbs", "1"]
GPU_SHAPES = {
    "train_steps": (5, 2),  # timed, warm-up
    "default_overrides": [],
    "blocks_overrides": BLOCKS_8B,
    "gemm_tokens": 8192, "gemm_shapes": [(4096, 4096), (4096, 14336), (14336, 4096)],
    "rounds": 5,
    "stack_preset": "llama-3.1-8b", "stack_layers": 2, "stack_tokens": 8192,
    "stack_steps": 3, "stack_rounds": 3,
    # seq, heads, kv heads, head_dim (Llama-3.1-8B's attention); 4096 tokens: the portable
    # kernel holds fp32 score matrices of heads x seq^2 (2 GiB each here)
    "cp": (4096, 32, 8, 128),
    "experts": (8, 4096, 14336, 2048),  # Mixtral-8x7B's experts, 8192 tokens x top-2
    "serve": ("smollm2-135m", 16, 128, 128, torch.float32),  # preset, requests, prompt, out
    "qlora": (["--model.preset", "llama-3.2-1b", "--model.num_layers", "8"], 1024),
    "gather_unit": (4096, 14336, 1024, 8),  # hidden, intermediate, k/v width, ranks
}
TINY = ["--model.preset", "tiny", "--model.num_layers", "2", "--data.tokenizer", "byte",
        "--train.seq_len", "32", "--train.gbs", "1", "--parallel.mbs", "1"]
DRY_SHAPES = GPU_SHAPES | {
    "train_steps": (1, 1),
    "default_overrides": ["--data.tokenizer", "byte", "--train.seq_len", "32", "--train.gbs",
                          "2", "--parallel.mbs", "2"],
    "blocks_overrides": TINY,
    "gemm_tokens": 128, "gemm_shapes": [(128, 128), (128, 256), (256, 128)], "rounds": 1,
    "stack_preset": "tiny", "stack_tokens": 64, "stack_steps": 1, "stack_rounds": 1,
    "cp": (64, 4, 2, 16),
    "experts": (2, 128, 256, 16),
    "serve": ("tiny", 2, 8, 4, torch.float32),
    "qlora": (["--model.preset", "tiny", "--model.num_layers", "2"], 32),
    "gather_unit": (64, 96, 16, 3),
}


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
            else None, "python": platform.python_version(), "host_cpu": host_cpu()}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        info["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = None
    else:
        info["device"], info["driver"] = f"CPU ({info['host_cpu']})", None
    return info


def host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def numbers_in(value) -> bool:
    """Whether a result holds at least one real number (what a dry run's items must)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value == value  # not NaN
    if isinstance(value, dict):
        return any(numbers_in(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(numbers_in(v) for v in value)
    return False


def run_items(ctx: items.Context, only: list[str], budget_s: float) -> dict:
    start = time.perf_counter()
    for name, fn, cpu_path in ITEMS:
        if only and name not in only:
            continue
        began, cpu_began = time.perf_counter(), time.process_time()
        if began - start > budget_s:
            record = {"status": "not run", "reason": f"the time budget of {budget_s:.0f} s "
                                                     f"was spent before this item"}
        else:
            try:
                record = {"status": "ok", **fn(ctx)}
            except items.NotRun as e:
                record = {"status": "not run", "reason": str(e)}
            except Exception as e:  # noqa: BLE001  one item's failure must not lose the rest
                record = {"status": "failed", "reason": items.one_line(e)}
        record["seconds"] = time.perf_counter() - began
        record["cpu_seconds"] = time.process_time() - cpu_began
        record["cpu_path"] = cpu_path
        ctx.results[name] = record
        items.free(ctx)
        print(f"{name:<22} {record['status']:<8} {record['seconds']:7.1f} s "
              f"({record['cpu_seconds']:5.1f} s CPU)  "
              + (record.get("reason") or summary(record)), flush=True)
    return ctx.results


def summary(record: dict) -> str:
    """A short line of an item's headline numbers."""
    for key in ("ratio_vs_bf16", "tokens_per_s", "relative_errors", "layouts"):
        if key in record:
            text = json.dumps(record[key], default=str)
            ratio = record.get("async_on_over_off")  # serve_async: both rates and the ratio
            return f"{key} {text[:150]}" + ("" if ratio is None else f" on/off {ratio:.3f}") \
                + (f" ({record['note']})" if "note" in record else "")
    return ""


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shapes: the same code paths where a CPU has them")
    ap.add_argument("--only", nargs="*", default=[], choices=[n for n, _, _ in ITEMS])
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--out", default="", help="the JSON file (default: bench/results/"
                                              "gpu-<device>-<git revision>.json)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device; --dry-run runs it on CPU with tiny shapes",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    info = device_info(device)
    rev = git_revision()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = items.Context(device, args.dry_run, Path(tmp), {},
                            DRY_SHAPES if args.dry_run else GPU_SHAPES)
        results = run_items(ctx, args.only, args.budget_s)
    record = {"kind": "bench/gpu.py", "dry_run": args.dry_run, "date": started,
              "command": "python bench/gpu.py " + " ".join(sys.argv[1:] if argv is None
                                                           else argv),
              "git_revision": rev, "machine": info, "items": results}
    default = f"gpu-{'dry-run-' if args.dry_run else ''}{slug(info['device'])}-{rev[:12]}.json"
    out = Path(args.out or Path(__file__).resolve().parent / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
