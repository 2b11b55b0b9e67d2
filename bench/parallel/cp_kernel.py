"""The ring's block kernels on one device, one process: the portable kernel (matmuls and the
log-sum-exp, parallel/context/kernels.py) against the device's fused one (CPU: aten's flash
op for CPU; CUDA: flash attention through aten) and against `scaled_dot_product_attention`
of the same causal block, forward + backward.

    python bench/parallel/cp_kernel.py [--seq 1024] [--heads 16] [--kv-heads 4] [--head-dim 64]
                              [--dtype bf16] [--rounds 5] [--device cpu]

Prints each kernel's median time, the ratio portable / fused measured in the same run, and
the largest relative error of the output and dQ/dK/dV against SDPA; writes
bench/results/cp_kernel.json with the device, torch version and git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fivefold.host import cpu_label
from fivefold.parallel.context import kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_kernel(name, q, k, v, grad, scale):
    forward, backward = kernels.IMPLEMENTATIONS[name]
    out, lse = forward(q, k, v, True, scale)
    return out, backward(grad, q, k, v, out, lse, True, scale)


def run_sdpa(q, k, v, grad, scale):
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad)
    return out.detach(), (qs.grad, ks.grad, vs.grad)


def timed(fn, device, rounds):
    times = []
    for _ in range(rounds + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    q = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, generator=gen,
                        device=device, dtype=dtype) for _ in range(2))
    grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    scale = args.head_dim ** -0.5
    fused = "flash" if device.type == "cuda" else "fused"
    if fused == "flash" and kernels.choose(q) != "flash":
        fused = None  # flash failed its check here: only the portable kernel runs
    t_sdpa, (ref_out, ref_grads) = timed(lambda: run_sdpa(q, k, v, grad, scale), device,
                                         args.rounds)
    rows = {"sdpa": {"median_s": t_sdpa}}
    for name in ("portable", fused):
        if name is None:
            continue
        t, (out, grads) = timed(lambda n=name: run_kernel(n, q, k, v, grad, scale), device,
                                args.rounds)
        errors = {"out": rel(out, ref_out)} | {
            g: rel(a, b) for g, a, b in zip(("dq", "dk", "dv"), grads, ref_grads)}
        rows[name] = {"median_s": t, "max_rel_error_vs_sdpa": max(errors.values()),
                      "errors": errors}
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else cpu_label())
    print(f"device: {name}; torch {torch.__version__}; causal block {args.seq} tokens, "
          f"{args.heads} heads over {args.kv_heads} K/V heads of {args.head_dim}, {args.dtype}")
    for kernel, row in rows.items():
        err = row.get("max_rel_error_vs_sdpa")
        print(f"{kernel:>9}: {row['median_s'] * 1e3:9.2f} ms fwd+bwd (median of {args.rounds})"
              + (f", max relative error vs sdpa {err:.2e}" if err is not None else ""))
    if fused in rows:
        print(f"portable / {fused}: {rows['portable']['median_s'] / rows[fused]['median_s']:.2f}x")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    out = {"device": name, "torch": torch.__version__, "git": rev,
           "load": "2 CPU cores shared with other jobs" if device.type == "cpu"
           and (os.cpu_count() or 1) <= 2 else "", "config": vars(args), "rows": rows}
    path = Path(__file__).resolve().parents[1] / "results" / "cp_kernel.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
