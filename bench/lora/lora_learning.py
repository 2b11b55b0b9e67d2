"""Does LoRA / QLoRA learn, and how far from full fine-tuning after the same steps?

    python bench/lora/lora_learning.py [--pretrain-steps 150 --steps 60 --rank 8]

A tiny Llama (byte vocabulary, 4 layers of 128) is first trained in full on the first half
of the bundled corpus's training stream for `--pretrain-steps` (a stand-in for a downloaded
base: no model comes from the network here) and saved as a Hugging Face directory. From it,
three fine-tunings of `--steps` steps on the same corpus, same batches and learning-rate
schedule: full, LoRA (rank r on every linear of the blocks) and QLoRA (the same on an NF4
base). Prints the first and last losses and the validation loss of each, and writes
bench/results/lora_learning.json with the device, versions and git revision.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from fivefold import config  # noqa: E402
from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.train.bench import git_revision, machine, repo_relative  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402

SHAPE = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--model.hidden_size", "128",
         "--model.intermediate_size", "344", "--model.num_layers", "4", "--model.num_heads",
         "4", "--model.num_kv_heads", "4", "--train.seq_len", "128", "--train.gbs", "8",
         "--parallel.mbs", "8", "--train.precision", "fp32", "--train.device", "cpu",
         "--train.eval_every", "0", "--train.eval_batches", "4", "--checkpoint.every", "0",
         "--log.progress", "false", "--log.tensorboard", "false"]


def train(args: list[str], tmp: Path, name: str, steps: int) -> tuple[list[float], float, Trainer]:
    cfg = config.load(None, [*SHAPE, "--train.steps", str(steps), "--checkpoint.dir",
                             str(tmp / name / "ckpt"), "--log.dir", str(tmp / name), *args])
    trainer = Trainer(cfg, quiet=True)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    return losses, trainer.evaluate()["val_loss"], trainer


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" /
                                         "lora_learning.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        losses, val, trainer = train(["--train.lr", "3e-3", "--train.seed", "1"], tmp, "base",
                                     args.pretrain_steps)
        save_hf(trainer.model.chunks[0], trainer.model_cfg, tmp / "hf")
        trainer.close()
        out["pretrain"] = {"first": losses[0], "last": losses[-1], "val_loss": val}
        print(f"base: {args.pretrain_steps} steps of full training, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}, val {val:.4f}")
        # The fine-tunings see other batches than the base did (another data seed).
        common = ["--model.hf_path", str(tmp / "hf"), "--train.seed", "2",
                  "--train.warmup_steps", "0"]
        modes = {"full": ["--train.lr", "1e-3"],
                 "lora": ["--train.lr", "1e-2", "--lora.rank", str(args.rank),
                          "--lora.alpha", str(2 * args.rank), "--lora.targets", "all-linear"],
                 "qlora": ["--train.lr", "1e-2", "--lora.rank", str(args.rank),
                           "--lora.alpha", str(2 * args.rank), "--lora.targets", "all-linear",
                           "--lora.base", "nf4"]}
        for mode, extra in modes.items():
            losses, val, trainer = train([*common, *extra], tmp, mode, args.steps)
            trainer.close()
            out[mode] = {"first": losses[0], "last": losses[-1], "val_loss": val,
                         "losses": losses}
            print(f"{mode:>5}: loss {losses[0]:.4f} -> {losses[-1]:.4f} (mean of the last 10 "
                  f"{sum(losses[-10:]) / 10:.4f}), val {val:.4f}")
    for mode in ("lora", "qlora"):
        gap = out[mode]["val_loss"] - out["full"]["val_loss"]
        print(f"{mode}: val loss {gap:+.4f} from full fine-tuning after {args.steps} steps")
    record = {"machine": machine(torch.device("cpu")), "git_revision": git_revision(),
              "args": vars(args) | {"out": repo_relative(args.out)}, "results": out}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
