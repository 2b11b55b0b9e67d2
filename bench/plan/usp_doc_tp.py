"""The nanotron section's bullets on TP calls under a host-bound micro-batch, on TP groups
over more nodes, and on which pipeline runs stall (docs/planner-validation.md), from the
JSON results of bench/plan/usp_calibration.py (now and at 184e63e, the run before the TP
calls ran in the GPU's idle time), bench/plan/usp_tp_nodes_trial.py and
bench/plan/usp_breakdown.py."""

from __future__ import annotations

import json

from usp_calibration import OUT, load, workload_layout
from usp_pipeline_stall import HELD, by_tp_nodes, excess

from fivefold.plan.comm import collectives
from fivefold.plan.hardware import get_hardware
from fivefold.plan.network import group_nodes, ring_steps

BEFORE_SLACK = OUT.parent / "usp_calibration_184e63e.json"
TRIALS = {law: OUT.parent / f"usp_tp_nodes_trial_{law}.json" for law in ("slowest", "closed")}
E = "throughput_median_abs_error"
W = "throughput_within_20pct"


def term_line(f: dict) -> str:
    """The term among the time terms, with its fitted companions' values."""
    host = (f"{f['16']['host_layer_ms']:g} ms on either half "
            if f["16"]["host_layer_ms"] == f["128"]["host_layer_ms"] else
            f"{f['16']['host_layer_ms']:g} and {f['128']['host_layer_ms']:g} ms on the halves ")
    return (
        "- TP calls in the GPU's idle time (`plan/timing.py` `RankCompute.host_slack`, "
        "`step_time`): where an eager engine's host takes longer per micro-batch than the "
        "GPU's work (`host_layer_ms` per layer), the GPU idles, and the TP calls the host "
        "has queued run there, so a micro-batch takes the longer of the host's time (with "
        "the blocked waits above) and the GPU's work with its TP calls, where before it "
        "took the longer of the host's time and the GPU's work, plus the TP calls (argued: "
        "nanotron's TP collectives, parallel/tensor_parallel/"
        "distributed_differentiable_primitives.py @009b8f7 `dist.all_gather_into_tensor`, "
        "`dist.reduce_scatter_tensor`, are NCCL kernels on the GPU whose wait holds the "
        "compute stream, not the host, and at pp 1 nothing else blocks it; every "
        "convention takes it, the engine's own too where a calibrate profile gives its "
        "host time; tests/test_plan_network.py). With it the host time per layer fits "
        + host + "(on a 0.5 ms grid, `bench/plan/usp_fit.py`), and a TP step between nodes "
        f"{f['16']['tp_inter_step_us']:g} µs on the 16-GPU half, "
        f"{f['128']['tp_inter_step_us']:g} on the 128-GPU half (the grid now reaches "
        "600 µs), close to what the runs lose per node-crossing step (below).")


def crossings_per_layer(tp: str) -> tuple[int, float]:
    """(nodes, node-crossing ring steps per layer per micro-batch) of the TP calls of the
    8B model at pp 1, one sequence per micro-batch, on 128 GPUs with `tp`."""
    row = next(r for r in load() if r["model"] == "8B" and r["n_gpus"] == "128"
               and r["tp"] == tp and r["pp"] == "1" and r["mbs"] == "1")
    work, lay = workload_layout(row)
    hw, _ = get_hardware("h100-sxm")
    k = group_nodes(hw, lay, "tp")
    steps = sum(c.calls * ring_steps(c.op, c.group_size, k)[1]
                for c in collectives(work, lay, 0) if c.group == "tp")
    return k, steps / work.num_microbatches(lay) / work.model.num_layers


def _cross(s: dict) -> str:
    return (f"fitted on 16, judged on 128 {s['fit_16_judge_128'][E]:.2%} "
            f"({s['fit_16_judge_128'][W]:.1%} within 20%), fitted on 128, judged on 16 "
            f"{s['fit_128_judge_16'][E]:.2%} ({s['fit_128_judge_16'][W]:.1%}), in-sample "
            f"{s['fit_16_judge_16'][E]:.2%} (16) and {s['fit_128_judge_128'][E]:.2%} (128)")


