"""Where the GPU time goes, for the three gaps bench/gpu.py measured on an H100: the 8B-shaped
training step's MFU against the plan, an FP8 linear against bf16, and the serving Engine
against transformers' generate. Each part prints torch.profiler's table of the ops that took
the most device time and the most host time, and how busy the device was over the wall time
(a device idle most of the step means the host is the bottleneck).

    python bench/gpu_profile.py                    # on a CUDA machine, each part
    python bench/gpu_profile.py --only fp8         # one part
    python bench/gpu_profile.py --dry-run          # on CPU, tiny shapes (the code paths run)

It prints; it writes no JSON (bench/gpu.py records the numbers). `--rows` sets the table
length.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gpu  # noqa: E402
import gpu_fp8  # noqa: E402
import gpu_items as items  # noqa: E402


def report(prof, label: str, wall_s: float, rows: int, device: torch.device) -> None:
    events = prof.key_averages()
    device_key = "self_device_time_total"
    try:
        busy_us = sum(getattr(e, device_key) for e in events)
    except AttributeError:  # older torch names it for CUDA
        device_key = "self_cuda_time_total"
        busy_us = sum(getattr(e, device_key) for e in events)
    print(f"\n=== {label}: wall {wall_s * 1e3:.1f} ms, device busy {busy_us / 1e3:.1f} ms "
          f"({busy_us / 1e4 / wall_s:.0f}% of wall)", flush=True)
    if device.type == "cuda":
        print(events.table(sort_by=device_key, row_limit=rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows,
                       max_name_column_width=60), flush=True)


def activities(device: torch.device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profiled(ctx: items.Context, fn, label: str, rows: int) -> None:
    ctx.sync()
    with profile(activities=activities(ctx.device)) as prof:
        start = time.perf_counter()
        fn()
        ctx.sync()
        wall = time.perf_counter() - start
    report(prof, label, wall, rows, ctx.device)


def train(ctx: items.Context, rows: int) -> None:
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.bench import FivefoldRunner

    cfg = items.load_config(ctx, "profile", ["--train.steps", "8", "--train.precision", "bf16",
                                             *ctx.shape("blocks_overrides")])
    with items.world_of_one(ctx, "profile"):
        runner = FivefoldRunner(cfg, ParallelDims.from_config(cfg.parallel))
        try:
            for i in range(4):
                record = runner.step()
                print(f"step {i}: {record.seconds * 1e3:.1f} ms, parts "
                      + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in record.parts.items())
                      + f", host CPU {record.cpu_seconds * 1e3:.1f} ms", flush=True)
            profiled(ctx, runner.trainer.train_step, "training step (8B-shaped blocks)", rows)
        finally:
            runner.trainer.close()


def fp8(ctx: items.Context, rows: int) -> None:
    from fivefold.lowp.linear import fp8_linear

    tokens = ctx.shape("gemm_tokens")
    k, n = ctx.shape("gemm_shapes")[0]
    x = torch.randn(tokens, k, device=ctx.device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=ctx.device, dtype=torch.bfloat16) / k ** 0.5).requires_grad_()
    g = torch.randn(tokens, n, device=ctx.device, dtype=torch.bfloat16)
    for name in ("tensorwise", "blockwise"):
        recipe, line = gpu_fp8.fp8_recipe(name, [torch.nn.Linear(k, n, device="meta")],
                                        ctx.device)

        def step(r=recipe):
            for _ in range(3):
                fp8_linear(x.detach().requires_grad_(), w, None, r).backward(g)

        step()
        profiled(ctx, step, f"3 x FP8 {name} linear {tokens}x{k}->{n} ({line})", rows)

    def bf16_step():
        for _ in range(3):
            torch.nn.functional.linear(x.detach().requires_grad_(), w).backward(g)

    bf16_step()
    profiled(ctx, bf16_step, f"3 x bf16 linear {tokens}x{k}->{n}", rows)


def serve(ctx: items.Context, rows: int) -> None:
    from fivefold.models.init import build_model
    from fivefold.models.presets import preset
    from fivefold.serve.engine import Engine
    from fivefold.serve.sampling_params import SamplingParams

    name, requests, prompt_len, _, dtype = ctx.shape("serve")
    output_len = 8 if ctx.dry else 32
    cfg = preset(name).replace(max_seq_len=max(preset(name).max_seq_len, 512))
    model = build_model(cfg, seed=0).eval().to(ctx.device, dtype)
    prompts = [torch.randint(1, cfg.vocab_size, (prompt_len,)).tolist()
               for _ in range(requests)]

    def run():
        engine = Engine(model, max_num_seqs=requests, max_model_len=512,
                        num_blocks=requests * 512 // 16 + 8)
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return steps

    run()
    ctx.sync()
    start = time.perf_counter()
    steps = run()
    ctx.sync()
    wall = time.perf_counter() - start
    print(f"\nEngine: {steps} steps for {requests} x {output_len} tokens, "
          f"{wall / steps * 1e3:.2f} ms a step", flush=True)
    profiled(ctx, run, f"Engine, {requests} requests x {output_len} tokens ({name})", rows)


PARTS = {"train": train, "fp8": fp8, "serve": serve}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", nargs="*", default=[], choices=list(PARTS))
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu_profile.py needs a CUDA device; --dry-run runs it on CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = items.Context(device, args.dry_run, Path(tmp), {},
                            gpu.DRY_SHAPES if args.dry_run else gpu.GPU_SHAPES)
        for name, fn in PARTS.items():
            if args.only and name not in args.only:
                continue
            try:
                fn(ctx, args.rows)
            except Exception as e:  # noqa: BLE001  one part's failure must not lose the rest
                print(f"{name}: failed: {items.one_line(e)}", flush=True)
            items.free(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
