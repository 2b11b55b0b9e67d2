"""fivefold's pipeline executor against torch.distributed.pipelining, side by side.

Both run the very same stage modules (fivefold's `PipelineStage`s, built by the Trainer from
one seed) on the same micro-batches; only the executor differs. Per schedule it times one
forward+backward step (no optimizer, so the two sides do the same work), median of the
timed repeats after warm-up, on pp ranks of the gloo backend, one thread each.

    python bench/parallel/pp_vs_torch.py                      # pp 2, prints a table, writes JSON
    python bench/parallel/pp_vs_torch.py --hidden 256 --layers 8 --seq 128 --microbatches 8

Pairs: afab ~ ScheduleGPipe, 1f1b ~ Schedule1F1B, interleaved ~ ScheduleInterleaved1F1B
(v = 2 on both), zb ~ ScheduleInterleavedZeroBubble (torch has no single-chunk ZB-H1, so
its side runs v = 2), dualpipev ~ ScheduleDualPipeV.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from fivefold.host import cpu_model

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "dualpipev")
TORCH_NAMES = {
    "afab": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def torch_virtual(name: str) -> int:
    return {"interleaved": 2, "zb": 2, "dualpipev": 2}.get(name, 1)


def fivefold_overrides(name: str, pp: int, microbatches: int, virtual: int) -> list[str]:
    return [
        "--parallel.pp",
        str(pp),
        "--parallel.schedule",
        name,
        "--train.gbs",
        str(microbatches),
        "--parallel.virtual_stages",
        str(virtual),
    ]


def torch_schedule(chunks, pp_group, name: str, num_microbatches: int, num_tokens: int):
    """A torch.distributed.pipelining schedule over fivefold's stage modules."""
    from torch.distributed import pipelining as tp

    num_stages = len(chunks) * pp_group.size
    stages = [
        tp.PipelineStage(c, c.stage_index, num_stages, torch.device("cpu"), group=pp_group.pg)
        for c in chunks
    ]

    def loss_fn(logits, targets):  # summed CE / target tokens of the global batch
        return (
            F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )
            / num_tokens
        )

    cls = getattr(tp, TORCH_NAMES[name])
    target = stages[0] if len(stages) == 1 else stages
    return cls(target, num_microbatches, loss_fn=loss_fn, scale_grads=False)


def torch_step(schedule, chunks, micro_batches) -> torch.Tensor | None:
    """One forward+backward; the summed loss on the rank with the last stage, else None."""
    inputs = torch.cat([x for x, _ in micro_batches])
    targets = torch.cat([y for _, y in micro_batches])
    first = any(c.first for c in chunks)
    last = any(c.last for c in chunks)
    losses: list = []
    args = (inputs,) if first else ()
    schedule.step(*args, target=targets if last else None, losses=losses if last else None)
    return torch.stack(losses).sum().detach() if last else None


def _rank_main(rank, world, args, out_file):
    sys.path.insert(0, str(ROOT / "tests"))
    from common import small_config

    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.trainer import Trainer

    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name in args.schedules:
        result = {"schedule": name, "torch": TORCH_NAMES[name]}
        steps = {}
        for side in ("fivefold", "torch"):
            v = torch_virtual(name) if side == "torch" else (2 if name == "interleaved" else 1)
            # torch's ZB runs two chunks per rank in the loop layout: interleaved's stages.
            layout = "interleaved" if side == "torch" and name == "zb" else name
            cfg = small_config(
                tmp,
                *("--model.hidden_size", str(args.hidden)),
                *("--model.intermediate_size", str(4 * args.hidden)),
                *("--model.num_layers", str(args.layers)),
                *("--train.seq_len", str(args.seq), "--model.tie_embeddings", "false"),
                *fivefold_overrides(layout, world, args.microbatches, v),
            )
            trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
            micro_batches = trainer.loader.next_batch()
            tokens = trainer.loader.num_target_tokens
            if side == "torch":
                schedule = torch_schedule(
                    trainer.model.chunks, trainer.dims["pp"], name, len(micro_batches), tokens
                )
                run = partial(torch_step, schedule, trainer.model.chunks, micro_batches)
            else:
                run = partial(trainer.pipeline.run, micro_batches, tokens)
            steps[side] = (trainer, run)
        # The two sides alternate step by step (order flipped each round), so a load
        # change on a shared machine hits both alike.
        times = {side: [] for side in steps}
        for i in range(args.warmup + args.repeats):
            for side in list(steps)[:: 1 if i % 2 else -1]:
                trainer, run = steps[side]
                trainer.optimizer.zero_grad()
                torch.distributed.barrier()
                start = time.perf_counter()
                run()
                torch.distributed.barrier()
                if i >= args.warmup:
                    times[side].append(time.perf_counter() - start)
        for side, values in times.items():
            result[f"{side}_s"] = statistics.median(values)
        result["ratio"] = result["fivefold_s"] / result["torch_s"]
        rows.append(result)
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pp_vs_torch.json"))
    args = parser.parse_args(argv)
    args.schedules = args.schedules.split(",")
    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rows.json")
        run_ranks(_rank_main, args.pp, args, out_file)
        rows = json.loads(Path(out_file).read_text())
    print(
        f"pp={args.pp} hidden={args.hidden} layers={args.layers} seq={args.seq} "
        f"m={args.microbatches} (gloo, CPU, 1 thread/rank; median of {args.repeats})"
    )
    print(f"{'schedule':<12} {'fivefold ms':>12} {'torch ms':>10} {'ratio':>6}  torch schedule")
    for r in rows:
        print(
            f"{r['schedule']:<12} {1e3 * r['fivefold_s']:>12.1f} {1e3 * r['torch_s']:>10.1f} "
            f"{r['ratio']:>6.2f}  {r['torch']}"
        )
    record = {
        "device": cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
