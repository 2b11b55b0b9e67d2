"""Does FP8 train as well as bf16? The default job's model, same seed and data, per recipe:

    bf16        train.precision = bf16 (the peer run)
    blockwise   fp8, DeepSeek-V3's 1x128 tiles and 128x128 weight blocks, E4M3 gradients
    rowwise     fp8, torchao's rowwise recipe (power-of-two scales, E4M3 gradients)
    tensorwise  fp8, torchao's tensorwise recipe (E5M2 gradients)
    tensorwise_delayed  tensorwise with delayed scaling (an amax history of 16 steps)
    rowwise_gw_hp       torchao's ROWWISE_WITH_GW_HP (the weight gradient in bf16)

    python bench/fp8/fp8_convergence.py [--steps 300]
    python bench/fp8/fp8_convergence.py --variants blockwise --parts DIR   # one run, saved in DIR
    python bench/fp8/fp8_convergence.py --parts DIR                        # combine saved runs

Each run trains the `tiny-bpe` preset (the default job: 1.05M parameters, 16 sequences of
128 tokens per step, the bundled corpus) for `steps` steps on CPU and evaluates the
validation loss at the end (train.eval_batches batches of the held-out split). The script
prints each recipe's final validation loss and its relative difference to bf16 (the issue's
goals: blockwise within 1%, tensorwise within 1.5%; DeepSeek-V3 reports < 0.25%) and writes
bench/results/fp8_convergence.json with the machine, versions and git revision.
On CPU the FP8 GEMMs are emulated: this measures numerics, not speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fivefold.host import cpu_label

VARIANTS = {
    "bf16": ["--train.precision", "bf16"],
    "blockwise": ["--train.precision", "fp8", "--train.fp8_recipe", "blockwise"],
    "rowwise": ["--train.precision", "fp8", "--train.fp8_recipe", "rowwise"],
    "tensorwise": ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise"],
    "tensorwise_delayed": ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
                           "--train.fp8_scaling", "delayed"],
    "rowwise_gw_hp": ["--train.precision", "fp8", "--train.fp8_recipe", "rowwise_gw_hp"],
}


def run(variant: str, steps: int) -> dict:
    from fivefold import config
    from fivefold.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="fp8-convergence-"))
    cfg = config.load(None, [
        "--train.steps", str(steps), "--train.device", "cpu", "--train.eval_every", "0",
        "--checkpoint.every", "0", "--checkpoint.dir", str(tmp / "ck"),
        "--log.dir", str(tmp / "log"), *VARIANTS[variant]])
    trainer = Trainer(cfg, quiet=True)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        losses.append(trainer.train_step()["loss"])
    seconds = time.perf_counter() - start
    val = trainer.evaluate()["val_loss"]
    trainer.close()
    return {"val_loss": val, "final_train_loss": losses[-1], "seconds": seconds,
            "git": git_revision(), "losses": losses}


def git_revision() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", nargs="*", default=None, choices=list(VARIANTS))
    p.add_argument("--parts", default="", help="a directory for one run's result each")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.variants:  # run these and save them, for a later combining call
        for name in args.variants:
            res = run(name, args.steps)
            Path(args.parts).mkdir(parents=True, exist_ok=True)
            (Path(args.parts) / f"{name}.json").write_text(json.dumps(res))
            print(f"{name}: val_loss {res['val_loss']:.4f} ({res['seconds']:.0f} s)")
        return
    if args.parts:
        runs = {n: json.loads((Path(args.parts) / f"{n}.json").read_text()) for n in VARIANTS
                if (Path(args.parts) / f"{n}.json").exists()}
    else:
        runs = {name: run(name, args.steps) for name in VARIANTS}
    steps = len(runs["bf16"]["losses"])
    base = runs["bf16"]["val_loss"]
    summary = {}
    for name, res in runs.items():
        rel = (res["val_loss"] - base) / base
        summary[name] = {"val_loss": res["val_loss"], "rel_vs_bf16": rel,
                         "final_train_loss": res["final_train_loss"],
                         "seconds": res["seconds"], "git": res.get("git", "")}
        print(f"{name:>18}: final val_loss {res['val_loss']:.4f}  vs bf16 {rel * 100:+.2f}%  "
              f"(train loss {res['final_train_loss']:.4f}, {res['seconds']:.0f} s)")
    rev = git_revision()
    result = {"machine": f"{cpu_label()} (shared), "
                         f"1 thread per run", "device": "cpu",
              "torch": torch.__version__, "git": rev, "model": "tiny-bpe", "steps": steps,
              "gbs": 16, "seq_len": 128, "summary": summary,
              "note": "seconds: wall clock of runs sharing the cores with other work; "
                      "a record of the run, not a speed measurement",
              "losses": {n: r["losses"] for n, r in runs.items()}}
    out = Path("bench/results/fp8_convergence.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
