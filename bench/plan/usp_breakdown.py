"""The planner's tokens/s error on the Ultra-Scale Playbook's runs by GPU count, tp and pp,
and on the 128-GPU runs by model, dp, tp, pp, mbs, gradient accumulation, ZeRO stage and the
term that dominates the predicted step.

    python bench/plan/usp_breakdown.py            # writes bench/results/usp_breakdown.json
    python bench/plan/usp_breakdown.py --out PATH
    python bench/plan/usp_breakdown.py --fitted 16 --out bench/results/usp_breakdown_fit16.json
                                   # the factors fitted on the 16-GPU runs alone

Ok runs the planner plans (`--convention nanotron`, its factors as they stand), grouped by
each of n_gpus, tp and pp: runs, median predicted/measured, median absolute error and the
share within 20%. The term: the largest of the predicted step's compute, TP
communication, DP communication and pipeline (messages and bubble). It imports only
planner names older revisions have too, so a previous revision's planner can be scored
with it:

    git archive a5f9755 src | tar -x -C "$OLD"     # OLD: an empty scratch folder
    PYTHONPATH="$OLD/src" python bench/plan/usp_breakdown.py --rev a5f9755 \
        --out bench/results/usp_breakdown_a5f9755.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

from usp_calibration import HW, ROOT, _cpu_model, load, predict, run

from fivefold.plan.hardware import Assumptions

OUT = ROOT / "bench" / "results" / "usp_breakdown.json"
DIMENSIONS = ("n_gpus", "tp", "pp")
HALF = "128"  # the half whose error the goals of this round are about
HALF_DIMENSIONS = ("model", "dp", "tp", "pp", "mbs", "grad_acc", "zero", "term", "tp_pp",
                   "zero_pp")
# Beyond the file: 8B layouts at 128, 256 and 512 GPUs (mbs 1, 512 sequences per step).
SCALE_GPUS = (128, 256, 512)
SCALE_LAYOUTS = ((8, 1), (16, 1), (32, 1), (8, 4), (16, 2))  # (tp, pp)
SCALE_GBS = 512


def dominant_term(parts: dict) -> str:
    """The largest of compute, tp, dp and pp (messages + bubble) in a predicted step."""
    terms = {"compute": parts["compute"], "tp": parts["tp_comm"], "dp": parts["dp_comm"],
             "pp": parts["pp_comm"] + parts["bubble"]}
    return max(terms, key=terms.get)


def _value(row: dict, p: dict, dim: str):
    if dim == "term":
        return dominant_term(p["time_parts"])
    if dim == "tp_pp":
        return f"tp{row['tp']} pp{row['pp']}"
    if dim == "zero_pp":
        return f"zero{row['zero']} pp{row['pp']} dp{'>1' if int(row['dp']) > 1 else '1'}"
    return row[dim] if dim == "model" else int(row[dim])


def breakdown(rows: list[dict], preds: list[dict]) -> dict:
    """{dimension: {value: {runs, median_ratio, median_abs_error, within_20pct}}}: the
    DIMENSIONS over all runs, the HALF_DIMENSIONS over the 128-GPU runs ("tp, 128 GPUs")."""
    out: dict = {}
    dims = [(d, None) for d in DIMENSIONS] + [(d, HALF) for d in HALF_DIMENSIONS]
    for dim, half in dims:
        groups: dict = defaultdict(list)
        for row, p in zip(rows, preds):
            if row["status"] == "ok" and p["plannable"] and half in (None, row["n_gpus"]):
                groups[_value(row, p, dim)].append(p["tokens_per_s_per_gpu"]
                                                   / float(row["tokens_per_s_per_gpu"]))
        key = dim if half is None else f"{dim}, {half} GPUs"
        out[key] = {str(k): {"runs": len(v), "median_ratio": statistics.median(v),
                             "median_abs_error": statistics.median(abs(x - 1) for x in v),
                             "within_20pct": sum(abs(x - 1) <= 0.2 for x in v) / len(v)}
                    for k, v in sorted(groups.items())}
    return out


def layer_ms(rows: list[dict]) -> dict:
    """Measured ms per layer per micro-batch of the ok runs at pp 1 and micro-batches of one
    sequence, median by GPU count and tp: what a TP group's nodes cost when the step is
    host-bound ({"16": {"8": 4.6, ...}, ...})."""
    groups: dict = defaultdict(list)
    for r in rows:
        if r["status"] == "ok" and r["pp"] == "1" and r["mbs"] == "1":
            tokens = int(r["gbs_samples"]) * int(r["seq"]) / int(r["n_gpus"])
            step = tokens / float(r["tokens_per_s_per_gpu"])
            groups[(r["n_gpus"], r["tp"])].append(
                step / int(r["grad_acc"]) / int(r["layers"]) * 1e3)
    out: dict = defaultdict(dict)
    for (n, tp), v in sorted(groups.items(), key=lambda kv: (int(kv[0][0]), int(kv[0][1]))):
        out[n][tp] = statistics.median(v)
    return dict(out)


def scale_table(rows: list[dict], factors: dict | None = None) -> list[dict]:
    """Predicted tokens/s per GPU of the 8B model beyond the file's GPU counts (SCALE_GPUS,
    SCALE_LAYOUTS, ZeRO-1), with the convention's factors (`factors` overrides them)."""
    template = next(r for r in rows if r["model"] == "8B")
    out = []
    for tp, pp in SCALE_LAYOUTS:
        entry = {"layout": f"tp{tp} pp{pp}"}
        for n in SCALE_GPUS:
            dp = n // (tp * pp)
            row = {**template, "n_gpus": str(n), "dp": str(dp), "tp": str(tp), "pp": str(pp),
                   "mbs": "1", "zero": "1", "gbs_samples": str(SCALE_GBS),
                   "grad_acc": str(SCALE_GBS // dp)}
            p = predict(row, hw_overrides={**HW, **(factors or {})})
            entry[str(n)] = p["tokens_per_s_per_gpu"] if p["plannable"] else None
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rev", help="the revision the planner on PYTHONPATH is (default: git's "
                    "HEAD where it lies)")
    ap.add_argument("--fitted", choices=("all", "16", "128"), help="the factors "
                    "bench/plan/usp_calibration.py fitted on these runs instead of the "
                    "convention's (e.g. 16: the cross-fit's error on the 128-GPU runs)")
    args = ap.parse_args(argv)
    rows = load()
    factors = {}
    if args.fitted:
        factors = json.loads((ROOT / "bench" / "results" / "usp_calibration.json")
                             .read_text())["fitted"][args.fitted]
    table = breakdown(rows, run(rows, hw_overrides={**HW, **factors}))
    import fivefold

    src = Path(fivefold.__file__).resolve().parent.parent.parent
    rev = args.rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, cwd=src).stdout.strip()
    for dim, groups in table.items():
        for value, g in groups.items():
            print(f"{dim} {value:>4}: {g['runs']:>3} runs, predicted/measured "
                  f"{g['median_ratio']:.2f}, median error {g['median_abs_error']:.1%}, "
                  f"within 20% {g['within_20pct']:.0%}")
    layers = layer_ms(rows)
    print("ms per layer per micro-batch, pp 1, mbs 1 (measured, median): " + "; ".join(
        f"{n} GPUs " + ", ".join(f"tp {tp} {v:.1f}" for tp, v in g.items())
        for n, g in layers.items()))
    scale = {"now": scale_table(rows, factors)}
    if "tp_inter_step_us" in {f.name for f in dataclasses.fields(Assumptions)}:
        scale["tp_inter_step_us 0"] = scale_table(rows, {**factors, "tp_inter_step_us": 0.0})
    print(f"8B, ZeRO-1, mbs 1, {SCALE_GBS} sequences per step: predicted tokens/s per GPU "
          "at " + ", ".join(map(str, SCALE_GPUS)) + " GPUs")
    for name, entries in scale.items():
        for e in entries:
            print(f"  {name:<20} {e['layout']:<9} " + " ".join(
                f"{e[str(n)]:>7,.0f}" if e[str(n)] else "      –" for n in SCALE_GPUS))
    out = {"machine": {"host": platform.node(), "cpu": _cpu_model(),
                       "python": platform.python_version()}, "git": rev,
           "fitted": args.fitted or "convention", "by": table,
           "layer_ms_pp1_mbs1": layers, "scale_8b": scale}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
