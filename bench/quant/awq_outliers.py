"""AWQ against round-to-nearest on a model given salient channels (quant/outliers.py).

    python bench/quant/awq_outliers.py --checkpoint DIR [--scales 10 30 100] [--bits 4]
        [--sites none norms v_o up_down] [--duo | --no-duo] [--calib-samples N]
        [--held-out F] [--select layer|logits] [--rounding rtn|gptq]

The models trained here have only mild outlier channels, so AWQ closes 4-43% of RTN's gap
on them (bench/quant/awq_bits.py, docs/quantization.md). `inject_outliers` multiplies ~1% of each
norm's output channels by s and divides the input columns of the linears the norm feeds by
s: the float model is unchanged (its perplexity is reported, with the relative change), and
its linear inputs get the few large channels of a pretrained LLM, a synthetic stand-in for
one. `--sites` picks where (quant/outliers.py SITES): the norms' outputs (q/k/v and gate/up
inputs), v_proj's output rows (o_proj's inputs), up_proj's output rows (down_proj's inputs),
and "none", the model as trained. For each site and s, both arms are fake-quantised per
group of 128 input columns, asymmetric, b bits (`numerics.intx.fake_quantize_int4` with
levels = 2^b - 1), AWQ's scale and clip search (`quant.awq.apply_awq`, its defaults,
searching with the same b-bit grid; `--clip-mode range` to shrink both ends of the
asymmetric grid's range) applied first: they differ only in AWQ.
Calibration: 128 sequences of the run's training split at
its train.seq_len, as `fivefold quantize --method awq --checkpoint` takes them; evaluation:
the run's validation split. "closes" is (RTN - AWQ) / (RTN - fp32) perplexity.
"residual factor" is how much of the injection AWQ's scales leave on the injected
channels: the median over them of the producer's weight (a norm's, or a linear's row max
|w|) after AWQ / before injection, over the same median for the other channels (s means AWQ
left the injection alone, 1 that it undid it). "calib_error_vs_rtn" is AWQ's mean output
error over RTN's on its calibration tokens (AWQReport.error_ratio).

Anchor: the AWQ paper's Table 4 (arXiv 2306.00978), LLaMA-7B WikiText-2 INT4-g128: fp16
5.68, RTN 5.96, AWQ 5.78, AWQ closing 64% of RTN's gap. Results go to
bench/results/awq_outliers.json with the machine and git revision.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench" / "quant"))

from awq_bits import round_linears  # noqa: E402
from quant_quality import calibration, step_dir  # noqa: E402

from fivefold.evaluate.perplexity import checkpoint_validation, perplexity  # noqa: E402
from fivefold.host import cpu_model  # noqa: E402
from fivefold.quant.awq import (  # noqa: E402
    CLIP_MODES,
    ROUNDING,
    ROUNDINGS,
    SELECTS,
    apply_awq,
)
from fivefold.quant.cli import DEFAULT_CALIB_SAMPLES  # noqa: E402
from fivefold.quant.outliers import SITES, inject_outliers  # noqa: E402
from fivefold.train.bench import git_revision, machine  # noqa: E402
from fivefold.train.checkpoint import read_meta  # noqa: E402


@torch.no_grad()
def residual_factor(original, awq_model, channels: dict[str, list[int]]) -> float:
    """Median over producers of (median injected-channel ratio after AWQ / before the
    injection) over (the same median for the other channels); a producer's channel is a
    norm's weight or a linear's output row (its largest |w|)."""
    factors = []
    for name, chosen in channels.items():
        after, before = awq_model.get_submodule(name).weight, original.get_submodule(name).weight
        if after.dim() == 2:
            after, before = after.abs().amax(1), before.abs().amax(1)
        ratio = (after / before).abs()
        mask = torch.zeros_like(ratio, dtype=torch.bool)
        mask[chosen] = True
        factors.append(float(ratio[mask].median() / ratio[~mask].median()))
    return float(torch.tensor(factors).median())


def close_gap(model, calib, tokens, seq_len: int, base: float, bits: int,
              group_size: int, awq_options: dict) -> tuple[dict, torch.nn.Module]:
    """RTN and AWQ perplexity of `model` at `bits`, and the share of RTN's gap AWQ closes."""
    levels = 2 ** bits - 1
    rtn = copy.deepcopy(model)
    round_linears(rtn, levels, group_size)
    p_rtn = perplexity(rtn, tokens, seq_len).perplexity
    scaled = copy.deepcopy(model)
    report = apply_awq(scaled, calib, group_size, levels=levels, **awq_options)
    searched = copy.deepcopy(scaled)  # AWQ's float weights, before rounding
    round_linears(scaled, levels, group_size)
    p_awq = perplexity(scaled, tokens, seq_len).perplexity
    closes = (p_rtn - p_awq) / (p_rtn - base) if p_rtn != base else None
    return {"rtn": p_rtn, "awq": p_awq, "closes": closes,
            "calib_error_vs_rtn": report.error_ratio(),
            "held_out_error_vs_rtn": report.held_out_ratio(),
            "choices": {c: sum(g.choice == c for g in report.groups)
                        for c in ("rtn", "plain", "duo")}}, searched


