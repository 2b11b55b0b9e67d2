"""Step time of fivefold's tensor parallelism against PyTorch's DTensor TP, same model.

    python bench/parallel/tp_vs_dtensor.py [--tp 2 4] [--steps 10] [--seq 256] [--batch 4]

Each tp size forks that many gloo ranks on this machine (one thread each). Both engines
train the same untied `tiny` Llama (4 kv heads, so DTensor's plain column split of k/v
stays head-aligned at tp 4) from the same weights on the same batch, with and without
sequence parallelism; a step is zero_grad + forward + backward + AdamW. The DTensor side is
torchtitan's Llama plan with `loss_parallel` (tests/test_tensor_parallel.py:dtensor_model).
Prints the median step time of each, and writes bench/results/tp_vs_dtensor.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from test_tensor_parallel import dtensor_loss, dtensor_model

from fivefold.config import ParallelSection
from fivefold.host import cpu_model
from fivefold.models.init import build_meta, materialize
from fivefold.models.presets import preset
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.tensor import apply_tensor_parallel

SEED = 7


def model_config():
    return preset("tiny").replace(tie_embeddings=False, num_kv_heads=4)


def _time_steps(step_fn, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - start)
    return times


def _step(opt, forward_backward):
    def step():
        opt.zero_grad(set_to_none=True)
        forward_backward()
        opt.step()
    return step


def _rank(rank, world, init_file, out_path, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    from torch.distributed.tensor.parallel import loss_parallel

    cfg = model_config()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    dims = ParallelDims.from_config(ParallelSection(tp=world))
    result = {}
    for sp in (False, True):
        ours = materialize(apply_tensor_parallel(build_meta(cfg), dims, sp), cfg, SEED)
        theirs = dtensor_model(cfg, world, sp, SEED)
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
        opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)

        step_ours = _step(opt_ours, lambda m=ours: (m(tokens, targets) / tokens.numel()
                                                      ).backward())
        step_theirs = _step(opt_theirs, lambda m=theirs: dtensor_loss(m, tokens, targets,
                                                                       loss_parallel))

        t_ours, t_theirs = [], []
        for _ in range(2):  # alternate blocks so drift in the machine hits both alike
            t_ours += _time_steps(step_ours, 2, args.steps // 2)
            t_theirs += _time_steps(step_theirs, 2, args.steps // 2)
        result[f"sp={sp}"] = {"fivefold_s": statistics.median(t_ours),
                              "dtensor_s": statistics.median(t_theirs)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    cfg = model_config()
    rows = []
    for tp in args.tp:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(_rank, args=(tp, os.path.join(tmp, "rdv"), out, args),
                               nprocs=tp, start_method="fork")
            with open(out) as f:
                for mode, r in json.load(f).items():
                    rows.append({"tp": tp, "mode": mode, **r,
                                 "ratio": r["fivefold_s"] / r["dtensor_s"]})
    device = f"cpu: {cpu_model()}, {os.cpu_count()} cores"
    print(f"model {cfg.name} (untied, kv 4) h={cfg.hidden_size} L={cfg.num_layers} "
          f"V={cfg.vocab_size}, batch {args.batch} x seq {args.seq}, fp32, gloo; {device}")
    print(f"{'tp':>3} {'mode':>9} {'fivefold ms':>12} {'DTensor ms':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['tp']:>3} {r['mode']:>9} {1e3 * r['fivefold_s']:>12.1f} "
              f"{1e3 * r['dtensor_s']:>11.1f} {r['ratio']:>6.2f}")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "tp_vs_dtensor.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "batch": args.batch, "seq": args.seq,
         "model": "tiny untied kv4", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
