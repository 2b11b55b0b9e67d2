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
  says fit, the one it predicts fastest; a hit when that layout ran (ok) within 10% of the
  group's measured fastest tokens/s per GPU.
The nanotron convention's fitted factors (`plan/conventions.py`) are fitted on this file
only: `--fit` refits them on the 16-GPU runs and scores the 128-GPU runs, and the other way.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import platform
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy

from fivefold.models.presets import ModelConfig
from fivefold.plan.conventions import get_convention
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.hardware import GIB, get_hardware
from fivefold.plan.layout import Layout, Workload, check_layout
from fivefold.plan.memory import memory_items

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "bench" / "data" / "usp-calibration.csv"
OUT = ROOT / "bench" / "results" / "usp_calibration.json"
BEFORE = ROOT / "bench" / "results" / "usp_calibration_before.json"
PREVIOUS = ROOT / "bench" / "results" / "usp_calibration_af3718b.json"
DOC = ROOT / "docs" / "planner-validation.md"
MARK = ("<!-- usp-calibration: written by bench/plan/usp_calibration.py -->",
        "<!-- /usp-calibration -->")
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
    items, _ = memory_items(work, layout, assume, 0)
    return {"plannable": True, "fits": plan.fits,
            "rank0_reserved_gib": (sum(items.values()) - plan.context_bytes) / GIB,
            "most_loaded_total_gib": plan.memory_total / GIB,
            "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu}


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


def _pick(members: list, best: float, ok_only: bool) -> dict:
    """The layout the planner ranks fastest among the group's runs it says fit (or, with
    `ok_only`, among the runs that ran), and how it did. Runs of one layout are pooled:
    the layout's measured figure is its best ok run, 0 when none ran."""
    layouts: dict[tuple, dict] = {}
    for row, p in members:
        if not p["plannable"] or (ok_only and row["status"] != "ok") or (
                not ok_only and not p["fits"]):
            continue
        key = tuple(row[k] for k in ("dp", "tp", "pp", "mbs", "zero"))
        got = float(row["tokens_per_s_per_gpu"]) if row["status"] == "ok" else 0.0
        entry = layouts.setdefault(key, {"predicted": p["tokens_per_s_per_gpu"], "measured": 0.0})
        entry["measured"] = max(entry["measured"], got)
    if not layouts:
        return {"layout": None, "hit": False}
    key, entry = max(layouts.items(), key=lambda kv: kv[1]["predicted"])
    return {"layout": "dp{} tp{} pp{} mbs{} z{}".format(*key), "predicted": entry["predicted"],
            "measured": entry["measured"], "best_measured": best,
            "hit": entry["measured"] >= 0.9 * best}


def run(rows: list[dict], convention: str = "nanotron", hw_overrides: dict | None = None):
    return [predict(r, convention, hw_overrides) for r in rows]


MEMORY_FITTED = ("activation_reserve", "loss_reserve", "head_token_bytes")
TIME_FITTED = ("host_layer_ms", "pp_message_ms", "inter_node_rails")
FITTED = MEMORY_FITTED + TIME_FITTED + ("memory_headroom_gib",)
HOST_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0)  # ms per layer per micro-batch
MESSAGE_GRID = (0.0, 5.0, 10.0, 20.0, 40.0)  # ms per pipeline message
RAILS_GRID = (0.0, 0.25, 0.5, 1.0)  # share of a node's NICs a spanning group uses
HEADROOM_GRID = tuple(k / 2 for k in range(21))  # GiB, 0 to 10