def run(path: str, scales: list[float], bits: list[int], group_size: int, samples: int,
        fraction: float, seed: int, sites: list[str], awq_options: dict) -> dict:
    step = step_dir(path)
    meta = read_meta(step)
    trained_len = int(meta["config"]["train"]["seq_len"])
    model, calib = calibration(step, samples, trained_len)
    tokens, _, seq_len = checkpoint_validation(meta)
    plain = perplexity(model, tokens, seq_len).perplexity
    result = {"checkpoint": str(step), "fp32": plain, "validation_tokens": int(len(tokens)),
              "calibration": list(calib.shape), "group_size": group_size,
              "fraction": fraction, "seed": seed, "awq_options": awq_options,
              "sites": {}}
    print(f"fp32 {plain:.4f} (no injection)", flush=True)
    for site in sites:
        rows = {}
        for s in ([1.0] if site == "none" else scales):
            injected = copy.deepcopy(model)
            channels = {} if site == "none" else inject_outliers(injected, s, fraction, seed,
                                                                 site)
            base = perplexity(injected, tokens, seq_len).perplexity
            row = {"fp32": base, "fp32_relative_change": base / plain - 1,
                   "channels_per_producer": len(next(iter(channels.values()), [])),
                   "bits": {}}
            for b in bits:
                numbers, searched = close_gap(injected, calib, tokens, seq_len, base, b,
                                              group_size, awq_options)
                if channels:
                    numbers["residual_factor"] = residual_factor(model, searched, channels)
                row["bits"][str(b)] = numbers
                factor = numbers.get("residual_factor")
                print(f"{site} s={s:g} int{b} g{group_size}: fp32 {base:.4f} "
                      f"({row['fp32_relative_change']:+.1e})  RTN {numbers['rtn']:.4f} "
                      f"({(numbers['rtn'] / base - 1) * 100:+.2f}%)  AWQ "
                      f"{numbers['awq']:.4f} ({(numbers['awq'] / base - 1) * 100:+.2f}%)  "
                      f"closes {numbers['closes']:.0%}  calib error "
                      f"{numbers['calib_error_vs_rtn']:.3f}x RTN"
                      + (f"  residual factor {factor:.2f}" if factor is not None else ""),
                      flush=True)
            rows[f"{s:g}"] = row
        result["sites"][site] = rows
    return result


def combine(paths: list[str], out: str) -> None:
    """One record from runs of the same checkpoint at different scales."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    first = records[0]
    for record in records[1:]:
        if record["result"]["checkpoint"] != first["result"]["checkpoint"]:
            raise SystemExit(f"{paths} measure different checkpoints")
        for site, rows in record["result"]["sites"].items():
            first["result"]["sites"].setdefault(site, {}).update(rows)
    first["command"] = [r["command"] for r in records]
    first["machine"].setdefault("cpu_model", cpu_model())  # the runs' machine: this one
    Path(out).write_text(json.dumps(first, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a fivefold checkpoint (the default "
                    "model trained ~1000 steps)")
    ap.add_argument("--scales", type=float, nargs="+", default=[10, 30, 100])
    ap.add_argument("--bits", type=int, nargs="+", default=[4])
    ap.add_argument("--sites", nargs="+", choices=("none", *SITES),
                    default=["none", *SITES],
                    help="where to inject (none: the model as trained, once)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--calib-samples", type=int, default=DEFAULT_CALIB_SAMPLES)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duo", action=argparse.BooleanOptionalAction, default=None,
                    help="AWQ's duo scaling (default: apply_awq's)")
    ap.add_argument("--select", choices=SELECTS, default=None,
                    help="what the held-out choice measures (default: apply_awq's)")
    ap.add_argument("--no-clip", action="store_true", help="AWQ without the clip search")
    ap.add_argument("--held-out", type=float, default=None,
                    help="share of calibration sequences the scale is chosen on (default: "
                    "apply_awq's; 0: llm-awq's choice on the search tokens)")
    ap.add_argument("--clip-mode", choices=CLIP_MODES, default=None,
                    help="what AWQ's clip search shrinks (default absmax, llm-awq's "
                    "[-max|w|, max|w|]; range: the asymmetric grid's [min w, max w])")
    ap.add_argument("--rounding", choices=ROUNDINGS, default=None,
                    help=f"how AWQ's scaled weights are rounded (default {ROUNDING}, "
                    f"apply_awq's: error-compensating, quant/gptq.py; rtn: to nearest)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "awq_outliers.json"))
    ap.add_argument("--combine", nargs="+", metavar="JSON",
                    help="merge the scales of earlier runs (one process per scale) into --out")
    args = ap.parse_args()
    if args.combine:
        combine(args.combine, args.out)
        return
    if not args.checkpoint:
        ap.error("give --checkpoint DIR (or --combine JSON ...)")
    torch.set_num_threads(1)
    options = {"clip_mode": args.clip_mode, "clip": not args.no_clip}
    if args.duo is not None:
        options["duo"] = args.duo
    if args.held_out is not None:
        options["held_out"] = args.held_out
    if args.select is not None:
        options["select"] = args.select
    options["rounding"] = args.rounding or ROUNDING
    result = run(args.checkpoint, args.scales, args.bits, args.group_size,
                 args.calib_samples, args.fraction, args.seed, args.sites, options)
    record = {"benchmark": "awq_outliers", "result": result,
              "machine": {**machine(torch.device("cpu")), "cpu_model": cpu_model()},
              "git_revision": git_revision(),
              "command": "python bench/quant/awq_outliers.py " + " ".join(sys.argv[1:])}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
