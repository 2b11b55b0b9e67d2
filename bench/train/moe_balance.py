"""Does balancing even out the experts? The tiny MoE on the bundled corpus, 200 steps each:

    none  no balancing at all (aux 0, z-loss 0, expert bias off)
    aux   the sequence-wise balance loss, coefficient 0.01 (and z-loss 0.001)
    bias  the aux-loss-free expert bias, rate 0.001 per step (DeepSeek-V3's γ), no aux loss

    python bench/train/moe_balance.py [--steps 200] [--gbs 4] [--plot docs/moe-balance.png]
    python bench/train/moe_balance.py --variants none --parts DIR   # one variant, saved in DIR
    python bench/train/moe_balance.py --parts DIR                   # combine the saved variants

Same seed, data and model otherwise (the `tiny-moe` preset, 8 experts, top-2, 4 layers;
`gbs` sequences of 128 tokens per step). Imbalance of a layer in a step is
max / mean tokens per expert over the global batch (1.0 = even); the script reports its
mean over layers, averaged over the last 50 steps, and the final losses, writes
bench/results/moe_balance.json and a plot of the curves.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from fivefold.host import cpu_label

VARIANTS = {
    "none": ["--model.aux_loss_coeff", "0", "--model.z_loss_coeff", "0"],
    "aux": ["--model.aux_loss_coeff", "0.01", "--model.z_loss_coeff", "0.001"],
    "bias": ["--model.aux_loss_coeff", "0", "--model.z_loss_coeff", "0",
             "--model.expert_bias_rate", "0.001"],
}


def run(variant: str, steps: int, gbs: int) -> list[dict]:
    from fivefold import config
    from fivefold.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="moe-balance-"))
    cfg = config.load(None, [
        "--model.preset", "tiny-moe", "--train.steps", str(steps), "--train.device", "cpu",
        "--train.precision", "fp32", "--train.eval_every", "0", "--checkpoint.every", "0",
        "--checkpoint.dir", str(tmp / "ck"), "--log.dir", str(tmp / "log"),
        "--train.gbs", str(gbs),
        *VARIANTS[variant]])
    trainer = Trainer(cfg, quiet=True)
    out = []
    for _ in range(steps):
        rec = trainer.train_step()
        layers = rec["moe_max_over_mean"]
        out.append({"step": rec["step"], "loss": rec["loss"], "imbalance": layers,
                    "mean_imbalance": sum(layers) / len(layers)})
    return out


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, recs in curves.items():
        ax.plot([r["step"] for r in recs], [r["mean_imbalance"] for r in recs], label=name)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert (mean over layers)")
    ax.set_title("tiny-moe (8 experts, top-2) on the bundled corpus")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--gbs", type=int, default=4)
    p.add_argument("--plot", default="docs/moe-balance.png")
    p.add_argument("--variants", nargs="*", default=None, choices=list(VARIANTS))
    p.add_argument("--parts", default="", help="a directory for one variant's curve each")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.variants:  # run these and save their curves, for a later combining call
        for name in args.variants:
            recs = run(name, args.steps, args.gbs)
            Path(args.parts).mkdir(parents=True, exist_ok=True)
            (Path(args.parts) / f"{name}.json").write_text(json.dumps(recs))
        return
    if args.parts:
        curves = {n: json.loads((Path(args.parts) / f"{n}.json").read_text()) for n in VARIANTS}
        args.steps = len(curves["none"])
    else:
        curves = {name: run(name, args.steps, args.gbs) for name in VARIANTS}
    tail = min(50, args.steps)
    summary = {}
    for name, recs in curves.items():
        last = recs[-tail:]
        summary[name] = {
            "imbalance_last50": sum(r["mean_imbalance"] for r in last) / len(last),
            "worst_layer_last50": sum(max(r["imbalance"]) for r in last) / len(last),
            "loss_last50": sum(r["loss"] for r in last) / len(last),
        }
        print(f"{name:>5}: max/mean tokens per expert {summary[name]['imbalance_last50']:.3f} "
              f"(worst layer {summary[name]['worst_layer_last50']:.3f}), "
              f"loss {summary[name]['loss_last50']:.4f}  [means over the last {tail} steps]")
    for name in ("aux", "bias"):
        print(f"{name} / none imbalance: "
              f"{summary[name]['imbalance_last50'] / summary['none']['imbalance_last50']:.3f}")
    plot(curves, Path(args.plot))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    result = {"machine": f"{cpu_label()} (shared)",
              "torch": torch.__version__, "git": rev, "steps": args.steps, "gbs": args.gbs,
              "seq_len": 128,
              "summary": summary, "curves": curves}
    out = Path("bench/results/moe_balance.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} and {args.plot}")


if __name__ == "__main__":
    main()