def _scores(r: dict) -> dict:
    """A calibration's held-out and in-sample scores in the trial's shape."""
    return {**{k: r["held_out"][k] for k in ("fit_16_judge_128", "fit_128_judge_16")},
            "fit_16_judge_16": r["in_sample"]["16"], "fit_128_judge_128": r["in_sample"]["128"]}


def _pick_change(before: dict, now: dict) -> str:
    """The whole file's picks before and now, and the groups whose pick changed."""
    was, got = before["scores"]["all"], now["scores"]["all"]
    moved = [f"{g} {was['picks'][g]['fits']['layout']} → {p['fits']['layout']} "
             f"({'a hit' if p['fits']['hit'] else 'a miss'}: {p['fits']['measured']:,.0f} of "
             f"{p['fits']['best_measured']:,.0f} tokens/s)"
             for g, p in got["picks"].items()
             if p["fits"]["layout"] != was["picks"][g]["fits"]["layout"]]
    return (f"With the whole file's factors the pick reads {was['pick_within_10pct']} → "
            f"{got['pick_within_10pct']} of {got['groups']}"
            + (": " + "; ".join(moved) if moved else "") + ". The planner has no term for "
            "the pipeline runs that stall (below), so a pick among fast-planned pipelines "
            "can land on one.")


def tp_lines(now: dict, layer_ms: dict) -> list[str]:
    """Bullets: the term's cross-fit before and after; the measured cost per node-crossing
    step at 2 and 4 nodes; the laws tried for its growth (when their JSON results exist)."""
    lines = []
    if BEFORE_SLACK.exists():
        before = json.loads(BEFORE_SLACK.read_text())
        b, n = _scores(before), _scores(now)
        ratio = {k: s["fit_16_judge_128"][E] / s["fit_128_judge_128"][E]
                 for k, s in (("b", b), ("n", n))}
        back = {k: s["fit_128_judge_16"][E] / s["fit_16_judge_16"][E]
                for k, s in (("b", b), ("n", n))}
        lines.append(
            "- The TP calls in the GPU's idle time, before (`bench/results/"
            f"{BEFORE_SLACK.name}`) and now, tokens/s median error: {_cross(b)} before; "
            f"{_cross(n)} now. Held out / in-sample: 16 → 128 {ratio['b']:.2f}x → "
            f"{ratio['n']:.2f}x, 128 → 16 {back['b']:.2f}x → {back['n']:.2f}x (goal ≤ "
            "1.5x; the reverse grows because the 16-GPU half's own fit gains most). Both "
            "held-out errors fall; no factor was added. " + _pick_change(before, now))
    one = layer_ms["128"]["8"]
    per = []
    for tp in ("16", "32"):
        k, steps = crossings_per_layer(tp)
        more = layer_ms["128"][tp] - one
        per.append(f"over {k} nodes {more:.1f} ms more per layer for {steps:.1f} "
                   f"node-crossing steps, {more / steps * 1e3:.0f} µs each")
    lines.append(
        "- What a TP step between nodes costs, from the ms per layer above (128 GPUs, pp 1, "
        f"one sequence per micro-batch; against tp 8 in a node): {'; '.join(per)} (the "
        "NVLink steps the wider ring adds, 3.4 µs each, are a few % of it). So the cost "
        "grows with the k − 1 steps NCCL's model counts, not faster. With the in-node TP "
        "calls planned on top of the host's time, the in-node runs were planned too slow "
        "(tp 8 on 128 GPUs: 5.1-5.9 ms per layer with the 16-GPU half's factors at 184e63e, "
        "4.8-5.1 measured) and the fitted step held "
        "at 150 µs on either half, below the 240 the runs lose; with the TP calls in the "
        "GPU's idle time it fits "
        f"{now['fitted']['16']['tp_inter_step_us']:g} µs (16 GPUs) and "
        f"{now['fitted']['128']['tp_inter_step_us']:g} (128).")
    tried = {law: json.loads(p.read_text()) for law, p in TRIALS.items() if p.exists()}
    if tried:
        what = {"slowest": "each node-crossing step waits for the slowest of the ring's k "
                           "crossing links (× √(ln k / ln 2))",
                "closed": "a chunk round the closed ring crosses all k node boundaries, "
                          "not k − 1 (× k / 2(k − 1))"}
        lines.append(
            "- Laws tried for how a TP step between nodes grows with the nodes k, each "
            "normalised to the fitted time at 2 nodes and refitted on either half "
            "(`python bench/plan/usp_tp_nodes_trial.py --law LAW`, `bench/results/"
            "usp_tp_nodes_trial_LAW.json`, with the TP calls in the GPU's idle time): "
            + "; ".join(f"{law}, {what[law]}: {_cross(t['scores'])}"
                        for law, t in tried.items())
            + ". Not kept: neither reads better held out than NCCL's k − 1 count (the "
            "bullet before last), the measured cost per step above is flat in k, and the "
            "slowest-of-k wait is not what a pipelined ring does (its critical path adds "
            "the crossing steps it takes).")
    return lines


