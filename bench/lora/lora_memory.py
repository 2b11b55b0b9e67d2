"""Peak memory of full fine-tuning vs LoRA vs QLoRA, measured and planned, side by side.

    python bench/lora/lora_memory.py [--hidden 1024 --layers 24 --intermediate 2816 --heads 16
                                 --vocab 32000 --seq-len 64 --rank 16 --precision bf16]

A model where the weights dominate (by default a 341M-parameter Llama shape at 64 tokens
per step): one training step of each mode from the same random base (saved once as a
Hugging Face directory, as QLoRA quantises a pretrained base), on this machine's device.
Each step runs under the engine's peak tracker (parallel/peak.py: bytes of the distinct
storages the run holds, item by item, at the points a peak can occur); beside it, the
planner's itemised peak for the same config (plan/memory.py with plan/lora.py, without the
CUDA context and fragmentation allowance). Writes bench/results/lora_memory.json with the
device, versions and git revision.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from fivefold import config  # noqa: E402
from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.parallel.peak import PeakTracker  # noqa: E402
from fivefold.train.bench import git_revision, machine, repo_relative  # noqa: E402
from fivefold.train.loop import planned_peak_bytes  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402

MODES = {"full": [], "lora": ["--lora.rank", "{rank}"],
         "qlora": ["--lora.rank", "{rank}", "--lora.base", "nf4"]}
STATES = ("params", "grads", "master", "optimizer")


def shape_args(args) -> list[str]:
    return ["--model.hidden_size", str(args.hidden), "--model.num_layers", str(args.layers),
            "--model.intermediate_size", str(args.intermediate), "--model.num_heads",
            str(args.heads), "--model.num_kv_heads", str(args.heads), "--model.vocab_size",
            str(args.vocab), "--model.tie_embeddings", "true"]


def run_mode(mode: str, args, hf_dir: Path, tmp: Path) -> dict:
    extra = [a.format(rank=args.rank) for a in MODES[mode]]
    cfg = config.load(None, [
        "--model.hf_path", str(hf_dir), "--data.tokenizer", "byte",
        "--train.seq_len", str(args.seq_len), "--train.gbs", "1", "--parallel.mbs", "1",
        "--train.steps", "2", "--train.warmup_steps", "0", "--train.eval_every", "0",
        "--train.precision", args.precision, "--train.device", "auto",
        "--checkpoint.dir", str(tmp / mode / "ckpt"), "--checkpoint.every", "0",
        "--log.dir", str(tmp / mode / "log"), "--log.progress", "false",
        "--log.tensorboard", "false", *extra])
    with Trainer(cfg, quiet=True) as trainer:
        trainer.train_step()  # Adam's moments exist from here on, as in any later step
        start = time.perf_counter()
        with PeakTracker(trainer.peak_sources()) as tracker:
            trainer.train_step()
        seconds = time.perf_counter() - start
        planned = planned_peak_bytes(trainer)
        summary = getattr(trainer, "lora_summary", "full fine-tuning: every weight trains")
        base_bytes = base_params = 0
        for module in trainer.model.chunks[0].modules():
            base = getattr(module, "base_layer", None)
            if base is not None and hasattr(base, "quantized_bytes"):
                base_bytes += base.quantized_bytes()
                base_params += base.in_features * base.out_features
    out = {"measured_peak_bytes": tracker.peak, "measured_at": tracker.at,
           "measured_items": tracker.items_at_peak,
           "planned_peak_bytes": sum(planned.values()), "planned_items": planned,
           "step_seconds": seconds, "summary": summary}
    if base_params:
        out["quantised_base_bytes_per_param"] = base_bytes / base_params
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" /
                                         "lora_memory.json"))
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        shape = config.load(None, shape_args(args)).model.resolve()
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        base = build_model(shape, seed=0, dtype=dtype)
        save_hf(base, shape, tmp / "hf")
        num_params = shape.num_params()
        del base
        gc.collect()
        for mode in MODES:
            results[mode] = run_mode(mode, args, tmp / "hf", tmp)
            gc.collect()
    mib = 2**20
    print(f"{shape.num_params() / 1e6:.0f}M parameters, {args.precision}, seq_len "
          f"{args.seq_len}, rank {args.rank}; MiB at the peak, measured / planned")
    print(f"{'mode':<6} {'peak':>17}  " + "  ".join(f"{k:>17}" for k in STATES))
    for mode, r in results.items():
        items = "  ".join(f"{r['measured_items'].get(k, 0) / mib:>8.1f} / "
                          f"{r['planned_items'][k] / mib:<6.1f}" for k in STATES)
        print(f"{mode:<6} {r['measured_peak_bytes'] / mib:>8.1f} / "
              f"{r['planned_peak_bytes'] / mib:<6.1f}  {items}")
    full = results["full"]["measured_peak_bytes"]
    for mode in ("lora", "qlora"):
        r = results[mode]
        print(f"{mode}: {r['summary']}; peak {r['measured_peak_bytes'] / full:.3f}x full "
              f"fine-tuning" + (f"; NF4 base {r['quantised_base_bytes_per_param']:.4f} B/param"
                                if "quantised_base_bytes_per_param" in r else ""))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {"machine": machine(device), "git_revision": git_revision(),
              "shape": vars(args) | {"num_params": num_params, "out": repo_relative(args.out)},
              "modes": results}
    Path(args.out).write_text(json.dumps(record, indent=1, default=float) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
