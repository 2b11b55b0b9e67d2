"""A/B of the striped KV layout (kv_cache_manager.py stripes, read by serve/fused_decode.py
as strided views of the pool) against the gather, on serve_host.py's model and requests.

    python bench/serve/stripes_ab.py [--prompt 16 128] [--rounds 6] [--stripe 64]

CPU ms of a decode step of the engine as served (fused), median over 32 steps, rounds
alternating; --stripe: blocks a region (default: max_model_len / block_size)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_host as sh  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--stripe", type=int, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = sh.build_model(sh.CFG, seed=0).eval()
    make = sh.make_engine
    for length in args.prompt:
        g = torch.Generator().manual_seed(length)
        prompts = [torch.randint(3, sh.CFG.vocab_size, (length,), generator=g).tolist()
                   for _ in range(sh.SEQUENCES)]
        times, tokens = {"gather": [], "stripes": []}, {}
        for _ in range(args.rounds):
            for name in times:
                def engine(m, p, variant, name=name):
                    e = make(m, p, "fused")
                    e.kv.set_stripe(None if name == "gather" else
                                    args.stripe or e.kv.stripe)
                    return e
                sh.make_engine = engine
                ms, tokens[name] = sh.engine_step_ms(model, prompts, 32, "fused")
                times[name].append(ms)
        sh.make_engine = make
        print(f"prompts of {length}: " + ", ".join(
            f"{k} {statistics.median(v):.2f} ms ({' '.join(f'{x:.2f}' for x in v)})"
            for k, v in times.items()) +
            f"; identical greedy tokens {tokens['gather'] == tokens['stripes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
