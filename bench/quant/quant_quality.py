"""Quality and size of every quantisation method on trained checkpoints.

    python bench/quant/quant_quality.py --checkpoint NAME=DIR[,calib=512x128][,eval_tokens=N] ...
        [--calib-samples 512 --calib-seq-len 128] [--eval-tokens 0] [--awq-variants]
        [--merge] [--out FILE]

For each checkpoint: perplexity on its validation split (fivefold.evaluate.perplexity,
windows of the run's train.seq_len) of the float model in fp32 and bf16 and of the model
quantised by `fivefold quantize` with int8, int4 (RTN, group 128, zero point), AWQ (int4
g128 after the scale and clip search, calibrated on the run's training split), NF4 and
MXFP4; each quantised model is written by the command and read back by the loader that
generate/eval use, so the table measures the shipped path. Sizes are the bytes of the
state dict (fp32 and bf16) or of the quantised checkpoint's tensors, and of the linears
alone. Every row is also measured on AWQ's calibration tokens (training split), where the
search looked, and each AWQ group's activation spread (max over median of the per-channel
mean |x|) is recorded. `--awq-variants` adds `fivefold quantize --method awq` with the other
search options (AWQ_VARIANTS). Prints the table, the goals (int8 within 1% of fp32; AWQ no
worse than RTN and closing at least half of RTN's gap to fp32) and writes
bench/results/quant_quality.json with the machine, versions and git revision.

Anchor (AWQ paper, Lin et al. 2024, Table 4, INT4-g128 WikiText-2 perplexity): LLaMA-7B
fp16 5.68, RTN 5.96, AWQ 5.78 (AWQ closes 64% of RTN's gap); Llama-2-7B fp16 5.47,
RTN 5.73, AWQ 5.60 (50%).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from fivefold.evaluate.perplexity import checkpoint_validation, perplexity  # noqa: E402
from fivefold.quant.cli import main as quantize_main  # noqa: E402
from fivefold.quant.io import load_quantized, tensor_bytes  # noqa: E402
from fivefold.quant.linear import QuantLinear  # noqa: E402
from fivefold.train.bench import git_revision, machine, repo_relative  # noqa: E402
from fivefold.train.checkpoint import load_model_for_inference, read_meta  # noqa: E402

METHODS = ("int8", "int4", "awq", "nf4", "mxfp4")
ANCHORS = {"LLaMA-7B": {"fp16": 5.68, "int4_rtn": 5.96, "awq": 5.78},
           "Llama-2-7B": {"fp16": 5.47, "int4_rtn": 5.73, "awq": 5.60}}


def step_dir(path: str) -> Path:
    p = Path(path)
    return p / (p / "latest").read_text().strip() if (p / "latest").is_file() else p


def linear_bytes(model, element_size: int) -> int:
    """Bytes of the block linears (what quantize replaces), at element_size per weight."""
    return sum(m.weight.numel() * element_size for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"))


def evaluate(model, tokens, seq_len: int, calib: torch.Tensor) -> dict:
    """Validation perplexity, and the perplexity on AWQ's calibration tokens (training split):
    whether a gain is there in-sample, where AWQ's search looked, as well as out of it."""
    started = time.perf_counter()
    result = perplexity(model, tokens, seq_len)
    return {"perplexity": result.perplexity, "loss": result.loss, "tokens": result.tokens,
            "eval_s": time.perf_counter() - started,
            "calib_perplexity": perplexity(model, calib.reshape(-1), calib.shape[1]).perplexity}


def parse_checkpoint(item: str, args) -> tuple[str, str, int, int, int]:
    """NAME=DIR[,calib=SAMPLESxLEN][,eval_tokens=N] -> (name, dir, samples, len, tokens)."""
    name, _, rest = item.partition("=")
    path, *options = rest.split(",")
    samples, seq_len, tokens = args.calib_samples, args.calib_seq_len, args.eval_tokens
    for option in options:
        key, _, value = option.partition("=")
        if key == "calib":
            samples, seq_len = (int(v) for v in value.split("x"))
        elif key == "eval_tokens":
            tokens = int(value)
        else:
            raise SystemExit(f"unknown option {option!r} in --checkpoint {item}")
    return name, path, samples, seq_len, tokens


