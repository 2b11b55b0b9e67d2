"""ZeRO-3's parameter all-gather with and without parallel.fp8_allgather: bytes per step,
measured by the engine's ledger on CPU gloo ranks, against the planner's, and the losses.

    python bench/fp8/fp8_allgather_bytes.py [--dp 2] [--steps 3] [--hidden 256 512]
    python bench/fp8/fp8_allgather_bytes.py --experts 8 --hidden 256

Each width trains a Llama of `--layers` blocks (MLP 3x hidden, heads of 64, kv heads half
the heads; the byte tokenizer's vocabulary, so the embedding and head stay small beside the
blocks) with train.precision = fp8, tensorwise, ZeRO-3 over `--dp` forked gloo ranks, 2
micro-batches of 2 sequences of 128 tokens per rank per step. Per step it reports the dp
all-gather and all-reduce bytes of the ledger (the last step) and of the planner, the
padding of the FP8 messages (each rank's message padded to the longest rank's), and whether
the losses of the two runs are bit-equal. Wall time per step is printed too, but CPU gloo
on shared cores says nothing about a GPU's interconnect: the bytes are the result. Results
go to bench/results/fp8_allgather_bytes.json. With `--experts E` every block is a MoE layer
of E routed experts (top 2, each of intermediate width hidden; their weights gather in FP8
too, one scale per expert's weight), results to bench/results/fp8_allgather_bytes_moe.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold import config
from fivefold.host import cpu_label
from fivefold.parallel.mesh import ParallelDims
from fivefold.plan.comm import ledger_volume
from fivefold.plan.inputs import training_plan_inputs
from fivefold.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp: str, dp: int, hidden: int, layers: int, fp8_allgather: bool,
            experts: int = 0):
    heads = hidden // 64
    moe = (["--model.num_experts", str(experts), "--model.experts_top_k", "2",
            "--model.moe_intermediate_size", str(hidden)] if experts else [])
    return config.load(None, [*moe,
        "--model.preset", "tiny", "--data.tokenizer", "byte",
        "--model.hidden_size", str(hidden), "--model.intermediate_size", str(3 * hidden),
        "--model.num_layers", str(layers), "--model.num_heads", str(heads),
        "--model.num_kv_heads", str(max(1, heads // 2)), "--train.seq_len", "128",
        "--train.gbs", str(4 * dp), "--parallel.mbs", "2", "--train.steps", "100",
        "--train.warmup_steps", "0", "--train.eval_every", "0", "--train.device", "cpu",
        "--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
        "--parallel.dp", str(dp), "--parallel.zero", "3", "--parallel.grad_sync", "step",
        "--parallel.fp8_allgather", str(fp8_allgather).lower(),
        "--checkpoint.dir", os.path.join(tmp, "ckpt"), "--checkpoint.every", "0",
        "--log.dir", os.path.join(tmp, "log"), "--log.progress", "false",
        "--log.tensorboard", "false"])


def _rank(rank, world, init_file, tmp, hidden, layers, steps, fp8_allgather, out_path,
          experts):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    cfg = _config(tmp, world, hidden, layers, fp8_allgather, experts)
    dims = ParallelDims.from_config(cfg.parallel)
    trainer = Trainer(cfg, dims, quiet=True)
    gatherer = trainer.optimizer.gatherer
    padding = 0  # bytes per gather of every FP8 unit beyond 1 per FP8 element and 2 per other
    for unit in gatherer.fp8.values():
        fp8 = sum(numel for _, _, _, numel, _ in unit.entries)
        padding += world * unit.message - (fp8 + 2 * (unit.seg.size - fp8))
    dims.ledger.enabled = True
    losses, times = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(trainer.train_step()["loss"])
        times.append(time.perf_counter() - start)
    totals = dims.ledger.totals()
    trainer.close()
    work, layout = training_plan_inputs(cfg)
    planned = ledger_volume(work, layout)["dp_cp"]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({
                "losses": losses, "step_s": statistics.median(times[1:] or times),
                "ledger": {op: totals[("dp_cp", op)]["bytes"]
                           for op in ("all_gather", "all_reduce")},
                "planned": {op: planned[op] for op in ("all_gather", "all_reduce")},
                "padding": padding * 2 * work.num_microbatches(layout),
                "params": sum(s.numel for s in trainer.optimizer.layout.params)}, f)
    dist.destroy_process_group()


def _run(dp: int, hidden: int, layers: int, steps: int, fp8_allgather: bool,
         experts: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        procs = [ctx.Process(target=_rank, args=(r, dp, os.path.join(tmp, "init"), tmp,
                                                 hidden, layers, steps, fp8_allgather, out,
                                                 experts))
                 for r in range(dp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--experts", type=int, default=0, help="routed experts per layer (0: dense)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.experts < 0 or args.experts == 1:
        print("fp8_allgather_bytes: --experts is 0 (dense) or at least 2", file=sys.stderr)
        sys.exit(2)
    args.out = args.out or str(ROOT / "bench/results" / (
        "fp8_allgather_bytes_moe.json" if args.experts else "fp8_allgather_bytes.json"))
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT).stdout.strip()
    results = {"device": cpu_label(), "torch": torch.__version__, "git": revision,
               "dp": args.dp, "steps": args.steps, "layers": args.layers,
               "experts": args.experts, "runs": {}}
    print(f"device: {results['device']}; torch {torch.__version__}; git {revision}; "
          f"ZeRO-3 over dp {args.dp}, fp8 tensorwise, {args.layers} layers"
          + (f" of {args.experts} routed experts" if args.experts else ""))
    for hidden in args.hidden:
        off = _run(args.dp, hidden, args.layers, args.steps, False, args.experts)
        on = _run(args.dp, hidden, args.layers, args.steps, True, args.experts)
        row = {"params": off["params"], "bf16_gather": off, "fp8_allgather": on,
               "all_gather_ratio": on["ledger"]["all_gather"] / off["ledger"]["all_gather"],
               "padding_share": on["padding"] / on["ledger"]["all_gather"],
               "losses_bit_equal": on["losses"] == off["losses"]}
        results["runs"][f"hidden{hidden}"] = row
        print(f"hidden {hidden} ({off['params'] / 1e6:.2f}M params): all_gather per step "
              f"{off['ledger']['all_gather']:,} -> {on['ledger']['all_gather']:,} bytes "
              f"({row['all_gather_ratio']:.3f}x; planned {off['planned']['all_gather']:,.0f}"
              f" -> {on['planned']['all_gather']:,.0f}), padding {on['padding']:,} bytes "
              f"({row['padding_share']:.2%}); all_reduce {off['ledger']['all_reduce']} -> "
              f"{on['ledger']['all_reduce']} bytes (planned {on['planned']['all_reduce']:.0f})"
              f"; losses bit-equal: {row['losses_bit_equal']}; step {off['step_s']:.2f} s -> "
              f"{on['step_s']:.2f} s (CPU gloo)")
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {os.path.relpath(args.out, ROOT)}")


if __name__ == "__main__":
    main()
