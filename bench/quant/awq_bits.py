"""AWQ against round-to-nearest at 4 and 3 bits (group 128), on fivefold checkpoints.

    python bench/quant/awq_bits.py --checkpoint NAME=DIR [--checkpoint ...] [--bits 4 3]
        [--rounding rtn|gptq]

At int4 g128 the models this project can train on its bundled corpus lose under 0.7%
perplexity to RTN, too little to judge AWQ by (docs/quantization.md#quality); at 3 bits RTN
loses several percent, so whether AWQ's scale search recovers a share of a gap that is
clearly there can be seen. The AWQ paper reports both INT3-g128 and INT4-g128 (arXiv:2306.00978,
Table 4; LLaMA-7B WikiText-2 at INT4-g128: fp16 5.68, RTN 5.96, AWQ 5.78, 64% of RTN's gap).

Both arms are fake-quantised (`numerics.intx.fake_quantize_int4` with levels = 2^b - 1:
asymmetric with a zero point, per group of 128 input columns), so they differ only in AWQ's
scaling and clipping (`quant.awq.apply_awq`'s defaults, searching with the same `b`-bit
grid) applied first, and AWQ's arm rounded to nearest (`--rounding rtn`, the default here:
its JSONs were measured so; `--rounding gptq`, apply_awq's default, rounds it by GPTQ).
Calibration: 128 x 128 tokens of the run's training split, as `fivefold quantize` takes
them; evaluation: the run's validation split. Results go to bench/results/awq_bits.json
with the machine and git revision.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench" / "quant"))

from quant_quality import calibration, step_dir  # noqa: E402

from fivefold.evaluate.perplexity import checkpoint_validation, perplexity  # noqa: E402
from fivefold.numerics.intx import fake_quantize_int4  # noqa: E402
from fivefold.quant.awq import apply_awq  # noqa: E402
from fivefold.train.bench import git_revision, machine  # noqa: E402
from fivefold.train.checkpoint import read_meta  # noqa: E402


@torch.no_grad()
def round_linears(model: torch.nn.Module, levels: int, group_size: int) -> None:
    """RTN on every block linear (embedding and head stay float, as `fivefold quantize`)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
            module.weight.copy_(fake_quantize_int4(module.weight, group_size, levels=levels))


def run(name: str, path: str, bits: list[int], group_size: int, rounding: str = "rtn"
        ) -> dict:
    step = step_dir(path)
    model, calib = calibration(step, 128, 128)
    tokens, _, seq_len = checkpoint_validation(read_meta(step))
    base = perplexity(model, tokens, seq_len).perplexity
    result = {"checkpoint": str(step), "fp32": base, "validation_tokens": int(len(tokens)),
              "calibration": list(calib.shape), "bits": {}}
    for b in bits:
        levels = 2 ** b - 1
        rtn = copy.deepcopy(model)
        round_linears(rtn, levels, group_size)
        p_rtn = perplexity(rtn, tokens, seq_len).perplexity
        scaled = copy.deepcopy(model)
        # searching with the b-bit grid
        apply_awq(scaled, calib, group_size, levels=levels, rounding=rounding)
        round_linears(scaled, levels, group_size)
        p_awq = perplexity(scaled, tokens, seq_len).perplexity
        closes = (p_rtn - p_awq) / (p_rtn - base) if p_rtn != base else None
        result["bits"][str(b)] = {"rtn": p_rtn, "awq": p_awq, "closes": closes}
        print(f"{name} int{b} g{group_size}: fp32 {base:.4f}  RTN {p_rtn:.4f} "
              f"({(p_rtn / base - 1) * 100:+.2f}%)  AWQ {p_awq:.4f} "
              f"({(p_awq / base - 1) * 100:+.2f}%)  AWQ closes "
              f"{'n/a' if closes is None else f'{closes:.0%}'} of RTN's gap", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", action="append", required=True, help="NAME=DIR")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--rounding", choices=("rtn", "gptq"), default="rtn")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "awq_bits.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    for item in args.checkpoint:
        name, _, path = item.partition("=")
        results[name] = run(name, path, args.bits, args.group_size, args.rounding)
    record = {"benchmark": "awq_bits", "results": results, "machine": machine(torch.device("cpu")),
              "git_revision": git_revision(), "command": "python bench/quant/awq_bits.py "
              + " ".join(sys.argv[1:])}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