def bench_checkpoint(item: str, args, tmp: Path) -> tuple[str, dict]:
    name, path, calib_samples, calib_seq_len, eval_tokens = parse_checkpoint(item, args)
    step = step_dir(path)
    meta = read_meta(step, fix="--checkpoint")
    tokens, described, seq_len = checkpoint_validation(meta)
    described = described.replace(str(Path.home()), "~")  # no machine's home in the record
    if eval_tokens:
        tokens = tokens[:eval_tokens]
    calib = calibration(step, calib_samples, calib_seq_len)[1]
    model, model_cfg, _ = load_model_for_inference(str(step))
    parameters = sum(p.numel() for p in model.parameters())
    rows = {}
    fp32_bytes = tensor_bytes(model.state_dict().values())
    rows["fp32"] = {**evaluate(model, tokens, seq_len, calib), "model_bytes": fp32_bytes,
                    "linear_bytes": linear_bytes(model, 4)}
    print(f"[{name}] fp32: ppl {rows['fp32']['perplexity']:.4f}", flush=True)
    bf16 = model.to(torch.bfloat16)
    rows["bf16"] = {**evaluate(bf16, tokens, seq_len, calib), "model_bytes": fp32_bytes // 2,
                    "linear_bytes": linear_bytes(bf16, 2)}
    print(f"[{name}] bf16: ppl {rows['bf16']['perplexity']:.4f}", flush=True)
    del model, bf16
    for method in METHODS:
        out = tmp / f"{name}-{method}"
        argv = ["--checkpoint", str(step), "--method", method, "--out", str(out)]
        if method == "awq":
            argv += ["--calib-samples", str(calib_samples),
                     "--calib-seq-len", str(calib_seq_len)]
        started = time.perf_counter()
        if quantize_main(argv) != 0:
            raise SystemExit(f"fivefold quantize {' '.join(argv)} failed")
        quantize_s = time.perf_counter() - started
        qmodel, _, _ = load_quantized(out)
        manifest = json.loads((out / "quantized.json").read_text())
        rows[method] = {**evaluate(qmodel, tokens, seq_len, calib), "quantize_s": quantize_s,
                        "model_bytes": tensor_bytes(qmodel.state_dict().values()),
                        "linear_bytes": sum(m.quantized_bytes() for m in qmodel.modules()
                                            if isinstance(m, QuantLinear)),
                        **({"awq": manifest["awq"]} if "awq" in manifest else {})}
        print(f"[{name}] {method}: ppl {rows[method]['perplexity']:.4f} "
              f"({quantize_s:.1f} s to quantise)", flush=True)
    variants = awq_variants(step, calib_samples, calib_seq_len, tokens, calib, seq_len, args,
                            rows["fp32"]["perplexity"], rows["int4"]["perplexity"], name,
                            tmp)
    fp32, rtn, awq = (rows[k]["perplexity"] for k in ("fp32", "int4", "awq"))
    goals = {
        "int8_relative_change": rows["int8"]["perplexity"] / fp32 - 1,
        "int8_within_1pct": abs(rows["int8"]["perplexity"] / fp32 - 1) <= 0.01,
        "awq_no_worse_than_rtn": awq <= rtn,
        "awq_share_of_rtn_gap_closed": (rtn - awq) / (rtn - fp32) if rtn > fp32 else None,
    }
    goals["awq_closes_half_the_gap"] = (goals["awq_share_of_rtn_gap_closed"] or 0) >= 0.5
    fp32, rtn = rows["fp32"]["calib_perplexity"], rows["int4"]["calib_perplexity"]
    for row in [rows["awq"], *variants.values()]:
        row["share_of_rtn_gap_closed_on_calibration_tokens"] = (
            (rtn - row["calib_perplexity"]) / (rtn - fp32) if rtn > fp32 else None)
    goals["awq_share_of_rtn_gap_closed_on_calibration_tokens"] = (
        rows["awq"]["share_of_rtn_gap_closed_on_calibration_tokens"])
    train = (meta.get("config") or {}).get("train") or {}
    return name, {"checkpoint": str(step), "model": model_cfg.name, "parameters": parameters,
                  "train_steps": train.get("steps"),
                  "eval": {"data": described, "seq_len": seq_len,
                           "tokens": rows["fp32"]["tokens"]},
                  "calibration": {"samples": calib_samples, "seq_len": calib_seq_len},
                  "rows": rows, "goals": goals, "awq_variants": variants,
                  "activation_max_over_median": activation_spread(step, calib_samples,
                                                                  calib_seq_len)}


