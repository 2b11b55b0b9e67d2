"""How much of RTN's perplexity gap closes by rounding luck alone, and AWQ over calibration draws.

    python bench/quant/awq_spread.py --checkpoint DIR [--null-seeds 6] [--sigma 0.1]
        [--draws 4] [--variants NAME=JSON ...] [--out FILE]

On a model without strong outlier channels (the default model as trained), int4 g128 RTN
costs ~0.28 of validation perplexity, and AWQ's choices change each group's output error
by a few percent. Whether a share of that gap "closed" is the method or the luck of which
weights round up is measured here in two ways:

- null: every AWQ group gets random function-preserving scales exp(sigma·N(0, 1)) per
  input channel (folded as AWQ folds its own: quant.awq.fold_scale, tied under
  grouped-query attention), then RTN. No search; the float model is unchanged (its
  perplexity is printed). The spread of "closes" over seeds is the noise a single number
  carries.
- draws: each AWQ variant (apply_awq's keyword arguments as JSON) calibrated on `--draws`
  disjoint sets of 128 training-split sequences of 128 tokens (every draws-th of
  128·draws evenly spaced ones), measured on the validation split and on 128 other
  training-split sequences (between the calibration ones: the calibration's distribution,
  unseen tokens).

"closes" is (RTN - AWQ) / (RTN - fp32) perplexity, as in bench/quant/awq_outliers.py.
Results go to bench/results/awq_spread.json with the machine and git revision.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench" / "quant"))

from awq_bits import round_linears  # noqa: E402
from quant_quality import calibration, step_dir  # noqa: E402

from fivefold.evaluate.perplexity import checkpoint_validation, perplexity  # noqa: E402
from fivefold.host import cpu_model  # noqa: E402
from fivefold.quant.awq import apply_awq, fold_scale, layer_groups  # noqa: E402
from fivefold.train.bench import git_revision, machine  # noqa: E402
from fivefold.train.checkpoint import read_meta  # noqa: E402

VARIANTS = {"llm-awq's choice (held_out 0, the default)": {"held_out": 0, "rounding": "rtn"},
            "held-out choice (held_out 0.5)": {"held_out": 0.5, "rounding": "rtn"}}


def summary(values: list[float]) -> dict:
    return {"values": values, "mean": statistics.mean(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


@torch.no_grad()
def random_fold(model, sigma: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        for group in layer_groups(layer):
            linears = [layer.get_submodule(n) for n in group.linears]
            s = group.tie(torch.exp(sigma * torch.randn(linears[0].in_features,
                                                        generator=generator)))
            fold_scale(layer.get_submodule(group.prev), linears, s, group.producer_scale(s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--null-seeds", type=int, default=6)
    ap.add_argument("--sigma", type=float, default=0.1)
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--variants", nargs="*", metavar="NAME=JSON",
                    help="apply_awq keyword arguments (default: llm-awq's choice and the "
                    "held-out choice)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "awq_spread.json"))
    args = ap.parse_args()
    if args.null_seeds < 0 or args.draws < 1 or args.sigma < 0:
        print("error: --null-seeds >= 0, --draws >= 1 and --sigma >= 0", file=sys.stderr)
        raise SystemExit(2)
    try:
        variants = (dict((n, json.loads(j)) for n, _, j in (v.partition("=") for v in
                                                              args.variants))
                    if args.variants else VARIANTS)
    except json.JSONDecodeError as e:
        print(f"error: --variants NAME=JSON: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    known = set(inspect.signature(apply_awq).parameters) - {"model", "tokens", "group_size"}
    for name, options in variants.items():
        if not isinstance(options, dict) or set(options) - known:
            print(f"error: --variants {name}: give a JSON object of apply_awq options "
                  f"({', '.join(sorted(known))})", file=sys.stderr)
            raise SystemExit(2)
    if not step_dir(args.checkpoint).joinpath("meta.json").is_file():
        print(f"error: --checkpoint {args.checkpoint} is not a fivefold checkpoint",
              file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    step = step_dir(args.checkpoint)
    model, spaced = calibration(step, 128 * args.draws + 128, 128)
    draws = [spaced[i::args.draws + 1] for i in range(args.draws)]
    unseen = spaced[args.draws::args.draws + 1]
    tokens, _, seq_len = checkpoint_validation(read_meta(step))

    def both(m) -> tuple[float, float]:
        return (perplexity(m, tokens, seq_len).perplexity,
                perplexity(m, unseen.reshape(-1), unseen.shape[1]).perplexity)

    base = both(model)
    rtn = copy.deepcopy(model)
    round_linears(rtn, 15, 128)
    r = both(rtn)

    def closes(p):
        return [(r[i] - p[i]) / (r[i] - base[i]) for i in range(2)]

    print(f"fp32 {base[0]:.4f} (unseen training windows {base[1]:.4f}), RTN {r[0]:.4f} "
          f"({r[1]:.4f})", flush=True)
    null = []
    for seed in range(args.null_seeds):
        m = copy.deepcopy(model)
        random_fold(m, args.sigma, seed)
        float_ppl = perplexity(m, tokens, seq_len).perplexity
        round_linears(m, 15, 128)
        c = closes(both(m))
        null.append(c)
        print(f"null seed {seed}: float {float_ppl:.5f}, closes {c[0]:.0%} (unseen training "
              f"windows {c[1]:.0%})", flush=True)
    result = {"checkpoint": str(step), "fp32": base[0], "rtn": r[0],
              "fp32_unseen_training_windows": base[1], "rtn_unseen_training_windows": r[1],
              "sigma": args.sigma, "draws": args.draws, "calibration": [128, 128]}
    if null:
        result["null"] = {"validation": summary([c[0] for c in null]),
                          "unseen_training_windows": summary([c[1] for c in null])}
    result["variants"] = {}
    for name, options in variants.items():
        rows = []
        for i, calib in enumerate(draws):
            m = copy.deepcopy(model)
            apply_awq(m, calib, 128, **options)
            round_linears(m, 15, 128)
            c = closes(both(m))
            rows.append(c)
            print(f"{name} draw {i}: closes {c[0]:.0%} (unseen training windows {c[1]:.0%})",
                  flush=True)
        result["variants"][name] = {"options": options,
                                    "validation": summary([c[0] for c in rows]),
                                    "unseen_training_windows": summary([c[1] for c in rows])}
    record = {"benchmark": "awq_spread", "result": result,
              "machine": {**machine(torch.device("cpu")), "cpu_model": cpu_model()},
              "git_revision": git_revision(),
              "command": "python bench/quant/awq_spread.py " + " ".join(sys.argv[1:])}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
