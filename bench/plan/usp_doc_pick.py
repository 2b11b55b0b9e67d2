"""The nanotron section's bullets on the pick under the validated range's uncertain regime
and on the time terms tried for the 16 → 128 cross-fit (docs/planner-validation.md), from
the JSON results of bench/plan/usp_calibration.py (now and at f9d3bbc, the run before the
regime) and bench/plan/usp_time_trials.py."""

from __future__ import annotations

import json

import usp_time_trials
from usp_calibration import OUT

BEFORE_REGIME = OUT.parent / "usp_calibration_f9d3bbc.json"
SCORES = (("all runs", "scores", "all"), ("fitted on 16, judged on 16", "in_sample", "16"),
          ("fitted on 128, judged on 128", "in_sample", "128"),
          ("fitted on 16, judged on 128", "held_out", "fit_16_judge_128"),
          ("fitted on 128, judged on 16", "held_out", "fit_128_judge_16"))


def written(now: dict) -> dict:
    """The results the bullets on earlier terms were written against: the snapshot at
    f9d3bbc where it exists (the same times as now; its picks ranked by time alone)."""
    return json.loads(BEFORE_REGIME.read_text()) if BEFORE_REGIME.exists() else now


def _picks(s: dict) -> str:
    return f"{s['pick_within_10pct']} of {s['groups']} ({s['pick_within_10pct_ok_runs_only']})"


def pick_lines(now: dict) -> list[str]:
    """The regime's bullet: what it is, why, and the picks before and after."""
    if not BEFORE_REGIME.exists():
        return []
    before = json.loads(BEFORE_REGIME.read_text())
    moved = "; ".join(f"{label} {_picks(before[part][key])} → {_picks(now[part][key])}"
                      for label, part, key in SCORES)
    changed = []
    for label, part, key in SCORES:
        for group, pick in now[part][key]["picks"].items():
            old = before[part][key]["picks"][group]["fits"]
            new = pick["fits"]
            if old["layout"] != new["layout"]:
                changed.append(f"{group} ({label}) {old['layout']} → {new['layout']} "
                               f"({old['measured']:,.0f} → {new['measured']:,.0f} of "
                               f"{new['best_measured']:,.0f} tokens/s)")
    return [
        "- The pick and `fivefold plan --search` rank alike (`plan/validated.py` "
        "`rank_key`): a layout in a regime the validation found uncertain ranks first only "
        "when it is predicted more than 5% (`CLOSE`) faster than the best one outside it, "
        "as a layout outside the validated range already did. nanotron's range names one "
        "regime (`DDP_PIPELINE`): ZeRO-0 with dp > 1 and pp > 1, the runs nanotron wraps in "
        "DDP under its blocking pipeline, a share of which stall 0.25-0.3 s per message "
        "for a cause that is not a function of the layout (below). Each half shows it "
        "alone (`python bench/plan/usp_pipeline_stall.py`, runs with TP in a node losing "
        "more than 0.15 s "
        "per message): 16 GPUs 3 of 10 DDP pipelines against 5 of 50 ZeRO-1 and 0 of 20 "
        "ZeRO-0 with dp 1; 128 GPUs 17 of 32 against 24 of 151 and 0 of 10. No factor is "
        "fitted and no predicted time moves (the tokens/s errors are unchanged); the "
        "other conventions and the engine's own name no regime (their published rows are "
        "planned as before, and `auto` ranks as before). Picks before (f9d3bbc, `bench/results/"
        "usp_calibration_f9d3bbc.json`) → now: " + moved + ". Changed: "
        + ("; ".join(changed) or "none") + ". Still missed: 1B on 128 GPUs (dp 128 mbs 2, "
        "6.6% faster planned than the measured best, dp 64 tp 2 mbs 4: 87.6% of it) and "
        "80B on 128 (a layout that crashed, a memory verdict).",
    ]


def trial_lines() -> list[str]:
    """The 16 → 128 candidates of this round, none kept."""
    t = usp_time_trials.results()
    nic, by_bytes, swap = t["nic"], t["bytes"], t["swap"]
    base = swap["fitted on 16"]
    moves = "; ".join(f"{k} {v['median']:.1%} ({v['within_20pct']:.0%} within 20%)"
                      for k, v in swap.items() if k != "fitted on 16")
    return [
        "- Tried for the 16 → 128 cross-fit and not kept (`python bench/plan/"
        "usp_time_trials.py`): a stage's pipeline message sharing its NICs with the TP "
        "group's traffic over 4 nodes (tp 32, pp > 1): the message is "
        + ", ".join(f"{v['message_mib']:.0f} MiB at {k} ({v['runs']} runs)"
                    for k, v in nic.items())
        + f", at most {max(v['at_nic_ms_max'] for v in nic.values()):.1f} ms at a NIC's "
        "full rate, and sharing can only stretch that transfer, where those runs lose "
        + " and ".join(f"{v['lost_per_message_ms']:.0f} ms" for v in nic.values())
        + " per message; NCCL's channels per communicator with the dp, tp and pp "
        "communicators alive on one NIC: a bandwidth share grows with the bytes, but the "
        "stalled pipeline runs lose "
        + " and ".join(f"{v['lost_per_message_ms']:.0f} ms per message with "
                       f"{v['message_mib'][0]:g}-{v['message_mib'][1]:g} MiB messages "
                       f"({v['runs']} runs)" for v in by_bytes.values())
        + ", flat in the bytes, so neither term is the stall and neither was added. Left "
        "out of the time fit (the regime above, whose stalls no layout term can follow; "
        "`--fit-without-ddp`, minutes), the DDP pipelines move no time factor on either "
        "half, so the 16 → 128 ratio stays as it is. Where the held-out error "
        f"comes from: the 16-GPU factors read {base['median']:.1%} on the 128-GPU runs; "
        "with one of them set to the 128-GPU half's value, " + moves + ": the pipeline's "
        "waits, per TP ring step under its blocking messages (`pp_blocking_latency_us`·"
        "√(2 ln N)) and per message (`pp_message_ms`), which the 16-GPU half fits higher, "
        "not a TP or NIC term; a law for them carrying from 16 to 128 GPUs is still "
        "missing (flat and N = tp·pp were tried, above).",
    ]
