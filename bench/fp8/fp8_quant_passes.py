"""Passes over the operands and time of one FP8 linear's forward + backward, this tree against
a baseline revision, in one run (lowp/quantize.py's issue: the quantisation's elementwise
passes, not the FP8 GEMMs, made an FP8 linear slower than bf16 on an H100).

    python3 bench/fp8/fp8_quant_passes.py                              # CPU, 2048 x 1024 -> 1024
    python3 bench/fp8/fp8_quant_passes.py --tokens 8192 --k 4096 --n 4096 --device cuda

The baseline is `git archive`d from `--baseline` (default: the revision before
lowp/quantize.py) into a temporary folder, or read from `--baseline-src` (a copy of its
src/). Each tree runs in its own subprocess; they take turns for `--rounds` rounds, and the
medians are compared. Per recipe it reports:

  - the aten ops of one forward + backward outside the three `fp8_mm` calls (a
    TorchDispatchMode counts every op the dispatcher runs, the backward's included; what
    runs inside fp8_mm, _scaled_mm or the blockwise emulation's K slices, is the GEMM) and
    the "passes": those ops, views and empty allocations aside, that read or write an
    operand-sized tensor (at least a quarter of the smallest of x, W and ∂y), with the
    bytes they move (each operand-sized input read once, each such output written once);
  - the time of a forward + backward (median): on CUDA wall time, and the time of a bf16
    F.linear forward + backward on the same operands; on CPU the process's CPU time (one
    intra-op thread; on a shared machine wall time mostly measures the neighbours), and
    the part of it outside fp8_mm (the quantisation: CPU's FP8 GEMM is slow and would
    hide it).

It writes bench/results/fp8_quant_passes-<device>.json (machine, versions, git revisions).

    python3 bench/fp8/fp8_quant_passes.py --check --device cuda      # bytes on the device

`--check` compares, on the device, lowp/quantize.py's bytes and scales with
numerics.fp8.quantize's (each granularity, bf16 and fp32, whole and ragged groups,
transposed views, NaN and inf groups; NaN bytes counted apart) and the FP8 linear's y, ∂x,
∂W with those of the same linear quantising with numerics.fp8; it also times a
torch.compile'd tensorwise quantiser against the eager one (a measurement only: the
linear does not compile). Exit code 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "efcc609"  # the last revision whose FP8 linear quantised with numerics.fp8.quantize
RECIPES = ("tensorwise", "rowwise", "blockwise")
ALLOCS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
          "_unsafe_view"}  # _unsafe_view: reshape's view that is not flagged as one


# ---- the worker: runs in a subprocess with PYTHONPATH at one tree's src/ -------------------

class GemmClock:
    """Wraps lowp.linear's fp8_mm: pauses the op count and adds up the time inside it."""

    def __init__(self, linear_module, sync, clock):
        self.inner, self.sync, self.paused, self.seconds = linear_module.fp8_mm, sync, False, 0.0
        self.clock = clock
        linear_module.fp8_mm = self

    def __call__(self, *args, **kwargs):
        self.sync()
        start, self.paused = self.clock(), True
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.sync()
            self.paused, self.seconds = False, self.seconds + self.clock() - start


def count_ops(step, big: int, gemm: GemmClock) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    ops, passes, moved = Counter(), Counter(), [0]

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if gemm.paused:
                return out
            name = func.overloadpacket.__name__
            ops[name] += 1
            if func.is_view or name in ALLOCS:
                return out
            written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                       and t.numel() >= big]
            read_args = [a for i, a in enumerate(tree_leaves(list(args)))
                         if not (name == "copy_" and i == 0)]
            read = {id(t): t for t in read_args + tree_leaves(
                {k: v for k, v in kwargs.items() if k != "out"})
                if isinstance(t, torch.Tensor) and t.numel() >= big}
            if written or read:
                passes[name] += 1
                moved[0] += nbytes(written) + nbytes(read.values())
            return out

    with Count():
        step()
    return {"ops": dict(ops), "n_ops": sum(ops.values()), "passes": dict(passes),
            "n_passes": sum(passes.values()), "pass_bytes": moved[0]}


def timed(step, reps: int, sync, gemm: GemmClock | None = None,
          clock=time.perf_counter) -> tuple[float, float]:
    """Medians over `reps` steps, in ms: the whole step, and the part outside fp8_mm."""
    times, outside = [], []
    for _ in range(reps):
        sync()
        if gemm:
            gemm.seconds = 0.0
        start = clock()
        step()
        sync()
        times.append(clock() - start)
        outside.append(times[-1] - (gemm.seconds if gemm else 0.0))
    return statistics.median(times) * 1e3, statistics.median(outside) * 1e3


