"""Where the planner's memory model misses on the Ultra-Scale Playbook's runs.

    python bench/plan/usp_memory.py            # prints the tables, writes
                                               # bench/results/usp_memory.json
    python bench/plan/usp_memory.py --out PATH

Ok runs the planner plans (`--convention nanotron`), rank 0's planned peak reserved GiB
against what nanotron logged (bench/plan/usp_calibration.py says why rank 0), grouped by
each of n_gpus, model, tp, pp, tp and pp together (`tp_pp`, e.g. 08x04), ZeRO stage,
micro-batch size and micro-batches per step (1 or more): runs, median absolute error, median
signed error (predicted / measured - 1) and the share within 10%. Three factor sets: the
convention's (fitted on the whole file), and the ones `bench/plan/usp_calibration.py` fitted
on one half of the file, judged on the other (read from bench/results/usp_calibration.json,
so this runs in seconds). Then the runs the fits-or-not verdict gets wrong, ok runs planned
as not fitting and crashed runs planned as fitting, with the planned total of the most
loaded rank.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

from usp_calibration import HW, ROOT, _cpu_model, halves, load, run, workload_layout
from usp_calibration import OUT as CALIBRATION
from usp_fit import MEMORY_FITTED

from fivefold.plan.hardware import GIB, get_hardware
from fivefold.plan.layout import check_layout
from fivefold.plan.memory import memory_items

OUT = ROOT / "bench" / "results" / "usp_memory.json"
DIMENSIONS = ("n_gpus", "model", "tp", "pp", "tp_pp", "zero", "mbs", "microbatches")


def _key(row: dict, dim: str):
    if dim == "microbatches":
        return "1" if int(row["grad_acc"]) == 1 else ">1"
    if dim == "tp_pp":
        return f"{int(row['tp']):02d}x{int(row['pp']):02d}"
    return row[dim] if dim == "model" else int(row[dim])


def breakdown(rows: list[dict], preds: list[dict]) -> dict:
    """{dimension: {value: {runs, median_abs_error, median_signed_error, within_10pct}}}."""
    out: dict = {}
    for dim in DIMENSIONS:
        groups: dict = defaultdict(list)
        for row, p in zip(rows, preds):
            if row["status"] == "ok" and p["plannable"]:
                groups[_key(row, dim)].append(p["rank0_reserved_gib"]
                                              / float(row["gpu_memory_GB"]) - 1)
        out[dim] = {str(v): {"runs": len(e),
                             "median_abs_error": statistics.median(abs(x) for x in e),
                             "median_signed_error": statistics.median(e),
                             "within_10pct": sum(abs(x) <= 0.10 for x in e) / len(e)}
                    for v, e in sorted(groups.items(), key=lambda kv: (len(str(kv[0])),
                                                                       str(kv[0])))}
    return out


def verdict_misses(rows: list[dict], preds: list[dict]) -> list[dict]:
    """The runs whose fits-or-not verdict is wrong."""
    misses = []
    for row, p in zip(rows, preds):
        ok = row["status"] == "ok"
        if p["fits"] == ok:
            continue
        misses.append({"run": "{model}/{n_gpus} dp{dp} tp{tp} pp{pp} z{zero} mbs{mbs} "
                              "ga{grad_acc}".format(**row), "status": row["status"],
                       "measured_gib": float(row["gpu_memory_GB"]) if ok else None,
                       "planned_most_loaded_gib": p.get("most_loaded_total_gib"),
                       "planned_rank0_gib": p.get("rank0_reserved_gib"),
                       "refused": None if p["plannable"] else p["why"]})
    return misses


def twins(rows: list[dict]) -> dict:
    """The file's own spread: ok ZeRO-0 runs whose first stage holds the same work (model, tp,
    pp, micro-batch size and micro-batches in flight on pipeline rank 0 under 1F1B, min(pp,
    grad_acc)) on 16 and on 128 GPUs, where nothing rank 0 holds depends on dp. Their logged
    memory differs only by what no model of the work sees: the allocator's history, the number
    of micro-batches per step, the run itself. Spread of a group = largest / smallest - 1."""
    groups: dict[tuple, list] = defaultdict(list)
    for row in rows:
        if row["status"] == "ok" and row["zero"] == "0":
            pp, m = int(row["pp"]), int(row["grad_acc"])
            groups[(row["model"], row["tp"], row["pp"], row["mbs"], min(pp, m))].append(row)
    spreads = []
    for key, members in sorted(groups.items()):
        if len(members) > 1:
            logged = [float(r["gpu_memory_GB"]) for r in members]
            spreads.append({"work": "{} tp{} pp{} mbs{} in flight {}".format(*key),
                            "runs": [f"{r['n_gpus']} GPUs ga{r['grad_acc']}: "
                                     f"{float(r['gpu_memory_GB']):.1f}" for r in members],
                            "spread": max(logged) / min(logged) - 1})
    values = [t["spread"] for t in spreads]
    return {"groups": spreads, "median_spread": statistics.median(values) if values else None,
            "share_over_10pct": sum(v > 0.10 for v in values) / len(values) if values else None}


def residuals(rows: list[dict]) -> dict:
    """What rank 0 logged beyond what the planner traces: ok runs planned with the memory
    factors at 0 (`MEMORY_FITTED`), the residual in GiB, per token and hidden unit of one
    micro-batch, and as a share of the planned activations. Summaries: pp 1 at tp >= 4 (the
    head's rank) by micro-batches per step, and each layout with tp >= 8 and pp >= 4 across
    its micro-batch sizes."""
    zero = {**HW, **{k: 0.0 for k in MEMORY_FITTED}}
    runs = []
    for row in rows:
        work, layout = workload_layout(row)
        if row["status"] != "ok" or check_layout(work, layout):
            continue
        _, assume = get_hardware("h100-sxm", zero)
        items, _ = memory_items(work, layout, assume, 0)
        planned = (sum(items.values()) - assume.context_gib * GIB) / GIB
        extra = float(row["gpu_memory_GB"]) - planned
        tokens_h = layout.mbs * work.seq_len * work.model.hidden_size
        runs.append({"row": row, "residual_gib": extra,
                     "per_token_hidden": extra * GIB / tokens_h,
                     "of_activations": extra * GIB / items["activations"]})
    head: dict = defaultdict(list)
    for r in runs:
        row = r["row"]
        if row["pp"] == "1" and int(row["tp"]) >= 4:
            head["1" if row["grad_acc"] == "1" else ">1"].append(r["per_token_hidden"])
    layouts: dict = defaultdict(list)
    for r in runs:
        row = r["row"]
        if int(row["tp"]) >= 8 and int(row["pp"]) >= 4:
            layouts["{model} dp{dp} tp{tp} pp{pp} z{zero}".format(**row)].append(
                r["of_activations"])
    return {"pp1_tp4plus_bytes_per_token_hidden": {
                k: {"runs": len(v), "median": statistics.median(v)} for k, v in head.items()},
            "tp8plus_pp4plus_share_of_activations": {
                k: {"runs": len(v), "min": min(v), "max": max(v)}
                for k, v in sorted(layouts.items()) if len(v) > 1}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows = load()
    split = halves(rows)
    fitted = json.loads(CALIBRATION.read_text())["fitted"]
    sets = {"convention": (rows, run(rows, hw_overrides=HW))}
    for train, test in (("16", "128"), ("128", "16")):
        sets[f"fit_{train}_judge_{test}"] = (split[test], run(split[test], hw_overrides={
            **HW, **fitted[train]}))
    result = {name: breakdown(r, p) for name, (r, p) in sets.items()}
    misses = verdict_misses(*sets["convention"])
    same = twins(rows)
    extra = residuals(rows)
    for name, table in result.items():
        print(f"\n{name}: runs, median |error|, median signed error, within 10%")
        for dim, groups in table.items():
            print(f"  {dim:<12} " + "  ".join(
                f"{v}: {g['runs']} {g['median_abs_error']:.1%} "
                f"{g['median_signed_error']:+.1%} {g['within_10pct']:.0%}"
                for v, g in groups.items()))
    print(f"\nfits-or-not wrong on {len(misses)} of {len(rows)} runs (the convention's factors):")
    for m in misses:
        planned = ("refused: " + m["refused"][:60] if m["refused"] else
                   f"planned most loaded {m['planned_most_loaded_gib']:.1f} GiB, rank 0 "
                   f"{m['planned_rank0_gib']:.1f}")
        got = f"measured {m['measured_gib']:.1f}" if m["measured_gib"] is not None else ""
        print(f"  {m['run']:<40} {m['status']:<15} {got:<15} {planned}")
    print(f"\nruns with the same work on rank 0 (ZeRO-0): {len(same['groups'])} groups, "
          f"median spread {same['median_spread']:.1%}, {same['share_over_10pct']:.0%} over 10%")
    for t in same["groups"]:
        if t["spread"] > 0.10:
            print(f"  {t['work']:<36} {'; '.join(t['runs'])}  ({t['spread']:+.0%})")
    print("\nrank 0 beyond the traced bytes (memory factors at 0):")
    for k, v in extra["pp1_tp4plus_bytes_per_token_hidden"].items():
        print(f"  pp 1, tp >= 4, micro-batches per step {k}: {v['runs']} runs, median "
              f"{v['median']:.0f} bytes per token and hidden unit")
    for k, v in extra["tp8plus_pp4plus_share_of_activations"].items():
        print(f"  {k:<24} {v['runs']} micro-batch sizes: {v['min']:.2f} to {v['max']:.2f} of "
              f"the planned activations")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    out = {"machine": {"host": platform.node(), "cpu": _cpu_model(),
                       "python": platform.python_version()},
           "git": rev, "data": "bench/data/usp-calibration.csv",
           "fitted_from": str(CALIBRATION.relative_to(ROOT)), "breakdown": result,
           "verdict_misses": misses, "same_work": same,
           "residuals": extra}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
