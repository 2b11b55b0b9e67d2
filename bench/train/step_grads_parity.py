"""The optimizer step a piece at a time (parallel/step_grads.py) against the revision that
copied every gradient to fp32 at once: the same bits, through the Trainer, for every owner and
rule the step has.

    python3 bench/train/step_grads_parity.py                 # every case (about 10 CPU-minutes)
    python3 bench/train/step_grads_parity.py mwo_bf16_adamw z1_bf16_nvme

Each tree (`git archive`d `--baseline`, and this one) runs each case in its own process
(PYTHONPATH at its src/, the cases' ranks forked by tests/harness.py): 4 steps of the nano
model on the byte corpus, clipped hard (train.grad_clip = 0.05), with `NORM_PIECE` (the
norm's ranges) at 300 values in both trees and this tree's `STEP_CHUNK` at 2,000 values, so
that every piece but the smallest is a chunk of its own. It compares, per rank, the losses,
the gradient norms and every gathered state (parameter, fp32 master, the rule's states) with
`torch.equal`, prints BIT-IDENTICAL or the first difference per case, writes
bench/results/step_grads_parity.json and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from revisions import baseline_src

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "af3718b"  # the last revision that copied every gradient to fp32 at once
BASE = ["--model.preset", "nano", "--model.vocab_size", "256", "--data.tokenizer", "byte",
        "--train.device", "cpu", "--train.steps", "4", "--train.gbs", "4", "--train.seq_len",
        "32", "--train.lr", "3e-3", "--train.warmup_steps", "1", "--train.eval_every", "0",
        "--data.val_fraction", "0", "--parallel.mbs", "1", "--train.grad_clip", "0.05"]
MOE = ["--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "32", "--model.num_layers", "2"]
BF16, FP16, FP32 = (["--train.precision", p] for p in ("bf16", "fp16", "fp32"))


def _dp(zero: int, *more: str) -> list[str]:
    return ["--parallel.dp", "2", "--parallel.zero", str(zero), *more]


CASES = {  # name: (world size, overrides)
    "mwo_bf16_adamw": (1, BF16), "mwo_fp16_adamw": (1, FP16), "mwo_fp32_adamw": (1, FP32),
    **{f"mwo_bf16_{o}": (1, [*BF16, "--train.optimizer", o])
       for o in ("adamw8bit", "adamw4bit", "muon", "adafactor")},
    "dp_bf16_adamw": (2, [*BF16, *_dp(0)]), "z1_bf16_adamw": (2, [*BF16, *_dp(1)]),
    "z2_fp16_adamw": (2, [*FP16, *_dp(2)]), "z3_bf16_adamw": (2, [*BF16, *_dp(3)]),
    "z2_fp32_adamw": (2, [*FP32, *_dp(2)]),
    "z1_fp32_offload": (2, [*FP32, *_dp(1, "--parallel.offload", "cpu")]),
    "z2_bf16_offload": (2, [*BF16, *_dp(2, "--parallel.offload", "cpu")]),
    "z1_bf16_nvme": (2, [*BF16, *_dp(1, "--parallel.offload", "nvme",
                                     "--parallel.offload_dir", "OFFLOAD_DIR")]),
    "z2_bf16_muon": (2, [*BF16, *_dp(2, "--train.optimizer", "muon")]),
    "z1_bf16_adafactor": (2, [*BF16, *_dp(1, "--train.optimizer", "adafactor")]),
    "z3_bf16_adamw8bit": (2, [*BF16, *_dp(3, "--train.optimizer", "adamw8bit")]),
    "tp2_bf16_adafactor": (2, [*BF16, "--parallel.tp", "2", "--train.optimizer", "adafactor"]),
    "tp2_bf16_muon": (2, [*BF16, "--parallel.tp", "2", "--train.optimizer", "muon"]),
    "ep2_bf16_z0": (2, [*BF16, *_dp(0, "--parallel.ep", "2"), *MOE]),
    "ep2_bf16_z1": (2, [*BF16, *_dp(1, "--parallel.ep", "2"), *MOE]),
}


# ---- the worker: one case in one tree ------------------------------------------------------

def _rank(rank, world, overrides, tmp):
    from fivefold.config.load import load
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.trainer import Trainer

    overrides = [o.replace("OFFLOAD_DIR", os.path.join(tmp, "offload")) for o in overrides]
    cfg = load(None, [*overrides, "--checkpoint.dir", os.path.join(tmp, "ckpt"),
                      "--log.dir", os.path.join(tmp, "log")])
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    records = [trainer.train_step() for _ in range(cfg.train.steps)]
    states = trainer.optimizer.param_states()
    out = {"loss": [r["loss"] for r in records], "norm": [r["grad_norm"] for r in records],
           "states": {n: {k: v.detach().clone() for k, v in d.items()}
                      for n, d in states.items()}}
    if hasattr(trainer.optimizer, "close"):  # the offload files go with the run
        trainer.optimizer.close()
    return out


def worker(name: str, out_path: str) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_ranks

    import fivefold.parallel.update as update

    update.NORM_PIECE = 300
    try:
        import fivefold.parallel.step_grads as step_grads

        step_grads.STEP_CHUNK = 2000
    except ImportError:  # the baseline: every copy made at once
        pass
    world, overrides = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(run_ranks(_rank, world, [*BASE, *overrides], tmp), out_path)


# ---- the driver -----------------------------------------------------------------------------

def first_difference(a: list, b: list) -> str | None:
    import torch

    for rank, (x, y) in enumerate(zip(a, b)):
        if x["loss"] != y["loss"] or x["norm"] != y["norm"]:
            return f"rank {rank}: losses {x['loss']} / {y['loss']}, norms {x['norm']} / {y['norm']}"
        for name, states in x["states"].items():
            for key, value in states.items():
                other = y["states"][name][key]
                if value.dtype != other.dtype or not torch.equal(value, other):
                    return f"rank {rank}: {name} {key}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"default: all of {', '.join(CASES)}")
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    import torch

    from fivefold.train.bench import git_revision, machine, repo_relative

    names = args.cases or list(CASES)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": baseline_src(args.baseline, Path(tmp)), "this": ROOT / "src"}
        for name in names:
            runs = {}
            for tree, src in trees.items():
                out = Path(tmp) / f"{tree}-{name}.pt"
                subprocess.run([sys.executable, __file__, "--worker", name, str(out)],
                               env={**os.environ, "PYTHONPATH": str(src)}, check=True)
                runs[tree] = torch.load(out, weights_only=False)
            diff = first_difference(runs["baseline"], runs["this"])
            results[name] = diff or "BIT-IDENTICAL"
            print(f"{name}: {results[name]}", flush=True)
    record = {"bench": "step_grads_parity", "baseline": args.baseline,
              "git_revision": git_revision(), "machine": machine(torch.device("cpu")),
              "cases": results}
    path = ROOT / "bench" / "results" / "step_grads_parity.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {repo_relative(path)}")
    return 0 if all(v == "BIT-IDENTICAL" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