def worker(args) -> dict:
    from fivefold.lowp import linear
    from fivefold.lowp.linear import FP8Recipe, fp8_linear

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":  # two spinning OpenMP threads on a shared machine: noise
        torch.set_num_threads(1)
    # CPU: the process's CPU time (wall time on a shared machine measures the neighbours)
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    gemm = GemmClock(linear, sync, clock)
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(args.n, args.k, device=device, dtype=torch.bfloat16)
         / args.k ** 0.5).requires_grad_()
    g = torch.randn(args.tokens, args.n, device=device, dtype=torch.bfloat16)
    big = min(x.numel(), w.numel(), g.numel()) // 4
    out = {}
    for name in args.recipes:
        recipe = FP8Recipe.from_name(name)
        if name == "blockwise" and device.type == "cuda":
            from fivefold.lowp.convert import choose_kernel
            kernel, _ = choose_kernel("auto", recipe, [torch.nn.Linear(args.k, args.n,
                                                                      device="meta")], device)
            recipe = FP8Recipe(recipe.name, recipe.grad_format, recipe.pow2, recipe.block,
                               kernel)

        def step(r=recipe):
            w.grad = None
            fp8_linear(x.detach().requires_grad_(), w, None, r).backward(g)

        step()
        res = count_ops(step, big, gemm)
        try:  # this tree's CUDA path (one-pass group amaxes), counted here too
            from fivefold.lowp import quantize as fast
            own = fast.one_pass_amax
            if not own(device):
                fast.one_pass_amax = lambda _device: True
                res["cuda_path"] = count_ops(step, big, gemm)
                fast.one_pass_amax = own
        except ImportError:  # the baseline: no lowp/quantize.py
            pass
        if device.type == "cpu":  # timing the GEMMs apart needs a sync around each
            res["ms"], res["non_gemm_ms"] = timed(step, args.reps, sync, gemm, clock)
        else:
            gemm.sync = lambda: None
            res["ms"] = timed(step, args.reps, sync)[0]
            gemm.sync = sync
        out[name] = res
    if device.type == "cuda":
        def bf16_step():
            w.grad = None
            torch.nn.functional.linear(x.detach().requires_grad_(), w).backward(g)

        bf16_step()
        out["bf16"] = {"ms": timed(bf16_step, args.reps, sync)[0]}
    return out


# ---- --check: the bytes on the device ----------------------------------------------------

def check(args) -> int:
    from fivefold.lowp import linear
    from fivefold.lowp import quantize as fast
    from fivefold.lowp.linear import FP8Recipe, fp8_linear
    from fivefold.numerics import fp8 as reference
    from fivefold.numerics.formats import E4M3, E5M2
    from fivefold.numerics.scaling import amax_to_scale

    device = torch.device(args.device)
    bad, nan_sign, cases = [], 0, 0
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((args.tokens, args.k), (300, 200)):
            for transposed in (False, True):
                x = torch.randn(*shape, device=device, generator=gen) * torch.logspace(
                    -8, 4, shape[1], device=device)
                x[1, 2], x[-1, -1], x[-1, 0] = float("nan"), float("inf"), -float("nan")
                x = x.to(dtype)
                x = x.t() if transposed else x
                for gran in ("tensorwise", "rowwise", "tiles", "blocks"):
                    for fmt, pow2 in ((E4M3, False), (E5M2, True)):
                        cases += 1
                        want = reference.quantize(x, fmt, gran, pow2)
                        got = fast.quantize(x, fmt, gran, pow2)
                        a, b = want.data.float(), got.data.float()
                        nan = a.isnan()
                        strict = torch.equal(want.data.view(torch.uint8),
                                             got.data.view(torch.uint8))
                        nan_sign += 0 if strict else 1
                        same = (torch.equal(nan, b.isnan()) and torch.equal(
                            a[~nan].view(torch.int32), b[~nan].view(torch.int32))
                            and torch.equal(want.scale.nan_to_num(7.0),
                                            got.scale.nan_to_num(7.0)))
                        if not same:
                            bad.append((str(dtype), shape, transposed, gran, fmt.name))
    print(f"quantize: {cases} cases, {len(bad)} differ {bad[:4]}, {nan_sign} with NaN bytes "
          f"of another sign")
    x = torch.randn(args.tokens, args.k, device=device, dtype=torch.bfloat16)
    w = torch.randn(args.n, args.k, device=device, dtype=torch.bfloat16) / args.k ** 0.5
    g = torch.randn(args.tokens, args.n, device=device, dtype=torch.bfloat16)
    for name in RECIPES:
        recipe = FP8Recipe.from_name(name)
        outs = []
        for quantize, dequantize in ((fast.quantize, fast.dequantize),
                                     (reference.quantize, reference.dequantize)):
            linear.quantize, linear.dequantize = quantize, dequantize
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fp8_linear(xr, wr, None, recipe)
            y.backward(g)
            outs.append((y, xr.grad, wr.grad))
        linear.quantize, linear.dequantize = fast.quantize, fast.dequantize
        equal = [torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*outs)]
        print(f"linear {name}: y, dx, dw bit-equal to the reference path: {equal}")
        if not all(equal):
            bad.append(name)
    try:  # a measurement: what a fused (compiled) tensorwise cast would give
        def plain(t):
            m = amax_to_scale(torch.linalg.vector_norm(t, float("inf")), E4M3)
            return (t.float() * m).to(E4M3.dtype), m

        compiled = torch.compile(plain, dynamic=False)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        cq, _ = compiled(x)
        equal = torch.equal(cq.view(torch.uint8), fast.quantize(x, E4M3).data.view(torch.uint8))
        times = {}
        for label, fn in (("reference", lambda: reference.quantize(x, E4M3)),
                          ("eager", lambda: fast.quantize(x, E4M3)),
                          ("compiled", lambda: compiled(x))):
            times[label] = timed(fn, 20, sync)[0]
        print(f"tensorwise quantise of {tuple(x.shape)}: " + ", ".join(
            f"{k} {v:.3f} ms" for k, v in times.items()) + f"; compiled bytes equal: {equal}")
    except Exception as e:  # noqa: BLE001  the probe must not hide the checks above
        print(f"torch.compile probe failed: {type(e).__name__}: {str(e).splitlines()[0]}")
    return 1 if bad else 0


