"""MoE speed: grouped-matmul experts against the per-expert loop, then the step time of
expert parallelism (ep 2, ep 4) against data parallelism alone, same batch.

    python bench/parallel/moe.py [--world 4] [--steps 6] [--rounds 3] [--experts 8]
                        [--gmm-tokens 2048] [--gmm-hidden 512] [--gmm-inter 1024]
                        [--gmm-experts 8 32] [--gmm-dtype fp32 bf16] [--gmm-rounds 5]

Grouped matmul: `GroupedExperts` (models/moe.py) runs the tokens of all experts with one
`torch._grouped_mm` per projection; `impl="loop"` slices them per expert, three matmuls each.
Both get the same weights and routed tokens (a router on random inputs, sorted as the
LocalDispatcher sorts them) and time one forward + backward of the experts on this process
(two threads), alternating `gmm_rounds` times after a warm-up; the median is reported, and
the ratio loop / grouped measured in the same run.

Expert parallelism:
Ranks are forked gloo processes on this machine (one thread each). Every variant trains the
same MoE (the `tiny` preset's attention with 8 SwiGLU experts of 128, top-2, in every layer;
fp32) on the same global batch (16 sequences of 128 tokens) through the trainer, at dp =
world: ep 1 (every rank holds all experts; experts' gradients all-reduced over dp), ep 2 and
ep 4 (each rank holds E/ep experts; tokens travel by all-to-all; expert gradients over
dp/ep ranks). The variants run in turns (`rounds` × `steps` steps each, after a warm-up
step) so machine noise falls on all alike; the step time is the median over the timed steps
on rank 0. Ratios are to ep 1 measured in the same run. Results go to bench/results/moe.json.

On a CPU the all-to-alls are memory copies between processes and the experts' matmuls are
small: the numbers show the engine's overhead, not what EP gains on GPUs (fewer expert
weights and optimizer states per rank, at the cost of two all-to-alls per layer).
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
import torch.distributed.checkpoint  # noqa: F401  (import the submodules before forking)
import torch.multiprocessing as mp

from fivefold.host import cpu_label
from fivefold.models.moe import GroupedExperts, Router, grouped_mm_available

MODEL = ["--model.preset", "tiny", "--model.num_experts", "{experts}", "--model.experts_top_k",
         "2", "--model.moe_intermediate_size", "128", "--train.seq_len", "128",
         "--train.gbs", "16", "--parallel.mbs", "2", "--train.precision", "fp32",
         "--train.device", "cpu", "--train.steps", "1000", "--train.eval_every", "0",
         "--checkpoint.every", "0", "--log.progress", "false", "--log.tensorboard", "false"]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def routed_tokens(tokens: int, hidden: int, experts: int, top_k: int, dtype):
    """Tokens sorted by expert and the per-expert counts, as the LocalDispatcher makes them."""
    gen = torch.Generator().manual_seed(0)
    router = Router(hidden, experts, top_k)
    with torch.no_grad():
        router.weight.normal_(0, 0.02, generator=gen)
        x = torch.randn(tokens, hidden, generator=gen)
        _, _, idx, _ = router(x)
    order = torch.argsort(idx.flatten(), stable=True)
    counts = torch.bincount(idx.flatten(), minlength=experts)
    return x.index_select(0, order // top_k).to(dtype), counts


def time_once(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor,
              grad: torch.Tensor) -> float:
    xi = x.detach().requires_grad_()
    start = time.perf_counter()
    experts(xi, counts).backward(grad)
    elapsed = time.perf_counter() - start
    experts.zero_grad(set_to_none=True)
    return elapsed


def grouped_vs_loop(args) -> list[dict]:
    """Experts alone, one process: grouped matmul against the per-expert loop."""
    rows = []
    for dtype_name in args.gmm_dtype:
        dtype = DTYPES[dtype_name]
        for e in args.gmm_experts:
            x, counts = routed_tokens(args.gmm_tokens, args.gmm_hidden, e, 2, dtype)
            if not grouped_mm_available(x, args.gmm_hidden, args.gmm_inter):
                print(f"{dtype_name} E={e}: no grouped matmul in this torch; skipped")
                continue
            grouped = GroupedExperts(e, args.gmm_hidden, args.gmm_inter, impl="grouped_mm")
            with torch.no_grad():
                for p in grouped.parameters():
                    p.normal_(0, 0.02)
            grouped.to(dtype)
            loop = GroupedExperts(e, args.gmm_hidden, args.gmm_inter, impl="loop").to(dtype)
            loop.load_state_dict(grouped.state_dict())
            grad = torch.randn(x.shape[0], args.gmm_hidden).to(dtype)
            times = {"grouped_mm": [], "loop": []}
            for impl in ("grouped_mm", "loop"):  # warm-up
                time_once(grouped if impl == "grouped_mm" else loop, x, counts, grad)
            for _ in range(args.gmm_rounds):
                for impl, mod in (("grouped_mm", grouped), ("loop", loop)):
                    times[impl].append(time_once(mod, x, counts, grad))
            g, lp = statistics.median(times["grouped_mm"]), statistics.median(times["loop"])
            row = {"dtype": dtype_name, "experts": e, "routed_rows": int(x.shape[0]),
                   "grouped_mm_s": g, "loop_s": lp, "loop_over_grouped": lp / g}
            rows.append(row)
            print(f"{dtype_name} E={e:>3} rows={x.shape[0]}: grouped_mm {1e3 * g:8.2f} ms, "
                  f"loop {1e3 * lp:8.2f} ms, loop/grouped {lp / g:.2f}x  (fwd+bwd, median of "
                  f"{args.gmm_rounds})")
    return rows


def _trainer(world: int, ep: int, experts: int, tmp: str):
    from fivefold import config
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.trainer import Trainer

    args = [a.format(experts=experts) for a in MODEL] + [
        "--parallel.dp", str(world), "--parallel.ep", str(ep),
        "--checkpoint.dir", f"{tmp}/ep{ep}/ckpt", "--log.dir", f"{tmp}/ep{ep}/log"]
    cfg = config.load(None, args)
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)


def _rank(rank, world, init_file, eps, experts, steps, rounds, out_path, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    trainers = {ep: _trainer(world, ep, experts, tmp) for ep in eps}
    times: dict[int, list[float]] = {ep: [] for ep in eps}
    losses: dict[int, list[float]] = {ep: [] for ep in eps}
    for trainer in trainers.values():  # warm-up
        trainer.train_step()
    for _ in range(rounds):
        for ep, trainer in trainers.items():
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                record = trainer.train_step()
                times[ep].append(time.perf_counter() - start)
                losses[ep].append(record["loss"])
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": {ep: statistics.median(t) for ep, t in times.items()},
                       "losses": losses}, f)
    dist.destroy_process_group()


def _git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks (= dp)")
    parser.add_argument("--ep", type=int, nargs="*", default=[1, 2, 4],
                        help="ep sizes to time against ep 1; none (--ep alone): grouped "
                        "matmul only")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gmm-tokens", type=int, default=2048)
    parser.add_argument("--gmm-hidden", type=int, default=512)
    parser.add_argument("--gmm-inter", type=int, default=1024)
    parser.add_argument("--gmm-experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--gmm-dtype", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--gmm-rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    grouped = grouped_vs_loop(args)
    device = cpu_label()
    results = {"device": device, "torch": torch.__version__, "git": _git_revision(),
               "load": f"{os.getloadavg()[0]:.0f} (1-minute load average at the end) on "
                       f"{os.cpu_count()} CPU cores shared with other jobs",
               "grouped_vs_loop": grouped,
               "grouped_config": {k: getattr(args, k) for k in (
                   "gmm_tokens", "gmm_hidden", "gmm_inter", "gmm_rounds")}}
    path = Path(__file__).resolve().parents[1] / "results" / "moe.json"
    path.parent.mkdir(exist_ok=True)
    if not args.ep:
        path.write_text(json.dumps(results, indent=1))
        return
    print(f"device: {device}; torch {torch.__version__}; tiny attention + {args.experts} "
          f"experts top-2, fp32, dp {args.world}, gbs 16 × 128 tokens")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(args.world, os.path.join(tmp, "rdv"), args.ep,
                                        args.experts, args.steps, args.rounds, out, tmp),
                           nprocs=args.world, start_method="fork")
        measured = json.loads(Path(out).read_text())
    times = {int(ep): t for ep, t in measured["times"].items()}
    base = times[min(times)]
    print(f"{'ep':>3} {'step ms':>8}  ratio")
    for ep, t in sorted(times.items()):
        print(f"{ep:>3} {t * 1e3:8.1f}  {t / base:.3f} × ep {min(times)}")
    # Same seed, data and model at every ep: the losses agree (parity is the tests' business;
    # here it shows the variants did the same work).
    first = {ep: losses[0] for ep, losses in measured["losses"].items()}
    print("first timed loss per ep:", {ep: round(v, 6) for ep, v in first.items()})
    results.update({"model": f"tiny + {args.experts} experts top-2", "precision": "fp32",
                    "dp": args.world, "gbs": 16, "seq_len": 128, "step_s": times,
                    "ratio_to_ep1": {ep: t / base for ep, t in times.items()}})
    path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
