"""The nanotron convention's fitted factors, from Ultra-Scale Playbook runs alone
(bench/plan/usp_calibration.py scores them; `fit` sees only the runs it is given)."""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy
from usp_calibration import HW, predict, run, workload_layout

from fivefold.plan.hardware import GIB, get_hardware
from fivefold.plan.layout import check_layout
from fivefold.plan.memory import memory_items

MEMORY_FITTED = ("activation_reserve", "loss_reserve", "head_token_bytes")
# The time factors nothing published gives for these runs, and their grids. Argued, not
# fitted: NCCL's latencies (its own tuning model's), the spine (a non-blocking fat tree:
# no run here spans more than the 32 nodes of a leaf group, so the file cannot say).
TIME_GRIDS = {
    "host_layer_ms": tuple(k / 2 for k in range(13)),  # host ms per layer, micro-batch
    "pp_message_ms": (0.0, 2.0, 5.0, 10.0, 20.0, 40.0),  # fixed ms per pipeline message
    "inter_node_rails": (0.0, 0.25, 0.5, 1.0),  # share of a node's NICs a spanning group uses
    "pp_blocking_latency_us": (0.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0,
                               120.0),  # µs per ring step, times √(2 ln N)
    "straggler_sigma": (0.0, 0.01, 0.02, 0.04, 0.08),  # relative spread of a rank's time
    "tp_inter_step_us": (0.0, 50.0, 100.0, 125.0, 150.0, 175.0, 200.0, 250.0, 300.0,
                         400.0, 500.0, 600.0),  # µs per
    # node-crossing step of a TP call beyond the network's hop
}
TIME_FITTED = tuple(TIME_GRIDS)
FITTED = MEMORY_FITTED + TIME_FITTED + ("memory_headroom_gib",)
CAP = math.log(2)  # a run off by more than 2x weighs no more than one off by 2x
HEADROOM_GRID = tuple(k / 2 for k in range(21))  # GiB, 0 to 10


def fit(rows: list[dict], convention: str = "nanotron") -> dict:
    """The convention's fitted factors, from `rows` alone.

    Memory: with the factors at 0, rank 0's planned reserved bytes R, saved activations A,
    loss buffers G and, where rank 0 holds the head, tokens × hidden size H; the factors
    are the (a, g, b) ≥ 0 of measured ≈ R + a·A + g·G + b·H with the smallest sum of
    absolute relative errors (each ok run weighted by 1/measured): the goal is a median
    error, and squares would let a few runs far off (a crashed neighbour's allocator,
    another job's memory) set the factors.
    Throughput: the factors of TIME_GRIDS (host time per layer per micro-batch, fixed time
    per pipeline message, share of a node's NICs a group spanning nodes uses, latency per
    ring step of a TP call under nanotron's blocking pipeline, spread of a rank's time)
    that make `time_error` smallest, by coordinate descent over their grids from the
    grids' first values.
    Headroom: with those, the GiB the most loaded rank must leave free that makes the
    fits-or-not verdict right on the most of `rows` (ok and crashed), on HEADROOM_GRID
    (the smallest of equals), each planned anew."""
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
    time = {k: grid[0] for k, grid in TIME_GRIDS.items()}
    best = time_error(ok, convention, {**zero, **time})
    for _ in range(4):  # coordinate descent: each factor in turn over its grid, until stable
        moved = False
        for k, grid in TIME_GRIDS.items():
            for v in grid:
                err = time_error(ok, convention, {**zero, **time, k: v})
                if err < best - 1e-12:
                    best, time, moved = err, {**time, k: v}, True
        if not moved:
            break
    factors = {**memory, **time}
    # Planned anew at each headroom: the cache a rank gives back near its limit
    # (allocator.released_cache) depends on where the limit lies.
    right = {}
    for h in HEADROOM_GRID:
        preds = run(rows, convention, {**HW, **zero, **factors, "memory_headroom_gib": h})
        right[h] = sum(p["fits"] == (r["status"] == "ok") for r, p in zip(rows, preds))
    top = max(right.values())
    return {**factors, "memory_headroom_gib": min(h for h, n in right.items() if n == top)}


def time_error(ok: list[dict], convention: str, overrides: dict) -> float:
    """Mean over the runs of |log(predicted / measured tokens/s)|, each capped at log 2:
    every run counts (a median would let the factors move freely while half the runs
    stay put), but a run slowed 20-fold by what no term models (the file's pipeline runs
    that take 1.2-1.4 s per micro-batch) does not drag every factor toward itself."""
    logs = []
    for row in ok:
        p = predict(row, convention, overrides)
        if p["plannable"]:
            logs.append(min(CAP, abs(math.log(p["tokens_per_s_per_gpu"]
                                              / float(row["tokens_per_s_per_gpu"])))))
    return statistics.fmean(logs)


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