def stall_lines() -> list[str]:
    """A bullet: which pipeline runs lose a wait per message, by the nodes a stage's TP
    group spans (bench/plan/usp_pipeline_stall.py)."""
    g = by_tp_nodes(excess())

    def cell(key: str) -> str:
        v = g.get(key)
        return f"{v['held']} of {v['runs']}" if v else "none"

    four = [k for k in g if "over 4 node" in k]
    held = sum(g[k]["held"] for k in four)
    runs = sum(g[k]["runs"] for k in four)
    return [
        "- Which pipeline runs stall, by the nodes a stage's TP group spans (`python "
        "bench/plan/usp_pipeline_stall.py`, runs losing more than "
        f"{HELD * 1e3:.0f} ms per message): with tp 32 (four nodes) {held} of {runs} "
        f"stall whatever the ZeRO stage (ZeRO-1 {cell('128 GPUs, TP over 4 node(s), ZeRO-1')}"
        f", ZeRO-0 with dp 1 {cell('128 GPUs, TP over 4 node(s), ZeRO-0 dp1')}), with "
        f"tp 16 (two nodes) ZeRO-1 {cell('128 GPUs, TP over 2 node(s), ZeRO-1')} and "
        f"ZeRO-0 with dp 1 {cell('128 GPUs, TP over 2 node(s), ZeRO-0 dp1')}, but under "
        f"DDP {cell('128 GPUs, TP over 2 node(s), DDP')}; with TP in a node, on 128 GPUs "
        f"ZeRO-1 {cell('128 GPUs, TP over 1 node(s), ZeRO-1')}, DDP "
        f"{cell('128 GPUs, TP over 1 node(s), DDP')}, on 16 ZeRO-1 "
        f"{cell('16 GPUs, TP over 1 node(s), ZeRO-1')}, DDP "
        f"{cell('16 GPUs, TP over 1 node(s), DDP')}. The 16-GPU runs hold no pipeline "
        "whose TP group leaves a node (tp 16 there fills all 16 GPUs), so the tp 32 "
        "stalls, most of the held-out pipeline miss at tp 32 and all of ZeRO-0's at pp 4 "
        "with dp 1, happen in a layout the 16-GPU half does not have: a term for them "
        "could only be fitted on the half it helps, and none is added. Under DDP the "
        "128-GPU runs stall more often than the 16-GPU ones at every TP span; what "
        "differs between them physically (16 nodes against 2; pipeline neighbours up to "
        "8 nodes apart where on 16 GPUs they sit at most on the next node) the file's one "
        "throughput per run cannot separate."]
