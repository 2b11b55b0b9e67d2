"""Delayed FP8 scaling compiled on 2 data-parallel ranks against the same ranks eager.

    python3 bench/fp8/fp8_delayed_compile_dp2.py               # dp2, 3 steps
    python3 bench/fp8/fp8_delayed_compile_dp2.py --zero 1 --steps 2

Two ranks (gloo, CPU, forked by tests/harness.py) train the tests' tiny model (2 blocks,
hidden 128, FP8 tensorwise with delayed scaling, history 4, 8 x 32 tokens a step in
micro-batches of 2), first eager, then with `train.compile = true` under inductor's
`emulate_precision_casts` (bf16 intermediates rounded where eager rounds them), as
tests/test_fp8_delayed_compile.py does on one rank. The compiled run must give eager's
losses, gradient norms and amax histories bit for bit on every rank: the same casts, GEMMs
and records, and the step's one all_reduce(max) of the records outside the compiled blocks.
It prints both runs per rank, the graphs and graph breaks after each compiled step, the
verdict and the time of each run, and writes bench/results/fp8_delayed_compile_dp2.json
(`_zeroN` before `.json` under `--zero N`).
Not in the suite: the first compile with `emulate_precision_casts` took 137 s of the two
ranks here (a warm inductor cache: 18 s), past what a test may take.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DELAYED = ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
           "--train.fp8_scaling", "delayed", "--train.fp8_history_len", "4",
           "--train.gbs", "8", "--parallel.mbs", "2", "--train.lr", "1e-3",
           "--model.hidden_size", "128", "--model.intermediate_size", "256",
           "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
           "--model.preset", "tiny", "--data.tokenizer", "byte", "--train.seq_len", "32",
           "--train.warmup_steps", "0", "--train.eval_every", "0", "--train.device", "cpu",
           "--checkpoint.every", "0", "--log.progress", "false", "--log.tensorboard", "false",
           "--parallel.dp", "2"]


def ranks_run(rank, world, tmp, steps, zero):
    """On one rank: eager, then compiled: per step (loss, grad norm, graphs, breaks), the
    histories after the last step, the run's seconds."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from fivefold import config
    from fivefold.lowp.delayed import histories
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.trainer import Trainer

    inductor_config.emulate_precision_casts = True
    out = {}
    for compiled in ("false", "true"):
        torch._dynamo.reset()
        counters.clear()
        start = time.perf_counter()
        root = Path(tmp) / compiled
        cfg = config.load(None, [*DELAYED, "--parallel.zero", str(zero), "--train.steps",
                                 str(steps), "--train.compile", compiled,
                                 "--checkpoint.dir", str(root / "ckpt"),
                                 "--log.dir", str(root / "log")])
        trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
        steps_out = []
        for _ in range(steps):
            rec = trainer.train_step()
            steps_out.append((rec["loss"], rec["grad_norm"], counters["stats"]["unique_graphs"],
                              sum(counters["graph_break"].values())))
        hist = {k: h.clone() for k, h in histories(trainer.model.chunks[0]).items()}
        trainer.close()
        reasons = {" ".join(r.split("\n", 2)[:2]).strip()[:160]: n
                   for r, n in counters["graph_break"].items()}
        out[compiled] = {"steps": steps_out, "histories": hist, "break_reasons": reasons,
                         "seconds": time.perf_counter() - start}
    torch._dynamo.reset()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    args = parser.parse_args()
    if args.steps < 2:
        print("fp8_delayed_compile_dp2: --steps must be at least 2 (step 1 has no history)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_ranks

    from fivefold.train.bench import git_revision, machine, repo_relative

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(ranks_run, 2, tmp, args.steps, args.zero, timeout=900)
    wall = time.perf_counter() - start
    record = {"bench": "fp8_delayed_compile_dp2", "steps": args.steps, "zero": args.zero,
              "emulate_precision_casts": True, "git_revision": git_revision(),
              "machine": machine(torch.device("cpu")), "torch": torch.__version__,
              "wall_seconds": round(wall, 1), "ranks": []}
    same_all = True
    for rank, run in enumerate(ranks):
        eager, compiled = run["false"], run["true"]
        same = ([s[:2] for s in eager["steps"]] == [s[:2] for s in compiled["steps"]]
                and eager["histories"].keys() == compiled["histories"].keys()
                and all(torch.equal(eager["histories"][k], compiled["histories"][k])
                        for k in eager["histories"]))
        same_all &= same
        print(f"rank {rank}: eager {eager['seconds']:.1f} s, compiled {compiled['seconds']:.1f} s")
        for i, (e, c) in enumerate(zip(eager["steps"], compiled["steps"]), 1):
            print(f"  step {i}: loss {e[0]:.9g} / {c[0]:.9g}, grad norm {e[1]:.9g} / "
                  f"{c[1]:.9g}; graphs {c[2]}, breaks {c[3]}")
        for reason, count in compiled["break_reasons"].items():
            print(f"  break: {count} x {reason}")
        print(f"  losses, gradient norms and {len(eager['histories'])} amax histories "
              f"bit-equal: {same}")
        record["ranks"].append({"eager": eager["steps"], "compiled": compiled["steps"],
                                "histories": len(eager["histories"]), "bit_equal": same,
                                "break_reasons": compiled["break_reasons"],
                                "seconds": [round(eager["seconds"], 1),
                                            round(compiled["seconds"], 1)]})
    record["bit_equal"] = same_all
    name = "fp8_delayed_compile_dp2" + (f"_zero{args.zero}" if args.zero else "")
    path = ROOT / "bench" / "results" / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wall {wall:.1f} s; wrote {repo_relative(path)}")
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
