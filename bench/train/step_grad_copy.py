"""What one optimizer step allocates at its peak with bf16 weights and fp32 masters, this tree
against a baseline revision, in one run (parallel/step_grads.py's issue: the reduced
gradients were copied to fp32 all at once, 4 bytes per parameter of the rank's shard).

    python3 bench/train/step_grad_copy.py                          # smollm2-135m on the CPU
    python3 bench/train/step_grad_copy.py --preset tiny --layers 4

The baseline is `git archive`d from `--baseline` (default: the revision before
parallel/step_grads.py) into a temporary folder. Each tree runs in its own subprocess
(PYTHONPATH at its src/). For each owner of the step (the single-replica
`MasterWeightOptimizer`; ZeRO-1's `DataParallelOptimizer` on one rank) it runs two steps on a
loss linear in the weights (fixed random bf16 gradients: the model's forward would only add
time), clipped (train.grad_clip = 1), and measures the second:

  - `step_allocated_bytes`: what the step allocates beyond what the optimizer held before
    it, at its peak (train/allocations.py: every storage created, until it is freed);
  - `tracked_bytes`: the peak tracker's growth over the step, at whichever point it samples
    (parallel/peak.py; the baseline's single-replica optimizer sampled none);
  - the largest piece's and the whole shard's fp32 gradient bytes;
  - the gradient norms and a SHA-256 of the fp32 masters after the two steps: the trees must
    agree bit for bit.

It writes bench/results/step_grad_copy-cpu.json (machine, versions, git revisions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from revisions import baseline_src

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "af3718b"  # the last revision that copied every gradient to fp32 at once
LR = 3e-3


# ---- the worker: runs in a subprocess with PYTHONPATH at one tree's src/ -------------------

def _owner(zero: int, preset: str, layers: int) -> dict:
    import torch

    from fivefold.config import Config, ParallelSection
    from fivefold.models.init import build_model
    from fivefold.parallel.apply import ParallelModel
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.parallel.peak import PeakTracker
    from fivefold.parallel.zero import build_data_parallel_optimizer
    from fivefold.train.allocations import PeakAllocations
    from fivefold.train.optim import MasterWeightOptimizer
    from fivefold.train.precision import LossScaler

    cfg = Config()
    cfg.model.preset = preset
    cfg.model.overrides = {"num_layers": layers}
    cfg.parallel = ParallelSection(dp=1, zero=zero, mbs=1)
    cfg.train.lr, cfg.train.grad_clip = LR, 1.0
    dims = ParallelDims.single()
    model = build_model(cfg.model.resolve(), cfg.train.seed, dtype=torch.bfloat16)
    named = list(model.named_parameters())
    if zero == 0:
        opt = MasterWeightOptimizer(named, cfg.train, dims, LossScaler())
    else:
        opt = build_data_parallel_optimizer(ParallelModel([model], dims), named, dims, cfg,
                                            LossScaler())
    params, norms, out = [p for _, p in named], [], {}
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        opt.zero_grad()
        opt.prepare_backward(final_microbatch=True)
        sum((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in params).backward()
        opt.finish_grad_sync()
        if step == 0:
            norms.append(opt.step(LR).grad_norm)
            continue
        held = [t for source in opt.peak_sources().values() for t in source() if t is not None]
        with PeakTracker(opt.peak_sources()) as tracker, PeakAllocations(held) as meter:
            start = meter.current
            norms.append(opt.step(LR).grad_norm)
        out["step_allocated_bytes"] = meter.peak - start
        out["tracked_bytes"] = tracker.peak - tracker.points["start"]  # at any point
    digest = hashlib.sha256()
    states = opt.param_states()
    for name in sorted(states):
        digest.update(states[name]["master"].float().contiguous().numpy().tobytes())
    sizes = [p.numel() for p in params]
    return {**out, "largest_piece_fp32_bytes": 4 * max(sizes),
            "whole_fp32_bytes": 4 * sum(sizes), "pieces": len(sizes), "grad_norms": norms,
            "masters_sha256": digest.hexdigest()}


def worker(preset: str, layers: int) -> None:
    import torch

    torch.set_num_threads(1)
    print(json.dumps({"single": _owner(0, preset, layers), "zero1": _owner(1, preset, layers)}))


# ---- the driver -----------------------------------------------------------------------------

def run_tree(src: Path, preset: str, layers: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, __file__, "--worker", "--preset", preset,
                           "--layers", str(layers)], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.preset, args.layers)
        return 0
    import torch

    from fivefold.train.bench import git_revision, machine, repo_relative

    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": run_tree(baseline_src(args.baseline, Path(tmp)), args.preset,
                                      args.layers),
                 "this": run_tree(ROOT / "src", args.preset, args.layers)}
    identical = True
    for owner in ("single", "zero1"):
        base, this = trees["baseline"][owner], trees["this"][owner]
        same = (base["grad_norms"] == this["grad_norms"]
                and base["masters_sha256"] == this["masters_sha256"])
        identical &= same
        print(f"{owner}: {this['pieces']} pieces, fp32 gradients {this['whole_fp32_bytes']:,} "
              f"bytes, largest piece {this['largest_piece_fp32_bytes']:,}")
        for name, tree in (("baseline", base), ("this tree", this)):
            print(f"  {name:9s} step allocates {tree['step_allocated_bytes']:>13,} bytes at its "
                  f"peak, tracker {tree['tracked_bytes']:>13,}")
        print(f"  norms and fp32 masters bit-identical: {same}")
    record = {"bench": "step_grad_copy", "preset": args.preset, "layers": args.layers,
              "baseline": args.baseline, "git_revision": git_revision(),
              "machine": machine(torch.device("cpu")), "trees": trees,
              "bit_identical": identical}
    path = ROOT / "bench" / "results" / "step_grad_copy-cpu.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {repo_relative(path)}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