# ---- the driver ------------------------------------------------------------------------

def baseline_src(args, tmp: Path) -> Path:
    if args.baseline_src:
        return Path(args.baseline_src).resolve()
    archive = tmp / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), args.baseline, "src"], cwd=ROOT,
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "base", filter="data")
    return tmp / "base" / "src"


def run_worker(src: Path, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    proc = subprocess.run([sys.executable, __file__, "--worker", *argv], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"worker on {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def git_rev(rev: str = "HEAD") -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--baseline-src", default="")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.check:
        return check(args)
    argv = ["--tokens", str(args.tokens), "--k", str(args.k), "--n", str(args.n),
            "--device", args.device, "--reps", str(args.reps), "--recipes", *args.recipes]
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": baseline_src(args, Path(tmp)), "current": ROOT / "src"}
        for _ in range(args.rounds):  # the trees take turns, so drift hits both alike
            for label, src in trees.items():
                runs[label].append(run_worker(src, argv))
    result = {"shape": [args.tokens, args.k, args.n], "device": args.device,
              "torch": torch.__version__, "git": git_rev(),
              "baseline": args.baseline_src or git_rev(args.baseline), "recipes": {}}
    if args.device == "cuda":
        result["machine"] = torch.cuda.get_device_name()
    else:
        from fivefold.host import cpu_label
        result["machine"] = cpu_label()
    print(f"FP8 linear {args.tokens}x{args.k}->{args.n}, forward + backward, {args.device}, "
          f"medians of {args.rounds} rounds x {args.reps} steps")
    for name in [*args.recipes, *(["bf16"] if args.device == "cuda" else [])]:
        row = {}
        for label, rounds in runs.items():
            first = rounds[0][name]
            row[label] = {k: v for k, v in first.items() if k not in ("ms", "non_gemm_ms")}
            for key in ("ms", "non_gemm_ms"):
                if key in first:
                    row[label][key] = statistics.median(r[name][key] for r in rounds)
        result["recipes"][name] = row
        b, c = row["baseline"], row["current"]
        if name == "bf16":
            print(f"  bf16 F.linear: {c['ms']:.2f} ms")
            continue
        line = (f"  {name:>10}: aten ops {b['n_ops']} -> {c['n_ops']}, passes "
                f"{b['n_passes']} -> {c['n_passes']}, pass bytes {b['pass_bytes'] / 2**20:.0f}"
                f" -> {c['pass_bytes'] / 2**20:.0f} MiB, time {b['ms']:.1f} -> {c['ms']:.1f} ms "
                f"({b['ms'] / c['ms']:.2f}x)")
        if "non_gemm_ms" in c:
            line += (f", non-GEMM {b['non_gemm_ms']:.1f} -> {c['non_gemm_ms']:.1f} ms "
                     f"({b['non_gemm_ms'] / c['non_gemm_ms']:.2f}x)")
        print(line)
        print(f"{'':14}passes before: {dict(sorted(b['passes'].items()))}")
        print(f"{'':14}passes after:  {dict(sorted(c['passes'].items()))}")
        if "cuda_path" in c:
            cu = c["cuda_path"]
            print(f"{'':14}after, CUDA's path: {cu['n_passes']} passes, "
                  f"{cu['pass_bytes'] / 2**20:.0f} MiB: {dict(sorted(cu['passes'].items()))}")
    if args.device == "cuda":
        bf16 = result["recipes"]["bf16"]["current"]["ms"]
        for name in args.recipes:
            row = result["recipes"][name]
            print(f"  {name:>10}: {bf16 / row['baseline']['ms']:.2f}x -> "
                  f"{bf16 / row['current']['ms']:.2f}x bf16's speed")
    out = ROOT / f"bench/results/fp8_quant_passes-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
