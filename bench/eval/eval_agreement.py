"""fivefold eval's numbers against their peers on the same weights, and perplexity's speed.

    python bench/eval/eval_agreement.py [--windows 16] [--seq-len 64] [--rounds 3]

A 2-layer Llama over the bundled corpus's 2048-token BPE is made locally
(tests/eval_models.py) and saved as a Hugging Face directory. Printed and written to
bench/results/eval_agreement.json, with the machine, versions and git revision:
- perplexity of fivefold (evaluate/perplexity.py, the model loaded by fivefold's HF loader)
  and of transformers (exp of the token-weighted mean of `model(labels=...).loss` over the
  same windows): both values, their relative difference, and tokens/s of each, timed
  alternately in the same process (median of `--rounds`), with the ratio;
- lm-eval's three requests from FivefoldLM and from lm_eval's own HFLM: the largest
  relative difference of the log-likelihoods and whether generated text is equal.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from fivefold.evaluate.perplexity import perplexity, window_bounds  # noqa: E402
from fivefold.host import cpu_model  # noqa: E402
from fivefold.models.hf import load_hf  # noqa: E402
from fivefold.train.bench import git_revision  # noqa: E402
from tests.eval_models import make_hf_dir  # noqa: E402

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. "


def transformers_perplexity(hf, ids: torch.Tensor, seq_len: int, batch: int) -> float:
    """exp of the token-weighted mean loss over the same windows, `batch` full ones a call."""
    bounds = window_bounds(ids.numel(), seq_len)
    full = [b for b in bounds if b[1] - b[0] == seq_len + 1]
    groups = [full[i:i + batch] for i in range(0, len(full), batch)]
    groups += [[b] for b in bounds if b[1] - b[0] != seq_len + 1]
    total, count = 0.0, 0
    with torch.no_grad():
        for group in groups:
            window = torch.stack([ids[s:e] for s, e in group])
            total += float(hf(input_ids=window, labels=window).loss) * window[:, 1:].numel()
            count += window[:, 1:].numel()
    return math.exp(total / count)


def lm_eval_agreement(directory: Path) -> dict:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from fivefold.evaluate.harness import FivefoldLM

    hf, ours = HFLM(pretrained=str(directory), device="cpu", dtype="float32", batch_size=1), \
        FivefoldLM(hf=str(directory))

    def reqs(kind, *args):
        return [Instance(kind, {}, a, i) for i, a in enumerate(args)]

    ll = reqs("loglikelihood", ("ROMEO: ", "What say you?"), ("", "Good morrow"),
              ("KING:", " Come hither"), (TEXT * 2, " so"))
    roll = reqs("loglikelihood_rolling", (TEXT * 8,), ("Good morrow.",))
    gen = reqs("generate_until", ("KING:", {"until": ["\n"], "max_gen_toks": 10}))
    ll_diff = max(abs(a[0] / b[0] - 1) for a, b in zip(ours.loglikelihood(ll),
                                                        hf.loglikelihood(ll)))
    roll_diff = max(abs(a / b - 1) for a, b in zip(ours.loglikelihood_rolling(roll),
                                                   hf.loglikelihood_rolling(roll)))
    return {"loglikelihood_max_rel_diff": ll_diff, "rolling_max_rel_diff": roll_diff,
            "generate_until_equal": ours.generate_until(gen) == hf.generate_until(gen)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import transformers

    directory = Path(tempfile.mkdtemp(prefix="eval-agreement-"))
    _, _, hf = make_hf_dir(directory, max_positions=args.seq_len)
    ours = load_hf(directory, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (args.windows * args.seq_len + 1,),
                        generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"fivefold": [], "transformers": []}
    for _ in range(args.rounds):  # alternate, so load on a shared machine falls on both
        started = time.perf_counter()
        got = perplexity(ours, ids, args.seq_len, args.batch_size)
        times["fivefold"].append(time.perf_counter() - started)
        started = time.perf_counter()
        expected = transformers_perplexity(hf, ids, args.seq_len, args.batch_size)
        times["transformers"].append(time.perf_counter() - started)
    speed = {k: got.tokens / statistics.median(v) for k, v in times.items()}
    record = {
        "device": f"CPU ({cpu_model()}), "
                  f"{torch.get_num_threads()} threads",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "git_revision": git_revision(), "shape": vars(args), "tokens": got.tokens,
        "perplexity_fivefold": got.perplexity, "perplexity_transformers": expected,
        "perplexity_rel_diff": abs(got.perplexity / expected - 1),
        "tokens_per_s": speed, "ratio": speed["fivefold"] / speed["transformers"],
        **lm_eval_agreement(directory)}
    print(f"perplexity over {got.tokens} tokens: fivefold {got.perplexity:.6f}, transformers "
          f"{expected:.6f} (relative difference {record['perplexity_rel_diff']:.1e})")
    print(f"tokens/s: fivefold {speed['fivefold']:,.0f}, transformers "
          f"{speed['transformers']:,.0f} (ratio {record['ratio']:.2f}x, median of "
          f"{args.rounds} alternating rounds)")
    print(f"lm-eval against HFLM: loglikelihood {record['loglikelihood_max_rel_diff']:.1e}, "
          f"rolling {record['rolling_max_rel_diff']:.1e} (largest relative difference), "
          f"generate_until equal: {record['generate_until_equal']}")
    path = ROOT / "bench" / "results" / "eval_agreement.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
