"""The nanotron section's bullets on its slow pipeline runs (docs/planner-validation.md):
what nanotron's code does under ZeRO-0 with a pipeline, what the runs lose per pipeline
message (bench/plan/usp_pipeline_stall.py), and the candidate term's cross-fit (the
fits of bench/plan/usp_calibration.py)."""

from __future__ import annotations

import json

from usp_calibration import OUT
from usp_pipeline_stall import HELD, excess, groups

NANOTRON = "huggingface/nanotron"
# bench/plan/usp_calibration.py with `ddp_pp_message_ms` in usp_fit.py's TIME_GRIDS
# (0, 100, 200, 250, 300, 350 ms), written with --out to this file.
TRIAL = OUT.parent / "usp_calibration_ddp_trial.json"


def _share(g: dict, keys: list[str]) -> tuple[int, int, float]:
    """Runs, runs held, and the median loss per message of the held ones, over groups."""
    runs = sum(g[k]["runs"] for k in keys if k in g)
    held = sum(g[k]["held"] for k in keys if k in g)
    med = [g[k]["median_held_s"] for k in keys if k in g and g[k]["held"]]
    return runs, held, (sorted(med)[len(med) // 2] if med else 0.0)


def pipeline_lines(now: dict, ratios: str) -> list[str]:
    """Bullets: the code, the loss per message, the term. `ratios`: the 128-GPU runs'
    predicted/measured by ZeRO stage, pp and dp (usp_breakdown.json), a clause."""
    runs = excess()
    g = groups(runs)
    tp32 = [r for r in runs if r["zero"] == 0 and r["dp"] == 1 and r["tp"] == 32
            and r["pp"] == 4]
    trial = json.loads(TRIAL.read_text())
    f, held, ins = trial["fitted"], trial["held_out"], trial["in_sample"]
    ddp128 = _share(g, [k for k in g if k.startswith("ZeRO-0 dp>1") and "128" in k
                        and k.endswith("mbs 1")])
    ddp16 = _share(g, [k for k in g if k.startswith("ZeRO-0 dp>1") and "16 GPUs" in k
                       and k.endswith("mbs 1")])
    ddp_big = _share(g, [k for k in g if k.startswith("ZeRO-0 dp>1") and k.endswith("mbs>1")])
    z1_128 = _share(g, [k for k in g if k.startswith("ZeRO-1") and "128" in k])
    z1_16 = _share(g, [k for k in g if k.startswith("ZeRO-1") and "16 GPUs" in k])
    dp1 = _share(g, [k for k in g if k.startswith("ZeRO-0 dp1") and "128" in k])
    low = sum(abs(r["per_message_s"]) < 0.1 for r in runs)
    mid = sum(0.2 <= r["per_message_s"] <= 0.35 for r in runs)
    losses = [v["median_held_s"] for v in g.values() if v["held"]]
    value = {k: f[k].get("ddp_pp_message_ms", 0.0) for k in ("16", "128", "all")}
    kept = bool(now["convention"].get("ddp_pp_message_ms"))
    h16, h128 = held["fit_16_judge_128"], held["fit_128_judge_16"]
    cross = h16["throughput_median_abs_error"] / ins["128"]["throughput_median_abs_error"]
    return [
        f"- What nanotron's code does with a pipeline under ZeRO-0 ({NANOTRON}, the files "
        "as stored at the commits named). Only ZeRO-0 with dp > 1 runs under DDP: "
        "trainer.py @004a89c `_init_model`, `make_ddp = data_parallel_size > 1 and not "
        "(accumulate_grad_in_fp32 and zero_stage > 0)`; ZeRO-1 all-reduces its fp32 "
        "gradients once after the pipeline (`training_step`, `sync_gradients_across_dp`). "
        "DDP syncs once per step, not per micro-batch: every forward runs under "
        "`model.no_sync()` (parallel/pipeline_parallel/engine.py @1cc9cb3 lines 71-75, "
        "`_get_fwd_context`), every backward but the last under `grad_accumulator.no_sync()` "
        "and the last under `ddp_trigger_sync_in_bwd` (lines 110-128, `_get_bwd_context`), "
        "whose `prepare_for_backward` lets DDP's hook (optim/gradient_accumulator.py "
        "@069c21c `get_fp32_accum_hook`) add the last bf16 gradients to the fp32 buffer and "
        "start one asynchronous `all_reduce_coalesced` per bucket, waited on after "
        "`train_batch_iter`. So no DP collective runs per micro-batch and none grows with "
        "pp, as the last reading found. What does run per micro-batch is the pipeline's "
        "messages, each blocking the host, one at a time: parallel/pipeline_parallel/"
        "state.py @2a34742 `run_communication` ('Only one communication is done at a time': "
        "send activation, receive activation, send gradient, receive gradient), p2p.py "
        "@3024b46 `send_tensors` and `recv_tensors`, which wait on each message after "
        "`_send_meta` / `_recv_meta` pass its shape in two blocking `dist.send` / "
        "`dist.recv` and read it on the host (a device sync). A stage passes 2 per "
        "micro-batch at the pipeline's ends and 4 in between.",
        "- What the runs lose per message (`python bench/plan/usp_pipeline_stall.py`: "
        "measured less planned time per micro-batch, over the messages of the busiest "
        "stage, 2 at pp 2 and 4 from pp 3): a run loses either nothing or one fixed wait "
        f"per message: of the {len(runs)} ok runs with pp > 1, {low} lose less than 100 "
        f"ms per message, {mid} between 200 and 350 ms and {len(runs) - low - mid} "
        f"otherwise; the median of those losing more than {HELD * 1e3:.0f} ms is "
        f"{min(losses) * 1e3:.0f}-{max(losses) * 1e3:.0f} ms in each group (ZeRO stage, "
        "DDP or not, pp 2 or deeper, micro-batch size, GPU count), whatever the model, tp "
        "or dp: pp 2's 0.5-0.6 s and deeper pipelines' 1.1-1.3 s per "
        "micro-batch are 2 and 4 such waits. Which runs lose it, the code does not say: "
        f"under DDP with one sequence per micro-batch {ddp128[1]} of {ddp128[0]} runs on "
        f"128 GPUs ({ddp128[2] * 1e3:.0f} ms) and {ddp16[1]} of {ddp16[0]} on 16 "
        f"({ddp16[2] * 1e3:.0f} ms), with larger micro-batches {ddp_big[1]} of "
        f"{ddp_big[0]}; without DDP too, ZeRO-1 {z1_128[1]} of {z1_128[0]} on 128 GPUs "
        f"and {z1_16[1]} of {z1_16[0]} on 16, and ZeRO-0 with dp 1 {dp1[1]} of {dp1[0]} "
        f"on 128, among them {sum(r['per_message_s'] > HELD for r in tp32)} of the "
        f"{len(tp32)} with tp 32 (four nodes) and pp 4. DDP's code adds no call per "
        "message, so the wait is not DDP's work; what it is (a blocked point-to-point "
        "channel's progress beside DDP's communicator, the fabric) the file, which logs "
        "one throughput per run, cannot tell. The runs' ratios, the factors as they "
        f"stand: {ratios}.",
        "- The term (`ddp_pp_message_ms`, `plan/network.py` `ddp_pp_message_s`, "
        "`plan/timing.py` `_timed_ranks`): under DDP each of a stage's pipeline messages "
        "holds the host that long, in turn, 2 per micro-batch at the pipeline's ends and 4 "
        "in between, so an interior stage paces the pipeline (argued from the code "
        "above); its size fitted in a trial with it in `bench/plan/usp_fit.py`'s "
        "TIME_GRIDS (0 to 350 ms): "
        f"{value['16']:g} ms on the 16-GPU half, {value['128']:g} on the 128-GPU half, "
        f"{value['all']:g} on the whole file. "
        + ("Kept." if kept else
           "Not kept (0 in every convention): the 16-GPU half, where most DDP pipelines "
           "do not stall, fits "
           + ("0, so nothing carries to the 128-GPU half, where most do: "
              if not value['16'] else f"{value['16']:g}: ")
           + f"with the factor in the fit (`{TRIAL.relative_to(OUT.parents[2])}`), "
           f"fitted on 16 and judged on 128 the tokens/s median error reads "
           f"{h16['throughput_median_abs_error']:.1%} against "
           f"{ins['128']['throughput_median_abs_error']:.1%} in-sample "
           f"({cross:.2f}x), and fitted on 128, judged on 16, "
           f"{h128['throughput_median_abs_error']:.1%} and "
           f"{h128['throughput_within_20pct']:.0%} within 20% against "
           f"{ins['16']['throughput_median_abs_error']:.1%} in-sample. A term that fires "
           "on every DDP pipeline cannot be right on both halves while which runs stall "
           "is not a function of the layout. The option stays for a pessimistic plan "
           "(`--hw ddp_pp_message_ms=280`)."),
    ]


# The calibration before nanotron's ZeRO-1 gradient sync became an all-reduce.
BEFORE_ALL_REDUCE = OUT.parent / "usp_calibration_4a425a7.json"


def all_reduce_lines(now: dict) -> list[str]:
    """A bullet: the cross-fit before and after `zero1_grad_sync = all_reduce`, and the
    held-out picks it changed; empty without the snapshot."""
    if not BEFORE_ALL_REDUCE.exists():
        return []
    was = json.loads(BEFORE_ALL_REDUCE.read_text())
    parts, picks = [], []
    for name, g, label in (("fit_16_judge_128", "128", "fitted on 16, judged on 128"),
                           ("fit_128_judge_16", "16", "fitted on 128, judged on 16")):
        b, n = was["held_out"][name], now["held_out"][name]
        bi, ni = was["in_sample"][g], now["in_sample"][g]
        e = "throughput_median_abs_error"
        parts.append(f"{label} {b[e]:.2%} → {n[e]:.2%} ({b['throughput_within_20pct']:.1%} → "
                     f"{n['throughput_within_20pct']:.1%} within 20%; in-sample {bi[e]:.2%} → "
                     f"{ni[e]:.2%}, so {b[e] / bi[e]:.2f}x → {n[e] / ni[e]:.2f}x of it)")
        for group, p in n["picks"].items():
            old = b["picks"][group]["fits"]
            if p["fits"]["hit"] != old["hit"]:
                picks.append(f"{group} ({label}) {old['layout']} → {p['fits']['layout']}, "
                             f"{'a hit' if p['fits']['hit'] else 'a miss'} "
                             f"({p['fits']['measured']:,.0f} of {p['fits']['best_measured']:,.0f} "
                             f"tokens/s)")
    return [f"- nanotron's ZeRO-1 gradient sync planned as the all-reduce its trainer runs "
            f"(`zero1_grad_sync`; argued from the code, no factor added; before: "
            f"`bench/results/{BEFORE_ALL_REDUCE.name}`): tokens/s median error held out, "
            + "; ".join(parts) + ". The whole file's fit moved `straggler_sigma` from "
            f"{was['fitted']['all']['straggler_sigma']:g} to "
            f"{now['fitted']['all']['straggler_sigma']:g}. Picks that changed: "
            + ("; ".join(picks) or "none") + "."]
