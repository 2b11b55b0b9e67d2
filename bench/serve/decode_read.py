"""How a CPU decode step should read the batch's K/V from the paged pool: gathered into a
buffer first (what serve/fused_decode.py does) or read in place by SDPA as a strided view.

    python bench/serve/decode_read.py [--context 25 145] [--reps 40]

The shapes of bench/serve/serve_host.py's step: 30 layers, 16 sequences, 2 KV heads of 16
(4 query heads), blocks of 16 tokens, float32, one thread; the pool the engine allocates
there (16 · 64 + 8 blocks, keys and values of all layers in one tensor, as
serve/kv_cache.py lays it out: 126 MB; a step at 145 keys reads 18 MB of it, 0.6 MB a
layer). Per step (all 30 layers), CPU ms, median over `--reps`, variants alternating:

- gather + SDPA: one `index_select` of the layer's blocks (keys and values) into a fixed
  buffer, then SDPA on it; the blocks in a row per sequence (as a batch admitted together
  gets them from the free list) and scattered (a random permutation: a pool after churn);
- SDPA on a view: each sequence's blocks contiguous, sequence i's at a fixed stride of S
  blocks (S = its blocks: the whole batch one run; S = 64: a region of max_model_len
  tokens), so the batch's K/V is a strided view of the pool and nothing is gathered;
- one SDPA call per sequence on its contiguous slice;
- the parts alone: the gather without SDPA, SDPA on a gathered buffer already in cache.

Also the aten ops SDPA dispatches on a strided view (a copy of the input would show).
JSON: bench/results/decode_read.json with the machine, versions and git revision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from fivefold.train.bench import cpu_model, git_revision, machine  # noqa: E402

LAYERS, SEQS, KV, REP, D, BS = 30, 16, 2, 2, 16, 16
NUM_BLOCKS = SEQS * 64 + 8  # serve_host.py's engine
sdpa = F.scaled_dot_product_attention


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def variants(length: int) -> dict:
    nb = -(-length // BS)
    per = NUM_BLOCKS + 1
    kv = torch.randn(2, LAYERS, per * BS, KV, D)
    rows = kv.view(2 * LAYERS * per, -1)
    offsets = (torch.arange(2 * LAYERS).view(2, LAYERS).t() * per)[:, :, None]
    q = torch.randn(SEQS, KV, REP, D)
    buf = rows.new_empty(2 * SEQS * nb, rows.shape[1])
    kb, vb = (x.transpose(1, 2)[:, :, :length] for x in buf.view(2, SEQS, nb * BS, KV, D))

    def gather(tables):
        index = (tables.reshape(1, 1, -1) + offsets).flatten(1).unbind(0)

        def run(with_sdpa=True):
            for j in range(LAYERS):
                torch.index_select(rows, 0, index[j], out=buf)
                if with_sdpa:
                    sdpa(q, kb, vb)
        return run

    def views(stride):
        pool = kv.narrow(2, 0, SEQS * stride * BS).view(2, LAYERS, SEQS, stride * BS, KV, D)
        pool = pool.narrow(3, 0, length).transpose(3, 4)
        ks, vs = pool[0].unbind(0), pool[1].unbind(0)

        def run():
            for j in range(LAYERS):
                sdpa(q, ks[j], vs[j])
        return run, ks[0], vs[0]

    in_a_row, _, _ = views(nb)
    region, k64, v64 = views(64)
    g = torch.Generator().manual_seed(0)
    scattered = torch.randperm(NUM_BLOCKS, generator=g)[:SEQS * nb].view(SEQS, nb)
    pool = kv.narrow(2, 0, SEQS * 64 * BS).view(2, LAYERS, SEQS, 64 * BS, KV, D)
    slices = [[(pool[0, j, i:i + 1, :length].transpose(1, 2),
                pool[1, j, i:i + 1, :length].transpose(1, 2)) for i in range(SEQS)]
              for j in range(LAYERS)]
    out = torch.empty_like(q)

    def per_sequence():
        for j in range(LAYERS):
            for i, (k, v) in enumerate(slices[j]):
                out[i:i + 1] = sdpa(q[i:i + 1], k, v)

    gather_row = gather(torch.arange(SEQS * nb).view(SEQS, nb))

    def sdpa_cached():
        for _ in range(LAYERS):
            sdpa(q, kb, vb)

    with Ops() as ops:
        sdpa(q, k64, v64)
    return {"gather + SDPA, blocks in a row": gather_row,
            "gather + SDPA, blocks scattered": gather(scattered),
            "SDPA on a view, stride = its blocks": in_a_row,
            "SDPA on a view, stride 64 blocks": region,
            "SDPA per sequence, contiguous slices": per_sequence,
            "gather alone, blocks in a row": lambda: gather_row(False),
            "SDPA alone, gathered buffer in cache": sdpa_cached}, ops.names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[25, 145])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_read.json"))
    args = ap.parse_args(argv)
    if min(args.context) < 1 or max(args.context) > 64 * BS or args.reps < 1:
        print(f"--context must be within 1..{64 * BS} and --reps >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    cases = []
    with torch.no_grad():
        for length in args.context:
            fns, ops = variants(length)
            times = {name: [] for name in fns}
            for _ in range(args.reps):
                for name, fn in fns.items():
                    start = time.process_time()
                    fn()
                    times[name].append((time.process_time() - start) * 1e3)
            ms = {name: statistics.median(t) for name, t in times.items()}
            cases.append({"context": length, "step_cpu_ms": ms, "sdpa_ops_on_view": ops})
            print(f"context {length} tokens, {SEQS} sequences, {LAYERS} layers, CPU ms a step:")
            for name, value in ms.items():
                print(f"  {name:38s} {value:6.3f}")
            print(f"  aten ops of SDPA on a strided view: {', '.join(ops)}")
    result = {"benchmark": "decode_read", "layers": LAYERS, "sequences": SEQS,
              "kv_heads": KV, "head_dim": D, "block_size": BS, "num_blocks": NUM_BLOCKS,
              "threads": 1, "reps": args.reps, "cases": cases,
              "machine": {**machine(torch.device("cpu")), "cpu_model": cpu_model()},
              "git": git_revision(),
              "command": "python bench/serve/decode_read.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