# Other AWQ settings, each `fivefold quantize --method awq` with the same calibration tokens
# (the run's training split) and one more option, written and read back as the main rows are:
# the error measured on the decoder layer's output instead of the attention/MLP/linear
# (llm-awq and AutoAWQ measure the module), and AutoAWQ's duo scaling
# s = mean|x|^α / mean|w|^(1-α) (awq.scale_for), each with and without the clip search;
# and the held-out choice (awq.apply_awq's held_out: each group's scale chosen among α = 0,
# llm-awq's and duo's best by the decoder layer's error on half the calibration sequences).
# All but the first round by the default, GPTQ; the first rounds to nearest, as llm-awq.
AWQ_VARIANTS = {"rounded to nearest (llm-awq's)": ["--awq-rounding", "rtn"],
                "module, no clip": ["--no-clip"],
                "layer loss": ["--awq-loss", "layer"],
                "layer loss, no clip": ["--awq-loss", "layer", "--no-clip"],
                "duo scaling": ["--duo"],
                "duo scaling, no clip": ["--duo", "--no-clip"],
                "held-out choice": ["--awq-held-out", "0.5"]}


def awq_variants(step: Path, samples: int, calib_len: int, tokens, calib, seq_len: int, args,
                 fp32: float, rtn: float, name: str, tmp: Path) -> dict:
    if not args.awq_variants:
        return {}
    out = {}
    for index, (label, flags) in enumerate(AWQ_VARIANTS.items()):
        directory = tmp / f"{name}-awq-variant-{index}"
        argv = ["--checkpoint", str(step), "--method", "awq", "--out", str(directory),
                "--calib-samples", str(samples), "--calib-seq-len", str(calib_len), *flags]
        started = time.perf_counter()
        if quantize_main(argv) != 0:
            raise SystemExit(f"fivefold quantize {' '.join(argv)} failed")
        quantize_s = time.perf_counter() - started
        model, _, _ = load_quantized(directory)
        manifest = json.loads((directory / "quantized.json").read_text())["awq"]
        row = {**evaluate(model, tokens, seq_len, calib), "quantize_s": quantize_s,
               "flags": flags,
               "options": {k: manifest.get(k)
                           for k in ("clip", "duo", "loss", "held_out", "select", "rounding")},
               "alphas": manifest["alphas"],
               "calib_error_vs_rtn": manifest["calib_error_vs_rtn"]}
        row["share_of_rtn_gap_closed"] = ((rtn - row["perplexity"]) / (rtn - fp32)
                                          if rtn > fp32 else None)
        out[label] = row
        share = row["share_of_rtn_gap_closed"]
        print(f"[{name}] awq ({label}): ppl {row['perplexity']:.4f}, closes "
              f"{'n/a' if share is None else f'{100 * share:.0f}%'} of RTN's gap "
              f"({quantize_s:.1f} s)", flush=True)
    return out


def calibration(step: Path, samples: int, calib_len: int) -> tuple[torch.nn.Module,
                                                                   torch.Tensor]:
    """The float model and the (samples, calib_len) tokens `fivefold quantize --method awq`
    calibrates it on (evenly spaced over the run's training split)."""
    from fivefold.quant.cli import build_parser, calibration_tokens, load_float

    qargs = build_parser().parse_args(["--checkpoint", str(step), "--method", "awq", "--out",
                                       "unused", "--calib-samples", str(samples),
                                       "--calib-seq-len", str(calib_len)])
    model, model_cfg, tokenizer, _, data = load_float(qargs)
    return model, calibration_tokens(qargs, model_cfg, tokenizer, data)