def fit(rows: list[dict], convention: str = "nanotron") -> dict:
    """The convention's fitted factors, from `rows` alone.

    Memory: with the factors at 0, rank 0's planned reserved bytes R, saved activations A,
    loss buffers G and, where rank 0 holds the head, tokens × hidden size H; the factors
    are the (a, g, b) ≥ 0 of measured ≈ R + a·A + g·G + b·H with the smallest sum of
    absolute relative errors (each ok run weighted by 1/measured): the goal is a median
    error, and squares would let a few runs far off (a crashed neighbour's allocator,
    another job's memory) set the factors.
    Throughput: the host time per layer per micro-batch, the fixed time per pipeline
    message and the share of a node's NICs a group spanning nodes uses that make the median
    of |log(predicted/measured tokens/s)| smallest, on the grids HOST_GRID × MESSAGE_GRID ×
    RAILS_GRID.
    Headroom: with those, the GiB the most loaded rank must leave free that makes the
    fits-or-not verdict right on the most of `rows` (ok and crashed), on HEADROOM_GRID
    (the smallest of equals)."""
    zero = {k: 0.0 for k in FITTED}
    ok = [r for r in rows if r["status"] == "ok"]
    columns, target = [], []
    for row in ok:
        work, layout = workload_layout(row, convention)
        hw, assume = get_hardware("h100-sxm", zero)  # zero wins over the convention's
        if check_layout(work, layout):
            continue
        items, _ = memory_items(work, layout, assume, 0)
        measured = float(row["gpu_memory_GB"]) * GIB
        base = sum(items.values()) - assume.context_gib * GIB
        column = {"activation_reserve": items["activations"],
                  "loss_reserve": items["logits_loss"]}
        unit, _ = memory_items(work, layout, dataclasses.replace(assume, head_token_bytes=1.0),
                               0)  # the head's term at 1 byte per token per hidden unit
        column["head_token_bytes"] = unit["overhead"] - items["overhead"]
        columns.append([column[k] / measured for k in MEMORY_FITTED])
        target.append((measured - base) / measured)
    memory = dict(zip(MEMORY_FITTED, _nonnegative_lad(columns, target)))
    best = None
    for host in HOST_GRID:
        for message in MESSAGE_GRID:
            for rails in RAILS_GRID:
                logs = []
                for row in ok:
                    p = predict(row, convention, {**zero, "host_layer_ms": host,
                                                  "pp_message_ms": message,
                                                  "inter_node_rails": rails})
                    if p["plannable"]:
                        logs.append(abs(math.log(p["tokens_per_s_per_gpu"]
                                                 / float(row["tokens_per_s_per_gpu"]))))
                err = statistics.median(logs)
                if best is None or err < best[0]:
                    best = (err, host, message, rails)
    factors = {**memory, **dict(zip(TIME_FITTED, best[1:]))}
    preds = run(rows, convention, {**HW, **zero, **factors})
    free = [(HW["memory_gib"] - p["most_loaded_total_gib"] if p["plannable"] else None,
             r["status"] == "ok") for r, p in zip(rows, preds)]
    right = {h: sum((f is not None and f >= h) == ok for f, ok in free)
             for h in HEADROOM_GRID}
    top = max(right.values())
    return {**factors, "memory_headroom_gib": min(h for h, n in right.items() if n == top)}


def _nonnegative_lad(columns: list[list[float]], target: list[float],
                     rounds: int = 100) -> list[float]:
    """Least absolute deviations with every coefficient ≥ 0, by iteratively reweighted least
    squares (each run weighted by 1/|its residual|, floored at 1e-4; Schlossmacher 1973)."""
    a, y = numpy.array(columns), numpy.array(target)
    weights = numpy.ones(len(y))
    coef = numpy.zeros(a.shape[1])
    for _ in range(rounds):
        root = numpy.sqrt(weights)
        coef = numpy.array(_nonnegative_lstsq((a * root[:, None]).tolist(),
                                              (y * root).tolist()))
        weights = 1 / numpy.maximum(numpy.abs(y - a @ coef), 1e-4)
    return [float(c) for c in coef]


def _nonnegative_lstsq(columns: list[list[float]], target: list[float]) -> list[float]:
    """Least squares with every coefficient ≥ 0: a column whose coefficient comes out
    negative is dropped (set to 0) and the rest refitted."""
    keep = list(range(len(columns[0])))
    while True:
        a = numpy.array([[c[k] for k in keep] for c in columns])
        coef = numpy.linalg.lstsq(a, numpy.array(target), rcond=None)[0]
        if (coef >= 0).all():
            out = [0.0] * len(columns[0])
            for k, v in zip(keep, coef):
                out[k] = float(v)
            return out
        keep = [k for k, v in zip(keep, coef) if v >= 0]


def _row(label: str, s: dict) -> str:
    return (f"| {label} | {s['ok_runs_scored']} | {s['memory_median_abs_error']:.1%} | "
            f"{s['memory_within_10pct']:.0%} | {s['fits_right']:.1%} | "
            f"{s['pick_within_10pct']} of {s['groups']} "
            f"({s['pick_within_10pct_ok_runs_only']}) | "
            f"{s['throughput_median_abs_error']:.1%} | {s['throughput_within_20pct']:.0%} | "
            f"{s['tp_and_pp_median_ratio']:.2f} |")


