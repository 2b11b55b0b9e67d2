"""Checks of candidate time terms for the Ultra-Scale Playbook's held-out miss (fitted on
the 16-GPU runs, judged on the 128-GPU runs), none of them kept (docs/planner-validation.md,
the nanotron section).

    python bench/plan/usp_time_trials.py        # prints them; seconds
    python bench/plan/usp_time_trials.py --fit-without-ddp    # and refits; minutes

- nic: a stage's pipeline message sharing the NICs with its TP group's traffic over 4
  nodes (tp 32, pp > 1). Per ok run: the message's bytes (`plan/comm.py` `collectives`, the
  pipeline's send) at a NIC's full rate, against what the run loses per message beyond
  the plan (bench/plan/usp_pipeline_stall.py `excess`). Sharing can at most stretch the
  message's own transfer; the runs lose three orders of magnitude more.
- bytes: whether what the stalled pipeline runs lose per message grows with the message,
  as a bandwidth share would (NCCL's channels per communicator when the dp, tp and pp
  communicators share a NIC): the stalled runs' loss per message by the message's bytes.
- swap: the factors fitted on the 16-GPU runs judged on the 128-GPU runs, with each time
  factor in turn set to the 128-GPU half's value (bench/results/usp_calibration.json
  `fitted`): which transfer costs the held-out error.
- fit without DDP pipelines (`--fit-without-ddp`): each half's factors refitted with the
  runs of the validated range's uncertain regime (ZeRO-0, dp > 1, pp > 1:
  `plan/validated.py` `DDP_PIPELINE`) left out of the time fit's error (`usp_fit.fit`).
"""

from __future__ import annotations

import argparse
import json
import statistics

import usp_fit
from usp_calibration import HW, OUT, halves, load, run, score, workload_layout
from usp_fit import TIME_FITTED
from usp_pipeline_stall import HELD, excess

from fivefold.plan.comm import collectives
from fivefold.plan.hardware import CATALOG
from fivefold.plan.layout import Layout
from fivefold.plan.validated import DDP_PIPELINE

E = "throughput_median_abs_error"
W = "throughput_within_20pct"


def _message_bytes(row: dict) -> float:
    """The bytes of one pipeline send of the run's busiest stage."""
    work, lay = workload_layout(row)
    send = next(c for c in collectives(work, lay, 1 if lay.pp > 2 else 0)
                if c.group == "pp" and c.op == "send")
    return send.elements * send.dtype_bytes


def _runs() -> list[dict]:
    """excess()'s runs with their message bytes."""
    rows = {tuple(r[k] for k in ("model", "n_gpus", "dp", "tp", "pp", "mbs", "zero")): r
            for r in load() if r["status"] == "ok"}
    out = []
    for e in excess():
        key = tuple(str(e[k]) for k in ("n_gpus", "dp", "tp", "pp", "mbs", "zero"))
        out.append({**e, "bytes": _message_bytes(rows[(e["model"], *key)])})
    return out


def nic(runs: list[dict]) -> dict:
    """tp 32 runs by pp: the message at a NIC's rate against the loss per message."""
    rate = CATALOG["h100-sxm"].inter_node_gbps * 1e9
    out = {}
    for pp in sorted({r["pp"] for r in runs if r["tp"] == 32}):
        sel = [r for r in runs if r["tp"] == 32 and r["pp"] == pp]
        out[f"tp32 pp{pp}"] = {
            "runs": len(sel), "message_mib": statistics.median(r["bytes"] for r in sel) / 2**20,
            "at_nic_ms_max": max(r["bytes"] for r in sel) / rate * 1e3,
            "lost_per_message_ms": statistics.median(r["per_message_s"] for r in sel) * 1e3}
    return out


def by_bytes(runs: list[dict]) -> dict:
    """The stalled runs (losing more than HELD per message), smaller and larger messages
    than their median: the median loss per message of each."""
    held = sorted((r for r in runs if r["per_message_s"] > HELD), key=lambda r: r["bytes"])
    half = len(held) // 2
    out = {}
    for name, sel in (("smaller", held[:half]), ("larger", held[half:])):
        out[name] = {"runs": len(sel),
                     "message_mib": (min(r["bytes"] for r in sel) / 2**20,
                                     max(r["bytes"] for r in sel) / 2**20),
                     "lost_per_message_ms": statistics.median(r["per_message_s"]
                                                              for r in sel) * 1e3}
    return out


def swap() -> dict:
    """Held-out 16 → 128 with the 16-GPU factors, and with each one set to the 128-GPU
    half's value."""
    fitted = json.loads(OUT.read_text())["fitted"]
    judged = halves(load())["128"]

    def s(f: dict) -> dict:
        got = score(judged, run(judged, hw_overrides={**HW, **f}))
        return {"median": got[E], "within_20pct": got[W]}

    out = {"fitted on 16": s(fitted["16"])}
    for k in TIME_FITTED:
        v = fitted["128"][k]
        if v != fitted["16"][k]:
            out[f"{k} {fitted['16'][k]:g} -> {v:g}"] = s({**fitted["16"], k: v})
    return out


def fit_without_ddp() -> dict:
    """Each half's factors with the DDP pipelines left out of the time fit's error."""
    error = usp_fit.time_error

    def without(ok: list[dict], convention: str, overrides: dict) -> float:
        return error([r for r in ok if not DDP_PIPELINE.applies(
            Layout(**{k: int(r[k]) for k in ("dp", "tp", "pp", "zero")}))], convention,
            overrides)

    usp_fit.time_error = without
    try:
        return {g: usp_fit.fit(rows) for g, rows in halves(load()).items()}
    finally:
        usp_fit.time_error = error


def results() -> dict:
    runs = _runs()
    return {"nic": nic(runs), "bytes": by_bytes(runs), "swap": swap()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit-without-ddp", action="store_true")
    args = ap.parse_args(argv)
    out = results()
    for k, v in out["nic"].items():
        print(f"{k}: {v['runs']} runs, message {v['message_mib']:.1f} MiB (median), at most "
              f"{v['at_nic_ms_max']:.2f} ms at a NIC's rate; lost per message "
              f"{v['lost_per_message_ms']:.0f} ms (median)")
    for k, v in out["bytes"].items():
        print(f"stalled runs, {k} messages ({v['message_mib'][0]:.1f}-"
              f"{v['message_mib'][1]:.1f} MiB): {v['runs']} runs, lost per message "
              f"{v['lost_per_message_ms']:.0f} ms (median)")
    for k, v in out["swap"].items():
        print(f"16 -> 128, {k}: tokens/s median error {v['median']:.2%}, within 20% "
              f"{v['within_20pct']:.1%}")
    if args.fit_without_ddp:
        fitted = json.loads(OUT.read_text())["fitted"]
        for g, f in fit_without_ddp().items():
            moved = {k: (fitted[g][k], v) for k, v in f.items() if k in TIME_FITTED
                     and v != fitted[g][k]}
            print(f"fitted on {g} without DDP pipelines: "
                  + ", ".join(f"{k} {v:.3g}" for k, v in f.items() if k in TIME_FITTED)
                  + f"; time factors moved: {moved or 'none'}")
    return out


if __name__ == "__main__":
    main()
