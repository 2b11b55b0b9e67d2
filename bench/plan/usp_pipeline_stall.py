"""What the Ultra-Scale Playbook's pipeline runs under DDP take beyond the plan, per
micro-batch and per pipeline message (docs/planner-validation.md, the nanotron section).

    python bench/plan/usp_pipeline_stall.py     # prints it; seconds

nanotron wraps the model in DDP only for ZeRO-0 with dp > 1 (trainer.py `_init_model`:
`make_ddp = dp > 1 and not (accumulate_grad_in_fp32 and zero_stage > 0)`); its pipeline
passes one blocking message at a time (pipeline_parallel/state.py `run_communication`), 2
per micro-batch on the first and last stage and 4 on an interior one. For every ok run
with pp > 1 this takes the measured time per micro-batch less the planned one (the
convention's factors, `ddp_pp_message_ms` at 0), and divides it by the messages of the
stage with the most (2 at pp 2, 4 from pp 3 on).
"""

from __future__ import annotations

import statistics

from usp_calibration import HW, load, predict

HELD = 0.15  # s per message: half what the held runs lose, far above what the rest do


def excess(rows: list[dict] | None = None) -> list[dict]:
    """Per ok run with pp > 1: its layout, seconds per micro-batch measured and planned, and
    the excess per message of its busiest stage."""
    out = []
    for r in rows if rows is not None else load():
        if r["status"] != "ok" or int(r["pp"]) == 1:
            continue
        p = predict(r, "nanotron", {**HW, "ddp_pp_message_ms": 0.0})
        if not p["plannable"]:
            continue
        n, m = int(r["n_gpus"]), int(r["grad_acc"])
        tokens = int(r["gbs_samples"]) * int(r["seq"])
        measured = tokens / (float(r["tokens_per_s_per_gpu"]) * n) / m
        planned = tokens / (p["tokens_per_s_per_gpu"] * n) / m
        messages = 2 if int(r["pp"]) == 2 else 4
        out.append({"model": r["model"], "n_gpus": n, "dp": int(r["dp"]), "tp": int(r["tp"]),
                    "pp": int(r["pp"]), "mbs": int(r["mbs"]), "zero": int(r["zero"]),
                    "measured_s": measured, "planned_s": planned,
                    "per_message_s": (measured - planned) / messages})
    return out


def groups(runs: list[dict]) -> dict[str, dict]:
    """Runs by DDP (ZeRO-0, dp > 1) or not, pp 2 or deeper, one sequence per micro-batch
    or more: how many, how many lose more than HELD per message, and the median loss per
    message of those that do and of all."""
    out = {}
    for r in runs:
        ddp = "ZeRO-0 dp>1 (DDP)" if r["zero"] == 0 and r["dp"] > 1 else (
            "ZeRO-0 dp1" if r["zero"] == 0 else "ZeRO-1")
        key = f"{ddp}, {r['n_gpus']} GPUs, pp {'2' if r['pp'] == 2 else '>=3'}, " + (
            "mbs 1" if r["mbs"] == 1 else "mbs>1")
        out.setdefault(key, []).append(r["per_message_s"])
    return {k: {"runs": len(v), "held": sum(x > HELD for x in v),
                "median_held_s": statistics.median([x for x in v if x > HELD] or [0.0]),
                "median_s": statistics.median(v)} for k, v in sorted(out.items())}


GPUS_PER_NODE = 8  # the runs' H100 nodes


def by_tp_nodes(runs: list[dict]) -> dict[str, dict]:
    """Runs by GPU count, the nodes a stage's TP group spans (tp / 8, at least 1) and DDP
    (ZeRO-0, dp > 1), ZeRO-0 with dp 1 or ZeRO-1: how many, and how many lose more than
    HELD per message. The 16-GPU runs hold no TP group over more than 2 nodes."""
    out: dict[str, dict] = {}
    for r in runs:
        kind = ("DDP" if r["dp"] > 1 else "ZeRO-0 dp1") if r["zero"] == 0 else "ZeRO-1"
        nodes = max(1, r["tp"] // GPUS_PER_NODE)
        g = out.setdefault(f"{r['n_gpus']} GPUs, TP over {nodes} node(s), {kind}",
                           {"runs": 0, "held": 0})
        g["runs"] += 1
        g["held"] += r["per_message_s"] > HELD
    return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split()[0]), kv[0])))


def main() -> dict:
    runs = excess()
    g = groups(runs)
    for k, v in g.items():
        print(f"{k:<45} runs {v['runs']:>3}  held {v['held']:>3}  per message: median "
              f"{v['median_s'] * 1e3:6.0f} ms, of the held {v['median_held_s'] * 1e3:6.0f} ms")
    for k, v in by_tp_nodes(runs).items():
        print(f"{k:<45} runs {v['runs']:>3}  held {v['held']:>3}")
    return g


if __name__ == "__main__":
    main()