GOALS = {"memory_median_abs_error": (0.08, "≤"), "memory_within_10pct": (0.60, "≥"),
         "fits_right": (0.93, "≥")}


def _goals(now: dict) -> str:
    """Which goals each held-out half meets (the pick's: ≥ 60% of the groups)."""
    parts = []
    for name, s in now["held_out"].items():
        met = [k for k, (bound, op) in GOALS.items()
               if (s[k] <= bound if op == "≤" else s[k] >= bound)]
        met += ["pick"] * (s["pick_within_10pct"] >= 0.6 * s["groups"])
        missed = [k for k in (*GOALS, "pick") if k not in met]
        parts.append(f"{name.replace('_', ' ')}: met {', '.join(met) or 'none'}; "
                     f"missed {', '.join(missed) or 'none'}")
    return "On the held-out halves, " + "; ".join(parts) + "."


def _pick_line(s: dict) -> str:
    """'1B/16 dp16 tp1 pp1 mbs2 z1 (38,840 of 38,840)' for each group of a score."""
    out = []
    for group, pick in s["picks"].items():
        p = pick["fits"]
        out.append(f"{group} {p['layout']} ({p['measured']:,.0f} of {p['best_measured']:,.0f}"
                   f"{', hit' if p['hit'] else ''})")
    return "; ".join(out)