def activation_spread(step: Path, samples: int, calib_len: int) -> dict:
    """Per layer and AWQ group, max over median of the per-input-channel mean |x| on the
    calibration tokens: how salient the largest channels are, which is what AWQ's scales
    act on (the paper's premise: a few channels carry much larger activations)."""
    from fivefold.quant.awq import layer_groups, layer_inputs, record_inputs

    model, tokens = calibration(step, samples, calib_len)
    spread: dict[str, list[float]] = {}
    with torch.no_grad():
        hidden, cos, sin = layer_inputs(model, tokens)
        for layer in model.layers:
            firsts = [g.linears[0] for g in layer_groups(layer)]
            hidden, inputs = record_inputs(layer, firsts,
                                           lambda m=layer, h=hidden: m(h, cos, sin))
            for name in firsts:
                x_mean = inputs[name].abs().reshape(-1, inputs[name].shape[-1]).mean(0)
                spread.setdefault(name.split(".")[-1], []).append(
                    float(x_mean.max() / x_mean.median()))
    return spread


def print_table(name: str, result: dict) -> None:
    rows, fp32 = result["rows"], result["rows"]["fp32"]
    print(f"\n{name}: {result['model']}, {result['parameters'] / 1e6:.2f}M parameters, "
          f"{result['eval']['tokens']} validation tokens")
    print(f"{'format':<8} {'perplexity':>11} {'vs fp32':>8} {'model MiB':>10} "
          f"{'linears MiB':>12} {'bits/weight':>12}")
    params = fp32["linear_bytes"] / 4
    for key, row in rows.items():
        print(f"{key:<8} {row['perplexity']:>11.4f} "
              f"{100 * (row['perplexity'] / fp32['perplexity'] - 1):>+7.2f}% "
              f"{row['model_bytes'] / 2**20:>10.3f} {row['linear_bytes'] / 2**20:>12.3f} "
              f"{8 * row['linear_bytes'] / params:>12.2f}")
    g = result["goals"]
    share = g["awq_share_of_rtn_gap_closed"]
    print(f"goals: int8 {100 * g['int8_relative_change']:+.2f}% (within 1%: "
          f"{g['int8_within_1pct']}); AWQ <= RTN: {g['awq_no_worse_than_rtn']}; AWQ closes "
          f"{'n/a' if share is None else f'{100 * share:.0f}%'} of RTN's gap (>= 50%: "
          f"{g['awq_closes_half_the_gap']})")
    share = g.get("awq_share_of_rtn_gap_closed_on_calibration_tokens")
    print(f"on its calibration tokens (training split): fp32 "
          f"{rows['fp32']['calib_perplexity']:.4f}, int4 {rows['int4']['calib_perplexity']:.4f},"
          f" awq {rows['awq']['calib_perplexity']:.4f}: AWQ closes "
          f"{'n/a' if share is None else f'{100 * share:.0f}%'} of RTN's gap")
    spread = result.get("activation_max_over_median", {})
    if spread:
        print("activation max/median channel mean|x| per group (min..max over layers): " +
              ", ".join(f"{k} {min(v):.1f}..{max(v):.1f}" for k, v in spread.items()))
    for label, row in result.get("awq_variants", {}).items():
        share = row["share_of_rtn_gap_closed"]
        in_sample = row["share_of_rtn_gap_closed_on_calibration_tokens"]
        print(f"  awq ({label}): ppl {row['perplexity']:.4f}, closes "
              f"{'n/a' if share is None else f'{100 * share:.0f}%'} of RTN's gap "
              f"({'n/a' if in_sample is None else f'{100 * in_sample:.0f}%'} on its "
              f"calibration tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", required=True,
                        help="NAME=DIR: a fivefold checkpoint (a run's checkpoint.dir)")
    parser.add_argument("--calib-samples", type=int, default=512)
    parser.add_argument("--calib-seq-len", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=0, help="0: the whole split")
    parser.add_argument("--awq-variants", action="store_true",
                        help="also run the other AWQ settings (AWQ_VARIANTS) in memory")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other checkpoints' results already in --out (each "
                             "result records its own machine and git revision)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" /
                                             "quant_quality.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.checkpoint:
            name, result = bench_checkpoint(item, args, Path(tmp))
            results[name] = {**result, "machine": machine(torch.device("cpu")),
                             "git_revision": git_revision()}
    for name, result in results.items():
        print_table(name, result)
    out = Path(args.out)
    if args.merge and out.is_file():
        results = {**json.loads(out.read_text()).get("results", {}), **results}
    record = {"machine": machine(torch.device("cpu")), "git_revision": git_revision(),
              "args": vars(args) | {"out": repo_relative(args.out)},
              "anchors_awq_paper_table4_wikitext2_int4_g128": ANCHORS,
              "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
