"""Serving throughput with three LoRA adapters mixed in every batch vs the base alone.

    python bench/serve/serve_lora.py [--preset llama-25m] [--requests 48] [--rank 16] [--threads 1]

The same workload runs on the same `Engine` settings twice, alternating (`--rounds` times
each, the best of each kept, so that another process's burst on a shared machine does not
decide the ratio):

- base: the plain model, every request for the base;
- mixed: the model with three rank-`--rank` adapters on every linear of the blocks
  (q, k, v, o, gate, up, down; serve/lora_batch.py), requests assigned to the adapters
  round robin, so each step's batch holds all three, interleaved.

Requests all arrive at t = 0, prompts 16-128 tokens, outputs 32-96 (EOS ignored), greedy,
fp32, the linears prepacked as `fivefold serve` runs them. Printed and written to
bench/results/serve_lora.json: output tokens/s and tokens per CPU-second of each, their
ratio (the goal: mixed >= 0.7x base), the machine (CPU model from /proc/cpuinfo), versions
and git revision.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from fivefold.finetune.inject import target_modules  # noqa: E402
from fivefold.host import cpu_model  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import preset  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.lora_batch import Adapter, apply_adapters, attach  # noqa: E402
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402
from fivefold.train.bench import git_revision, machine  # noqa: E402

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
NAMES = ("alpha", "beta", "gamma")


def random_adapters(model, rank: int, seed: int) -> list[Adapter]:
    g = torch.Generator().manual_seed(seed)
    adapters = []
    for name in NAMES:
        factors = {}
        for module in target_modules(model, TARGETS):
            linear = model.get_submodule(module)
            a = torch.randn(rank, linear.in_features, generator=g) * 0.02
            b = torch.randn(linear.out_features, rank, generator=g) * 0.02
            factors[module] = (a, b)
        adapters.append(Adapter(name, rank, 2.0, factors))
    return adapters


def workload(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (n,), generator=g).tolist()
    outputs = torch.randint(32, 97, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths], outputs


def run(engine: Engine, prompts, outputs, adapters) -> dict:
    cpu, start = time.process_time(), time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True,
                                             adapter=adapters[i % len(adapters)]))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-25m")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_lora.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    base = build_model(cfg, seed=args.seed).eval()
    served = copy.deepcopy(base)
    adapter_set = apply_adapters(served, random_adapters(base, args.rank, args.seed))
    prompts, outputs = workload(args.requests, cfg.vocab_size, args.seed)
    settings = dict(max_num_seqs=args.max_num_seqs, num_blocks=args.max_num_seqs * 16 + 64,
                    max_num_batched_tokens=4096, max_model_len=256, prepack=True)
    runs: dict[str, list[dict]] = {"base": [], "mixed": []}
    for _ in range(args.rounds):
        runs["base"].append(run(Engine(base, **settings), prompts, outputs, [None]))
        engine = Engine(served, **settings)
        attach(engine, adapter_set)
        runs["mixed"].append(run(engine, prompts, outputs, list(NAMES)))
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
    ratio = best["mixed"]["tokens_per_s"] / best["base"]["tokens_per_s"]
    cpu_ratio = max(r["tokens_per_cpu_s"] for r in runs["mixed"]) / max(
        r["tokens_per_cpu_s"] for r in runs["base"])
    info = {**machine(torch.device("cpu")), "cpu_model": cpu_model()}
    print(f"{info['cpu_model']}; torch {torch.__version__}; {args.threads} thread(s); "
          f"{cfg.name} fp32; {args.requests} requests, batch <= {args.max_num_seqs}; "
          f"3 adapters of rank {args.rank} on {TARGETS}")
    for name, r in best.items():
        print(f"{name:>6}: {r['tokens_per_s']:8.1f} tokens/s  {r['tokens_per_cpu_s']:8.1f} "
              f"tokens/CPU-s  ({r['tokens']} tokens in {r['seconds']:.1f} s)")
    print(f"three adapters mixed / base alone: {ratio:.2f}x tokens/s, {cpu_ratio:.2f}x per "
          f"CPU-second (goal >= 0.7x)")
    result = {"benchmark": "serve_lora", "model": cfg.name, "dtype": "fp32",
              "requests": args.requests, "max_num_seqs": args.max_num_seqs,
              "adapters": len(NAMES), "rank": args.rank, "targets": TARGETS,
              "threads": args.threads, "rounds": runs, "best": best,
              "tokens_per_s_ratio": ratio, "tokens_per_cpu_s_ratio": cpu_ratio,
              "machine": info, "git": git_revision(),
              "command": "python bench/serve/serve_lora.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