def section(now: dict | None = None, before: dict | None = None,
            previous: dict | None = None) -> list[str]:
    """The calibration's part of docs/planner-validation.md, from the JSON results."""
    now = now or json.loads(OUT.read_text())
    before = before or json.loads(BEFORE.read_text())
    if previous is None and PREVIOUS.exists():
        previous = json.loads(PREVIOUS.read_text())
    b, n, f = before["scores"], now["scores"], now["fitted"]
    conv = ", ".join(f"`{k}` = {v:g}" for k, v in now["convention"].items())
    halves_rows = (("fit_16_judge_128", "factors fitted on 16 GPUs, judged on 128"),
                   ("fit_128_judge_16", "factors fitted on 128 GPUs, judged on 16"))
    lines = [
        MARK[0],
        "## nanotron on 16 and 128 H100s: the Ultra-Scale Playbook's runs",
        "",
        "Generated by `python bench/plan/usp_calibration.py` (about ten minutes on two busy cores; "
        "`bench/results/usp_calibration.json`). 1,130 runs of the Ultra-Scale Playbook "
        "(Llama-style 1B, 3B, 8B, 80B; every layout on 16 and on 128 H100s, ok or crashed; "
        "`bench/data/usp-calibration.csv`, facts in `bench/data/README.md`), planned with "
        "`--convention nanotron`. Memory: rank 0's planned peak reserved GiB against what "
        "nanotron logged (world rank 0's `torch.cuda.max_memory_reserved`, the first "
        "stage). Fits: the planner's verdict on its most loaded rank (reserved + CUDA "
        "context + the fitted headroom within the H100's 79.6 GiB; a layout the planner "
        "refuses counts as not fitting) against ok / crashed_or_oom. Pick: per "
        "(model, GPU count), the layout it predicts fastest among those it says fit is "
        "within 10% of the measured fastest (in brackets: choosing among the runs that "
        "ran). *Before*: the planner at git 4030e22 (`bench/results/"
        "usp_calibration_before.json`); the data's README scored that planner on its most "
        "loaded rank with the CUDA context added (row *as the data's README*). *At "
        "af3718b*: the convention before its pick was calibrated (`bench/results/"
        "usp_calibration_af3718b.json`).",
        "",
        "| planner, runs | ok runs | memory median error | memory within 10% | fits right "
        "| pick within 10% | tokens/s median error | tokens/s within 20% | tp>1 & pp>1 "
        "predicted/measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        _row("before, all runs", b["all"]),
        _row("before, all runs, as the data's README", b["as_data_readme"]),
        _row("before, 16 GPUs", b["16_gpus"]),
        _row("before, 128 GPUs", b["128_gpus"]),
    ]
    if previous:
        lines.append(_row("at af3718b, all runs", previous["scores"]["all"]))
        lines += [_row(f"at af3718b, {label}", previous["held_out"][name])
                  for name, label in halves_rows if name in previous["held_out"]]
    lines += [
        _row("now, all runs", n["all"]),
        _row("now, 16 GPUs", n["16_gpus"]),
        _row("now, 128 GPUs", n["128_gpus"]),
    ]
    lines += [_row(f"now, {label}", now["held_out"][name])
              for name, label in halves_rows if name in now["held_out"]]
    lines += [
        "",
        "Goals (issue 35, held-out runs): memory median ≤ 8%, ≥ 60% within 10%, fits ≥ 93%, "
        "pick within 10% in ≥ 60% of the groups. The file holds no run on another GPU "
        "count, so the held-out rows here are the other half of the file: every factor "
        "refitted on the 16-GPU runs alone and judged on the 128-GPU runs, and the other "
        "way (`fit` sees only the fitting half). " + _goals(now),
        "",
        "The picks now (all runs): " + _pick_line(n["all"]) + ". Held out: "
        + " | ".join(f"{label}: {_pick_line(now['held_out'][name])}"
                     for name, label in halves_rows if name in now["held_out"]) + ".",
        "",
        "What the nanotron convention plans, from nanotron's code (@2411b022):",
        "",
        "- stages cut as nanotron cuts them (`pp_split = cumulative`, `plan/split.py`): "
        "blocks go to a stage until their cumulative cost passes total·(k+1)/pp, so the "
        "first stage holds more layers than the balanced split gave it (1B, pp 2: 11 of 16) "
        "and pp may exceed the layers (the last stages then hold none);",
        "- the loss as `_ShardedCrossEntropy` runs it (`softmax_loss`): bf16 logits, their "
        "fp32 cast and the shifted copy turned into the saved softmax in place, "
        "(8 + 2)·T·V/tp bytes at the forward's end, where the planner had assumed "
        "fivefold's chunked loss (T·V never materialised);",
        "- ZeRO-1's fp32 gradient reduce-scatter after backward and the parameter "
        "all-gather after the step as blocking (`zero_sync_blocking`); ZeRO-0 keeps DDP's "
        "overlapped buckets;",
        "- logged memory = peak reserved (what the benchmark rows report);",
        "- layouts nanotron cannot run are refused: 1F1B with fewer than pp − 1 micro-batches "
        "(`OneForwardOneBackwardPipelineEngine` asserts it; all 93 such runs in the file "
        "crashed, 3 of them planned as fitting before), and a pipeline whose cut leaves a "
        "rank without any block (the cut moves on at most one rank per block, so after a "
        "costly head the fp32 cast and the loss take one rank each and later ranks get "
        "nothing: `cumulative_idle_ranks`; 28 of the file's 30 such runs crashed, 5 of 5 "
        "on 16 GPUs and 23 of 25 on 128, whatever their memory);",
        "- a collective whose group crosses nodes runs over the NICs of all the members "
        "each node holds (one NIC per GPU, NCCL's rail-aligned channels), as far as the "
        "fitted share `inter_node_rails` says, never above NVLink: before, a tp 16 or a "
        "dp 16 group across two nodes got one NIC per GPU, 400 GB/s of a node's NICs "
        "seen as 50.",
        "",
        f"Fitted on this file alone (`bench/plan/usp_calibration.py` `fit`), the convention's "
        f"values: {conv}. `activation_reserve` and `loss_reserve`: reserved bytes per byte "
        f"of saved activations and of loss buffers beyond the allocator model; "
        f"`head_token_bytes`: bytes per token per hidden unit on the head's rank, whatever "
        f"tp is (rank 0 of the pp 1 runs reads about 80 bytes per token and hidden unit "
        f"above the plan at every tp, not traced to a tensor); the three by least absolute "
        f"deviations (the goal is a median; least squares let a few runs set them: 20 "
        f"bytes from the 128-GPU runs, 92 from the 16-GPU ones, where both now agree near "
        f"80); `host_layer_ms`: host time per layer per micro-batch (eager PyTorch's "
        f"dispatch), a floor under the GPU's time; `pp_message_ms`: a fixed time per "
        f"pipeline send or receive; `inter_node_rails`: the share of a node's NICs a "
        f"group that crosses nodes uses beyond one per GPU; `memory_headroom_gib`: what the "
        f"most loaded rank must leave free beyond its planned reserved peak and context for "
        f"the verdict 'fits' (fitted to the ok / crashed verdicts of the fitting runs: "
        f"NCCL's lazily made communicators and buffers, the spread of fragmentation). "
        f"Refitted on each half: "
        + "; ".join(f"{g} GPUs " + ", ".join(f"{k} {v:.3g}" for k, v in f[g].items())
                    for g in ("16", "128") if g in f) + ".",
        "",
        "What the scores cannot say, and what is missed:",
        "",
        "- Throughput at 128 GPUs stays far off (median error above 40%), and pipelines are "
        "still predicted too fast (tp>1 & pp>1 column): many pipeline runs there take "
        "1.2-1.4 s per micro-batch whatever the model (1B, 3B or 8B, mbs 1 or 2, pp 4 to "
        "16: e.g. 3B dp4 tp4 pp8 mbs1, 1,174 ms; 8B dp4 tp4 pp8 mbs1, 1,208 ms), a fixed "
        "cost per micro-batch no bandwidth explains, and it strikes ZeRO-0 and ZeRO-1 "
        "runs of one layout unevenly (3B dp16 tp1 pp8 mbs1 on 128: 378 tokens/s per GPU "
        "with ZeRO-0, 9,504 with ZeRO-1). A model of it would have to be fitted per run.",
        "- The 3B and 8B misses on 16 GPUs of the earlier convention were layouts of that "
        "kind: dp 8 pp 2 mbs 1 (3B ZeRO-0: 3,230 tokens/s against 15,160 for ZeRO-1 in the "
        "same layout, its memory 59.6 GiB; 8B ZeRO-1: 2,681, planned at 76.6 of 79.6 GiB "
        "where rank 0 logged 64.8). Nothing in the physics planned here slows that "
        "ZeRO-0 run fivefold; the pick now avoids it because the rails make dp 16 ZeRO-1 "
        "(one group over both nodes) faster than a pipeline, and the 8B layout where the "
        "headroom says it does not fit: with the whole file's 4.5 GiB, and the 16-GPU "
        "half's 6, but not with the 128-GPU half's 1 GiB, so the pick fitted on 128 GPUs "
        "still misses 8B on 16 (2 of 3 groups).",
        "- 80B on 128 GPUs: the planner's fastest fitting layout (dp 4 tp 4 pp 8 mbs 1 "
        "ZeRO-1) crashed with its most loaded rank planned near 70 GiB; its neighbours "
        "that ran (dp 2 tp 8 pp 8, 228 tokens/s; dp 4 tp 8 pp 4, 250) are slow in the "
        "per-micro-batch way above, so even the runs that ran are far from the best "
        "(662, dp 8 tp 16 pp 1).",
        "- crashed_or_oom mixes memory with other failures: runs that crashed far below "
        "the memory limit (e.g. pp 16 of 1B with 16 layers) count against fits-or-not "
        "whatever the memory model says.",
        "- The head's stage is planned on the last pipeline rank; nanotron puts the head "
        "where the cut leaves it, and its fp32 cast and loss blocks may spill to later "
        "ranks (memory of those ranks matters only to the fits verdict).",
        "- The engine's own convention is unchanged: every new setting is the nanotron "
        "convention's (`plan/conventions.py`) or an assumption whose default leaves the "
        "plan as it was (`inter_node_rails` = 0, `memory_headroom_gib` = 0), and the "
        "planner-vs-engine agreement tests are untouched.",
        MARK[1],
    ]
    return lines


def write_doc(lines: list[str], doc: Path = DOC) -> None:
    """Replace the section between the markers (or append it) in the validation page."""
    text = doc.read_text()
    if MARK[0] in text:
        head, rest = text.split(MARK[0], 1)
        tail = rest.split(MARK[1], 1)[1]
        text = head + "\n".join(lines) + tail
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    doc.write_text(text)


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
    held_out, fitted = {}, {}
    if not args.no_fit:
        fitted["all"] = fit(rows)
        for train, test in (("16", "128"), ("128", "16")):
            fitted[train] = fit(split[train])
            held_out[f"fit_{train}_judge_{test}"] = score(
                split[test], run(split[test], hw_overrides={**HW, **fitted[train]}))
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
           "fitted": fitted}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    if not args.no_fit and args.data.resolve() == DATA.resolve() and args.out == OUT:
        write_doc(section(out))
    return out


if __name__ == "__main__":
    main()
