"""The planner against 1,130 nanotron runs of the Ultra-Scale Playbook (`--convention nanotron`).

    python bench/plan/usp_calibration.py            # prints the scores, writes
                                               # bench/results/usp_calibration.json
    python bench/plan/usp_calibration.py --data PATH

The runs (bench/data/usp-calibration.csv, bench/data/README.md): Llama-style 1B, 3B, 8B and
80B models trained with nanotron on 16 and 128 H100s (every layout, ok or crashed). What is
scored, as the data's README says to:
- memory: ok runs, the planner's peak reserved GiB of pipeline rank 0 (what nanotron logged:
  world rank 0's torch.cuda.max_memory_reserved, the first stage, no CUDA context) against
  `gpu_memory_GB`: median absolute error and share within 10%;
- throughput: ok runs, predicted tokens/s per GPU against measured: median error, share within
  20%, and the median ratio on runs with tp > 1 and pp > 1;
- fits-or-not: every run; the planner's verdict on its most loaded rank (reserved + context
  within the H100's 80 GiB) against ok / crashed_or_oom; a layout the planner refuses counts
  as "does not fit";
- the pick, per (model, GPU count) group with an ok run: among the group's layouts the planner
  says fit, the one it ranks first as `fivefold plan --search` does (predicted time, raised
  by `validated.CLOSE` outside the convention's validated range or in a regime it found
  uncertain: `validated.rank_key`); a hit when that layout ran (ok) within 10% of the
  group's measured fastest tokens/s per GPU.
The nanotron convention's fitted factors (`plan/conventions.py`) are fitted on this file
only: `--fit` refits them on the 16-GPU runs and scores the 128-GPU runs, and the other way.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

from fivefold.models.presets import ModelConfig
from fivefold.plan.conventions import get_convention
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.hardware import GIB, get_hardware, usable_memory
from fivefold.plan.layout import Layout, Workload, check_layout
from fivefold.plan.memory import memory_items
from fivefold.plan.validated import rank_key, validated_range

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "bench" / "data" / "usp-calibration.csv"
OUT = ROOT / "bench" / "results" / "usp_calibration.json"
BEFORE = ROOT / "bench" / "results" / "usp_calibration_before.json"
PREVIOUS = ROOT / "bench" / "results" / "usp_calibration_0a1a755.json"
# The planner before the blocked TP waits became host time (the scores this round started from).
ROUND = ROOT / "bench" / "results" / "usp_calibration_9417dbc.json"
# The runs' H100 SXM 80GB: nvidia-smi reports 81,559 MiB (79.6 GiB), below the catalog's 80.
HW = {"memory_gib": 79.6}


def load(path: Path = DATA) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def workload_layout(row: dict, convention: str = "nanotron") -> tuple[Workload, Layout]:
    """A run's model, batch and layout, under `convention` (nanotron's: 1F1B, TP in
    REDUCE_SCATTER mode, i.e. sequence parallel, no recomputation, bf16)."""
    n = {k: int(row[k]) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
                                  "seq", "dp", "tp", "pp", "mbs", "gbs_samples", "zero")}
    model = ModelConfig(name=f"usp-{row['model']}", vocab_size=n["vocab"],
                        hidden_size=n["hidden"], intermediate_size=n["ffn"],
                        num_layers=n["layers"], num_heads=n["heads"],
                        num_kv_heads=n["kv_heads"], max_seq_len=n["seq"],
                        tie_embeddings=row["tied_embeddings"] == "True")
    conv = get_convention(convention)
    work = conv.apply_workload(Workload(model=model, seq_len=n["seq"], gbs=n["gbs_samples"]))
    layout = conv.apply_layout(Layout(dp=n["dp"], tp=n["tp"], pp=n["pp"], zero=n["zero"],
                                      mbs=n["mbs"], sp=n["tp"] > 1, schedule="1f1b"))
    return work, layout


def predict(row: dict, convention: str = "nanotron", hw_overrides: dict | None = None) -> dict:
    """What the planner says of one run: None fields where it refuses the layout."""
    work, layout = workload_layout(row, convention)
    hw, assume = get_hardware("h100-sxm", hw_overrides)
    conv = get_convention(convention)
    if hasattr(conv, "apply_assumptions"):  # absent before the calibration (its "before" run)
        assume = conv.apply_assumptions(assume, set(hw_overrides or ()))
    problems = check_layout(work, layout)
    if problems:
        return {"plannable": False, "why": problems[0], "fits": False}
    plan = plan_layout(work, layout, hw, assume)
    items, _ = memory_items(work, layout, assume, 0, limit=usable_memory(hw, assume))
    return {"plannable": True, "fits": plan.fits,
            "rank0_reserved_gib": (sum(items.values()) - plan.context_bytes) / GIB,
            "most_loaded_total_gib": plan.memory_total / GIB,
            "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu,
            "time_parts": plan.time.parts()}


def _median_abs(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors) if errors else float("nan")


def _share(errors: list[float], bound: float) -> float:
    return sum(abs(e) <= bound for e in errors) / len(errors) if errors else float("nan")


def score(rows: list[dict], preds: list[dict], memory_key: str = "rank0_reserved_gib") -> dict:
    """The scores above for `rows` (and the planner's `preds` of them)."""
    mem, tput, tp_pp = [], [], []
    right = 0
    groups: dict[tuple, list] = defaultdict(list)
    for row, p in zip(rows, preds):
        ok = row["status"] == "ok"
        right += p["fits"] == ok
        groups[(row["model"], int(row["n_gpus"]))].append((row, p))
        if not (ok and p["plannable"]):
            continue
        mem.append(p[memory_key] / float(row["gpu_memory_GB"]) - 1)
        ratio = p["tokens_per_s_per_gpu"] / float(row["tokens_per_s_per_gpu"])
        tput.append(ratio - 1)
        if int(row["tp"]) > 1 and int(row["pp"]) > 1:
            tp_pp.append(ratio)
    picks = {}
    for (model, gpus), members in sorted(groups.items()):
        measured = [float(r["tokens_per_s_per_gpu"]) for r, _ in members if r["status"] == "ok"]
        if not measured:
            continue
        picks[f"{model}/{gpus}"] = {"fits": _pick(members, max(measured), ok_only=False),
                                    "ok_runs": _pick(members, max(measured), ok_only=True)}
    return {
        "runs": len(rows), "ok_runs_scored": len(mem),
        "unplannable": sum(not p["plannable"] for p in preds),
        "memory_median_abs_error": _median_abs(mem), "memory_within_10pct": _share(mem, 0.10),
        "memory_median_signed_error": statistics.median(mem) if mem else float("nan"),
        "throughput_median_abs_error": _median_abs(tput),
        "throughput_within_20pct": _share(tput, 0.20),
        "tp_and_pp_median_ratio": statistics.median(tp_pp) if tp_pp else float("nan"),
        "fits_right": right / len(rows) if rows else float("nan"),
        "pick_within_10pct": sum(g["fits"]["hit"] for g in picks.values()),
        "pick_within_10pct_ok_runs_only": sum(g["ok_runs"]["hit"] for g in picks.values()),
        "groups": len(picks), "picks": picks,
    }


LAYOUT_KEYS = ("dp", "tp", "pp", "mbs", "zero")


def _pick(members: list, best: float, ok_only: bool) -> dict:
    """The layout the planner ranks first among the group's runs it says fit (or, with
    `ok_only`, among the runs that ran), and how it did. Runs of one layout are pooled:
    the layout's measured figure is its best ok run, 0 when none ran. Ranked as the
    search ranks (`validated.rank_key` with nanotron's validated range)."""
    rng = validated_range("nanotron")
    layouts: dict[tuple, dict] = {}
    for row, p in members:
        if not p["plannable"] or (ok_only and row["status"] != "ok") or (
                not ok_only and not p["fits"]):
            continue
        key = tuple(row[k] for k in LAYOUT_KEYS)
        got = float(row["tokens_per_s_per_gpu"]) if row["status"] == "ok" else 0.0
        entry = layouts.setdefault(key, {"predicted": p["tokens_per_s_per_gpu"], "measured": 0.0,
                                         "rank": p["tokens_per_s_per_gpu"] / rank_key(
                                             1.0, Layout(**dict(zip(LAYOUT_KEYS, map(int, key)))),
                                             rng)})
        entry["measured"] = max(entry["measured"], got)
    if not layouts:
        return {"layout": None, "hit": False}
    key, entry = max(layouts.items(), key=lambda kv: kv[1]["rank"])
    entry = {k: v for k, v in entry.items() if k != "rank"}
    return {"layout": "dp{} tp{} pp{} mbs{} z{}".format(*key), "predicted": entry["predicted"],
            "measured": entry["measured"], "best_measured": best,
            "hit": entry["measured"] >= 0.9 * best}


def run(rows: list[dict], convention: str = "nanotron", hw_overrides: dict | None = None):
    return [predict(r, convention, hw_overrides) for r in rows]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def halves(rows: list[dict]) -> dict[str, list[dict]]:
    return {g: [r for r in rows if r["n_gpus"] == g] for g in ("16", "128")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-fit", action="store_true", help="score the convention as it is, "
                    "without refitting its factors on each half")
    args = ap.parse_args(argv)
    rows = load(args.data)
    split = halves(rows)
    preds = run(rows, hw_overrides=HW)
    scores = {"all": score(rows, preds), "as_data_readme": score(rows, preds,
                                                                 "most_loaded_total_gib")}
    for g, sub in split.items():
        scores[f"{g}_gpus"] = score(sub, run(sub, hw_overrides=HW))
    held_out, fitted, in_sample = {}, {}, {}
    from usp_fit import fit  # it imports this module: after its names exist

    if not args.no_fit:
        fitted["all"] = fit(rows)
        for train, test in (("16", "128"), ("128", "16")):
            fitted[train] = fit(split[train])
            held_out[f"fit_{train}_judge_{test}"] = score(
                split[test], run(split[test], hw_overrides={**HW, **fitted[train]}))
        in_sample = {g: score(split[g], run(split[g], hw_overrides={**HW, **fitted[g]}))
                     for g in ("16", "128")}
    for name, s in {**scores, **held_out}.items():
        print(f"{name:<22} memory median {s['memory_median_abs_error']:.1%} within 10% "
              f"{s['memory_within_10pct']:.0%} | tokens/s median "
              f"{s['throughput_median_abs_error']:.1%} within 20% "
              f"{s['throughput_within_20pct']:.0%}, tp>1&pp>1 x"
              f"{s['tp_and_pp_median_ratio']:.2f} | fits {s['fits_right']:.1%} | pick "
              f"{s['pick_within_10pct']}/{s['groups']}")
    for name, f in fitted.items():
        print(f"fitted on {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in f.items()))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    data = args.data.resolve()
    out = {"machine": {"host": platform.node(), "cpu": _cpu_model(),
                       "python": platform.python_version()},
           "git": rev, "data": str(data.relative_to(ROOT)) if data.is_relative_to(ROOT)
           else data.name, "convention": getattr(get_convention("nanotron"), "assumptions", {}),
           "hardware_overrides": HW, "scores": scores, "held_out": held_out,
           "in_sample": in_sample,
           "fitted": fitted}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    if not args.no_fit and args.data.resolve() == DATA.resolve() and args.out == OUT:
        from usp_doc import section, write_doc  # it imports this module

        write_doc(section(out))
    return out


if __name__ == "__main__":
    main()
