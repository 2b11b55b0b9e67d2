"""A trial, not the model: how a TP call's node-crossing steps might grow with the nodes its
group spans, refitted on either half of the Ultra-Scale Playbook's runs and judged on the
other (docs/planner-validation.md, the nanotron section).

    python bench/plan/usp_tp_nodes_trial.py --law slowest   # a few minutes on two cores
    python bench/plan/usp_tp_nodes_trial.py --law closed
        # writes bench/results/usp_tp_nodes_trial_LAW.json

The planner (plan/network.py `call_latency_s`, `hop_latency_s`) gives each of a TP call's
node-crossing ring steps (k − 1 of an all-gather or reduce-scatter over k nodes, NCCL's
count) the network's hop plus nanotron's fitted `tp_inter_step_us`. The 16-GPU runs hold TP
groups over at most 2 nodes, the 128-GPU runs over 4 (tp 32): measured ms per layer per
micro-batch at pp 1 and one sequence, 4.7 in a node, 8.0 over 2, 15.6 over 4
(`python bench/plan/usp_breakdown.py`). The laws tried, each normalised so that a group over
2 nodes keeps the flat law's time (its fitted value then means the same on both halves):
- flat: NCCL's count as the planner takes it (the calibration's own cross-fit);
- slowest: each node-crossing step waits for the slowest of the ring's k crossing links,
  the spread growing as √(2 ln k) (the expected maximum of k normal variables, as
  `timing.straggler_time`): the fitted time × √(ln k / ln 2);
- closed: a chunk that goes round the closed ring crosses all k node boundaries, not
  k − 1: the fitted time × k / (2(k − 1)) per NCCL-counted step (× k/2 in all).
The law is patched in here (`plan/` keeps NCCL's count); the factors are refitted with
`usp_fit.fit` on each half, as `bench/plan/usp_calibration.py` does.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess

import usp_calibration as cal
from usp_calibration import HW, ROOT, _cpu_model, halves, load, run, score

import fivefold.plan.network as network

LAWS = {"flat": lambda k: 1.0, "slowest": lambda k: math.sqrt(math.log(k) / math.log(2)),
        "closed": lambda k: k / (2 * (k - 1))}
KEYS = ("throughput_median_abs_error", "throughput_within_20pct", "pick_within_10pct",
        "groups")


def patch(law: str) -> None:
    """Scale the fitted `tp_inter_step_us` of a TP call's node-crossing steps by `law`."""
    flat = network.call_latency_s
    grow = LAWS[law]

    def call_latency_s(c, hw, assume, layout, inter, algorithm="ring"):
        t = flat(c, hw, assume, layout, inter, algorithm)
        if not (inter and c.group == "tp" and assume.tp_inter_step_us):
            return t
        nodes = min(network.group_nodes(hw, layout, c.group), c.group_size)
        across = network.ring_steps(c.op, c.group_size, nodes)[1]
        return t + across * assume.tp_inter_step_us * 1e-6 * (grow(nodes) - 1)

    network.call_latency_s = call_latency_s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--law", choices=sorted(LAWS), required=True)
    args = ap.parse_args(argv)
    patch(args.law)
    from usp_fit import fit  # it imports usp_calibration: after the patch, as it predicts

    split = halves(load())
    fitted = {g: fit(split[g]) for g in ("16", "128")}
    scores = {}
    for train, test in (("16", "128"), ("128", "16"), ("16", "16"), ("128", "128")):
        s = score(split[test], run(split[test], hw_overrides={**HW, **fitted[train]}))
        scores[f"fit_{train}_judge_{test}"] = {k: s[k] for k in KEYS}
    ratio = {f"{a}_to_{b}": scores[f"fit_{a}_judge_{b}"]["throughput_median_abs_error"]
             / scores[f"fit_{b}_judge_{b}"]["throughput_median_abs_error"]
             for a, b in (("16", "128"), ("128", "16"))}
    for name, s in scores.items():
        print(f"{name:<18} tokens/s median {s['throughput_median_abs_error']:.2%} within 20% "
              f"{s['throughput_within_20pct']:.1%} pick {s['pick_within_10pct']}/{s['groups']}")
    print("held out / in-sample: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    for g, f in fitted.items():
        print(f"fitted on {g}: " + ", ".join(f"{k} {v:.3g}" for k, v in f.items()))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    out = {"machine": {"host": platform.node(), "cpu": _cpu_model(),
                       "python": platform.python_version()}, "git": rev, "law": args.law,
           "scores": scores, "cross_fit_ratio": ratio, "fitted": fitted}
    path = cal.OUT.parent / f"usp_tp_nodes_trial_{args.law}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
