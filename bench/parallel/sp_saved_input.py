"""SP's saved input: the gathered full sequence ("full") against the shard, gathered again in
backward ("shard", parallel.sp_saved_input), at tp 2 on this machine.

    python bench/parallel/sp_saved_input.py [--steps 10] [--seq 512] [--batch 4]

Forks tp gloo ranks (one thread each), trains the same `tiny` model both ways from the same
weights and batch, and measures per rank: saved-for-backward bytes of one forward
(parallel/memory.py SavedActivations), the step time (median, blocks alternated so drift
hits both alike) and the ledger bytes per step. Writes bench/results/sp_saved_input.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.config import ParallelSection
from fivefold.host import cpu_label
from fivefold.models.init import build_meta, materialize
from fivefold.models.presets import preset
from fivefold.parallel.memory import SavedActivations
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.tensor import apply_tensor_parallel

ROOT = Path(__file__).resolve().parents[2]
MODES = ("full", "shard")


def _rank(rank, world, init_file, out_path, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    cfg = preset("tiny")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    dims = ParallelDims.from_config(ParallelSection(tp=world))
    models, opts, result = {}, {}, {}
    for mode in MODES:
        models[mode] = materialize(apply_tensor_parallel(build_meta(cfg), dims, True,
                                                         sp_saved_input=mode), cfg, 0)
        opts[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-3)
        params = list(models[mode].parameters())
        with SavedActivations(params) as meter:
            loss = models[mode](tokens, targets)
        dims.ledger.reset()
        dims.ledger.enabled = True
        loss.backward()
        dims.ledger.enabled = False
        result[mode] = {"saved_bytes": meter.bytes,
                        "backward_ledger_bytes": sum(dims.ledger.bytes_by_group().values()),
                        "times": []}

    def step(mode):
        opts[mode].zero_grad(set_to_none=True)
        (models[mode](tokens, targets) / tokens.numel()).backward()
        opts[mode].step()

    for _ in range(2):
        for mode in MODES:
            step(mode)  # warm-up
            for _ in range(args.steps // 2):
                dist.barrier()
                start = time.perf_counter()
                step(mode)
                result[mode]["times"].append(time.perf_counter() - start)
    for mode in MODES:
        result[mode]["step_s"] = statistics.median(result[mode].pop("times"))
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "rdv"), out, args), nprocs=2,
                           start_method="fork")
        res = json.loads(Path(out).read_text())
    full, shard = res["full"], res["shard"]
    print(f"tiny model, tp 2 + SP, batch {args.batch} x seq {args.seq}, fp32, gloo, "
          f"{os.cpu_count()} CPU cores (shared with other work: ratios, not absolutes)")
    for mode in MODES:
        r = res[mode]
        print(f"  {mode:<5} saved {r['saved_bytes'] / 2**20:8.2f} MiB  backward ledger "
              f"{r['backward_ledger_bytes'] / 2**20:8.2f} MiB  step {1e3 * r['step_s']:8.1f} ms")
    print(f"shard/full: saved {shard['saved_bytes'] / full['saved_bytes']:.3f}, step time "
          f"{shard['step_s'] / full['step_s']:.3f}")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    (ROOT / "bench" / "results" / "sp_saved_input.json").write_text(json.dumps(
        {"machine": platform.node(), "cpu": cpu_label(), "cpu_count": os.cpu_count(),
         "torch": torch.__version__,
         "git": rev, "batch": args.batch, "seq": args.seq, "results": res,
         "ratio_saved": shard["saved_bytes"] / full["saved_bytes"],
         "ratio_step": shard["step_s"] / full["step_s"]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
