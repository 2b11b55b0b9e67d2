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
loaded rank; the crashed ones an ok run shows were not for memory (`crash_witnesses`); ZeRO-0
against ZeRO-1 in the same layout (`zero_twins`); and what rank 0 logged beyond the traced
bytes (`residuals`), by tp x pp cell too.
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
from fivefold.plan.placement import inflight_microbatches, stage

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
        inflight = inflight_microbatches(layout, work.num_microbatches(layout), 0)
        layers = stage(work.model, layout, 0)[0]
        runs.append({"row": row, "residual_gib": extra,
                     "per_token_hidden": extra * GIB / tokens_h,
                     "per_token_hidden_layer": extra * GIB / (tokens_h * layers * inflight),
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
    cells: dict = defaultdict(list)
    for r in runs:
        cells[f"{int(r['row']['tp']):02d}x{int(r['row']['pp']):02d}"].append(r)
    return {"by_tp_pp": {k: _cell(v) for k, v in sorted(cells.items())},
            "pp1_tp4plus_bytes_per_token_hidden": {
                k: {"runs": len(v), "median": statistics.median(v)} for k, v in head.items()},
            "tp8plus_pp4plus_share_of_activations": {
                k: {"runs": len(v), "min": min(v), "max": max(v)}
                for k, v in sorted(layouts.items()) if len(v) > 1}}


def _cell(runs: list[dict]) -> dict:
    """One tp x pp cell of `residuals`: the medians of the residual as a share of the planned
    activations, in bytes per token, hidden unit, layer and micro-batch in flight on rank 0
    (a tensor tp does not shard would read the same at every tp), and in GiB at one sequence
    per micro-batch (the most any term that does not grow with the micro-batch can be: NCCL's
    buffers per communicator, the CUDA context's growth with the ranks), and the GPU counts."""
    one = [r["residual_gib"] for r in runs if r["row"]["mbs"] == "1"]
    return {"runs": len(runs),
            "of_activations": statistics.median(r["of_activations"] for r in runs),
            "per_token_hidden_layer": statistics.median(r["per_token_hidden_layer"]
                                                        for r in runs),
            "mbs1_residual_gib": statistics.median(one) if one else None,
            "n_gpus": sorted({r["row"]["n_gpus"] for r in runs}, key=int)}


def crash_witnesses(rows: list[dict], preds: list[dict]) -> dict:
    """Crashed runs the planner calls fitting, and whether the file itself says the crash
    was not for memory. A witness is an ok run that needs at least as much memory on every
    rank: the same run logged ok (a duplicate row); a larger model (more and wider layers,
    the same vocabulary: every item of every rank larger) in the same layout, GPU count and
    ZeRO stage. And, for ZeRO-0, a ZeRO-1 twin (the same layout) that ran and logged so
    little that rank 0's planned difference (ZeRO-0 keeps the fp32 master and Adam moments
    whole, 12 bytes per parameter instead of 12/dp) and the CUDA context still fit in the
    GPU: rank 0 (the one logged) would fit, the other ranks are not witnessed. Summary by
    ZeRO stage and pp > 1."""
    def layout(r, *skip):
        return tuple(r[k] for k in ("n_gpus", "dp", "tp", "pp", "mbs", "zero", "model")
                     if k not in skip)
    ok = [(r, p) for r, p in zip(rows, preds) if r["status"] == "ok"]
    size = {"1B": 1, "3B": 3, "8B": 8, "80B": 80}
    _, assume = get_hardware("h100-sxm", HW)
    usable, context = HW["memory_gib"], assume.context_gib
    out = []
    for row, p in zip(rows, preds):
        if row["status"] == "ok" or not p["fits"]:
            continue
        why = []
        if any(layout(r) == layout(row) for r, _ in ok):
            why.append("the same run logged ok")
        for r, q in ok:
            if row["zero"] == "0" and r["zero"] == "1" and layout(r, "zero") == layout(
                    row, "zero"):
                need = float(r["gpu_memory_GB"]) + (p["rank0_reserved_gib"]
                                                    - q["rank0_reserved_gib"])
                if need + context <= usable:
                    why.append(f"ZeRO-1 twin logged {float(r['gpu_memory_GB']):.1f} GiB, "
                               f"+ {p['rank0_reserved_gib'] - q['rank0_reserved_gib']:.1f} "
                               "planned for ZeRO-0")
        bigger = [r for r, _ in ok if layout(r, "model") == layout(row, "model")
                  and size[r["model"]] > size[row["model"]]]
        if bigger:
            why.append(f"{bigger[0]['model']} ran in this layout, logged "
                       f"{float(bigger[0]['gpu_memory_GB']):.1f} GiB")
        out.append({"run": "{model}/{n_gpus} dp{dp} tp{tp} pp{pp} z{zero} mbs{mbs} "
                           "ga{grad_acc}".format(**row),
                    "planned_most_loaded_gib": p["most_loaded_total_gib"], "witness": why})
    groups: dict = defaultdict(lambda: [0, 0, 0])
    for m, row in zip(out, [r for r, p in zip(rows, preds)
                            if r["status"] != "ok" and p["fits"]]):
        g = groups[f"zero {row['zero']}, pp {'> 1' if row['pp'] != '1' else '1'}"]
        g[0] += 1
        g[1] += bool(m["witness"])
        g[2] += any(not w.startswith("ZeRO-1") for w in m["witness"])  # every rank's
    return {"runs": out, "by_group": {k: {"crashed_called_fitting": a, "with_witness": b,
                                          "every_rank_witnessed": c}
                                      for k, (a, b, c) in sorted(groups.items())}}


def zero_twins(rows: list[dict], preds: list[dict]) -> dict:
    """ZeRO-0 against ZeRO-1 in the same layout (model, GPU count, dp, tp, pp, micro-batch
    size), both ok: the logged difference on rank 0 in bytes per parameter the rank holds,
    against the planned difference (ZeRO-0 keeps the fp32 master and Adam moments whole,
    12·(1 − 1/dp) bytes per parameter more). Medians of planned − logged, by pp = 1 and
    pp > 1, and of ZeRO-1's signed error in the same pairs."""
    from fivefold.plan.model_states import rank_param_counts

    pairs: dict = defaultdict(dict)
    for row, p in zip(rows, preds):
        if row["status"] == "ok" and p["plannable"]:
            pairs[tuple(row[k] for k in ("model", "n_gpus", "dp", "tp", "pp", "mbs"))][
                row["zero"]] = (row, p)
    gaps: dict = defaultdict(list)
    for pair in pairs.values():
        if "0" in pair and "1" in pair:
            (r0, p0), (r1, p1) = pair["0"], pair["1"]
            work, layout = workload_layout(r1)
            n = rank_param_counts(work.model, layout, 0)["dense"]
            logged = (float(r0["gpu_memory_GB"]) - float(r1["gpu_memory_GB"])) * GIB / n
            planned = (p0["rank0_reserved_gib"] - p1["rank0_reserved_gib"]) * GIB / n
            gaps["pp 1" if r1["pp"] == "1" else "pp > 1"].append(planned - logged)
    return {k: {"pairs": len(v), "median_planned_minus_logged_bytes_per_param":
                statistics.median(v)} for k, v in sorted(gaps.items())}


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
    crashes = crash_witnesses(*sets["convention"])
    print("\ncrashed runs planned as fitting, and an ok run that needs as much memory:")
    for m in crashes["runs"]:
        print(f"  {m['run']:<40} planned {m['planned_most_loaded_gib']:5.1f} GiB  "
              + ("; ".join(m["witness"]) or "no witness"))
    witnessed = sum(any(not w.startswith("ZeRO-1") for w in m["witness"])
                    for m in crashes["runs"])
    right = len(rows) - len(misses)
    crashes["fits_right"] = {"all_runs": right / len(rows),
                             "without_every_rank_witnessed_crashes":
                                 right / (len(rows) - witnessed)}
    print(f"  fits-or-not right on {right} of {len(rows)} runs ({right / len(rows):.1%}); "
          f"on the {len(rows) - witnessed} runs left when the {witnessed} crashes every rank "
          f"of which is witnessed are set aside, {right / (len(rows) - witnessed):.1%}")
    for k, v in crashes["by_group"].items():
        print(f"  {k}: {v['crashed_called_fitting']} crashed runs called fitting, "
              f"{v['with_witness']} with a witness ({v['every_rank_witnessed']} for every "
              "rank: the same run or a larger model ran)")
    zeros = zero_twins(*sets["convention"])
    print("\nZeRO-0 against ZeRO-1 in the same layout, both ok (planned - logged difference, "
          "bytes per parameter on rank 0, median):")
    for k, v in zeros.items():
        print(f"  {k}: {v['pairs']} pairs, "
              f"{v['median_planned_minus_logged_bytes_per_param']:+.2f}")
    print("\nrank 0 beyond the traced bytes (memory factors at 0) by tp x pp: runs, median "
          "share of the planned activations, bytes per token, hidden unit, layer and "
          "micro-batch in flight, GiB at one sequence per micro-batch, GPU counts")
    for k, c in extra["by_tp_pp"].items():
        one = "-" if c["mbs1_residual_gib"] is None else f"{c['mbs1_residual_gib']:.1f}"
        print(f"  {k}  {c['runs']:3d}  {c['of_activations']:5.2f}  "
              f"{c['per_token_hidden_layer']:5.2f}  {one:>5}  {'/'.join(c['n_gpus'])}")
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
           "verdict_misses": misses, "same_work": same, "crash_witnesses": crashes,
           "zero_twins": zeros, "residuals": extra}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
