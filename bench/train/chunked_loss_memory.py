"""Peak memory of the loss with and without materialised logits, at Llama 3's vocabulary.

    python bench/train/chunked_loss_memory.py [--tokens 1024] [--hidden 256] [--vocab 128256]

Forward + backward of the summed cross-entropy of `tokens` rows against a (vocab, hidden)
head, fp32 on CPU: fivefold's chunked head + loss (models/loss.py) against logits = x·Wᵀ
followed by F.cross_entropy. The peak is counted from allocations (every storage created
and freed, train/allocations.py), with the inputs and weight counted as existing. Writes
bench/results/chunked_loss_memory.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from fivefold.host import cpu_model  # noqa: E402
from fivefold.models.loss import chunked_linear_cross_entropy  # noqa: E402
from fivefold.train.allocations import PeakAllocations  # noqa: E402
from fivefold.train.bench import git_revision  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(1, args.tokens, args.hidden, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    y = torch.randint(0, args.vocab, (1, args.tokens))
    variants = {
        "chunked": lambda: chunked_linear_cross_entropy(x, w, y),
        "materialised": lambda: F.cross_entropy((x @ w.t()).flatten(0, 1), y.flatten(),
                                                reduction="sum"),
    }
    out = {}
    for name, fn in variants.items():
        with PeakAllocations([x, w, y]) as meter:
            start = time.perf_counter()
            loss = fn()
            loss.backward()
            seconds = time.perf_counter() - start
        x.grad = w.grad = None
        out[name] = {"peak_bytes": meter.peak, "loss": float(loss.detach()), "seconds": seconds}
        print(f"{name:>13}: peak {meter.peak / 2**20:8.1f} MiB, loss {float(loss.detach()):.6f}, "
              f"{seconds:.2f} s")
    logits = args.tokens * args.vocab * 4
    saved = out["materialised"]["peak_bytes"] - out["chunked"]["peak_bytes"]
    print(f"lower by {saved / 2**20:.1f} MiB; the fp32 logits are {logits / 2**20:.1f} MiB "
          f"({saved / logits:.2f}x)")
    record = {"device": f"CPU ({cpu_model()})",
              "torch": torch.__version__, "python": platform.python_version(),
              "git_revision": git_revision(), "shape": vars(args), "fp32_logits_bytes": logits,
              "peak_lower_by_bytes": saved, "variants": out}
    path = Path(__file__).resolve().parents[1] / "results" / "chunked_loss_memory.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
