"""Step time of fivefold's DP, ZeRO-1/2/3 against torch DDP and FSDP2, same model and data.

    python bench/parallel/dp_zero.py [--dp 2 4] [--steps 12] [--rounds 3] [--precision fp32]
                            [--bucket-mb 25] [--repeats 1]

Ranks are forked gloo processes on this machine (one thread each). Each variant trains the
`tiny` preset (0.8M parameters) on the same batches (2 sequences of 128 tokens per rank per
step), with AdamW and gradient clipping at 1.0 in every variant. The variants take turns
step by step (`rounds` times `steps` steps each, after a warm-up, the order reversed every
step) so that machine noise falls on all of them alike; the step time is the median over
the timed steps on rank 0. Ratios are to DDP (FSDP2 for ZeRO-3) measured in the same run.
`zero2-all` and `zero3-all` run ZeRO-2/3 with every gradient bucket allowed in flight at
once (parallel.buckets_in_flight unbounded: the behaviour before the bound, when staging was
freed only after the last reduction), so the cost of the bound (default 2) is the ratio
zero2 / zero2-all in the same run (`bound_cost`: with --repeats N, the median over N fresh
sets of ranks). At the default 25 MB the tiny model's ZeRO-2 gradient is two buckets, no
more than the bound allows, so zero2 / zero2-all there shows the noise alone; --bucket-mb
0.25 cuts it into nine. Results
go to bench/results/dp_zero.json (bench/results/dp_zero_bucket{MB}.json for another
--bucket-mb).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.host import cpu_label

VARIANTS = ("ddp", "fsdp2", "dp", "zero1", "zero2", "zero3", "zero2-all", "zero3-all")
PEERS = {"zero3": "fsdp2", "zero2-all": "zero2", "zero3-all": "zero3"}
UNBOUNDED = 10**6  # more buckets than any model here has


def _build(kind: str, world: int, dtype, bucket_mb: float):
    from fivefold.config import Config, ParallelSection
    from fivefold.models.init import build_model
    from fivefold.parallel.apply import ParallelModel
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.parallel.zero import build_data_parallel_optimizer
    from fivefold.train.optim import decays
    from fivefold.train.precision import LossScaler

    cfg = Config()
    cfg.model.preset = "tiny"
    model = build_model(cfg.model.resolve(), cfg.train.seed, dtype=dtype)
    if kind.startswith(("dp", "zero")):
        zero = 0 if kind == "dp" else int(kind[4])
        in_flight = UNBOUNDED if kind.endswith("-all") else ParallelSection.buckets_in_flight
        cfg.parallel = ParallelSection(dp=world, zero=zero, bucket_mb=bucket_mb,
                                       buckets_in_flight=in_flight)
        dims = ParallelDims.from_config(cfg.parallel)
        opt = build_data_parallel_optimizer(ParallelModel([model], dims),
                                            list(model.named_parameters()), dims, cfg,
                                            LossScaler())

        def step(batch):
            opt.zero_grad()
            opt.prepare_backward(True)
            x, y = batch
            (model(x, y) / (x.numel() * world)).backward()
            opt.finish_grad_sync()
            opt.step(cfg.train.lr)
        return step

    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    tr = cfg.train
    adam = torch.optim.AdamW(
        [{"params": [p for n, p in named if decays(n, p)], "weight_decay": tr.weight_decay},
         {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}],
        lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps, foreach=True)

    def step(batch):
        adam.zero_grad()
        x, y = batch
        (wrapped(x, y) / x.numel()).backward()  # DDP/FSDP2 average over ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        adam.step()
    return step


def _rank(rank, world, init_file, steps, rounds, precision, bucket_mb, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(256, (2, 129), generator=gen) for _ in range(4)]
    batches = [(b[:, :-1], b[:, 1:]) for b in batches]
    steppers = {kind: _build(kind, world, dtype, bucket_mb) for kind in VARIANTS}
    times = {kind: [] for kind in VARIANTS}
    for step in steppers.values():  # warm-up
        for i in range(3):
            step(batches[i % 4])
    kinds = list(steppers)
    for r in range(rounds):
        for i in range(steps):
            # Every variant runs each step, in an order reversed step by step, so that a
            # burst of machine noise lands on all of them alike and none is always first.
            for kind in kinds if (r * steps + i) % 2 == 0 else kinds[::-1]:
                dist.barrier()
                start = time.perf_counter()
                steppers[kind](batches[i % 4])
                times[kind].append(time.perf_counter() - start)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({k: statistics.median(v) for k, v in times.items()}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh sets of ranks per dp; the step times are their medians")
    args = parser.parse_args()
    # Import the submodules the ranks use before forking them.
    import torch.distributed.fsdp
    import torch.nn.parallel

    device = cpu_label()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip()
    results = {"device": device, "torch": torch.__version__, "precision": args.precision,
               "model": "tiny", "bucket_mb": args.bucket_mb, "git": revision, "runs": {}}
    print(f"device: {device}; torch {torch.__version__}; tiny preset, {args.precision}, "
          f"bucket_mb {args.bucket_mb}; git {revision}")
    print(f"{'dp':>3} {'variant':<7} {'step ms':>8}  ratio")
    results["repeats"], results["bound_cost"] = {}, {}
    for world in args.dp:
        repeats = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "times.json")
                mp.start_processes(_rank, args=(world, os.path.join(tmp, "rdv"), args.steps,
                                                args.rounds, args.precision, args.bucket_mb,
                                                out),
                                   nprocs=world, start_method="fork")
                repeats.append(json.loads(Path(out).read_text()))
        times = {k: statistics.median(r[k] for r in repeats) for k in VARIANTS}
        results["runs"][str(world)] = times
        results["repeats"][str(world)] = repeats
        # The bound's cost: bounded / all buckets in flight, per repeat, then the median.
        results["bound_cost"][str(world)] = {
            z: {"median": statistics.median(r[z] / r[f"{z}-all"] for r in repeats),
                "each": [round(r[z] / r[f"{z}-all"], 3) for r in repeats]}
            for z in ("zero2", "zero3")}
        for kind in VARIANTS:
            peer = PEERS.get(kind, "ddp")
            ratio = "" if kind in ("ddp", "fsdp2") else f"{times[kind] / times[peer]:.3f} × {peer}"
            print(f"{world:>3} {kind:<7} {times[kind] * 1e3:8.2f}  {ratio}")
        for z, cost in results["bound_cost"][str(world)].items():
            print(f"{world:>3} {z} bounded / all in flight: median {cost['median']:.3f} of "
                  f"{cost['each']}")
    name = "dp_zero" + ("" if args.bucket_mb == 25.0 else f"_bucket{args.bucket_mb:g}")
    path = Path(__file__).resolve().parents[1] / "results" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
