"""Pipeline-parallel serving against one rank on this machine: tokens/s of `--pp N` (serve/
pp_worker.py, N gloo ranks of one thread each) and of one engine (one thread), same
requests, same weights.

    python bench/serve/serve_pp.py [--pp 2] [--requests 32] [--preset llama-25m]

Greedy requests, prompts of 16-128 tokens and 32 output tokens each, all at t = 0. Prints
both rates, their ratio and whether the greedy tokens agree; JSON in
bench/results/serve_pp.json with the machine, versions and git revision. With one thread a
rank, pp N uses N cores where pp 1 uses one: the ratio is what the stages' overlap buys on
this machine, not a per-core figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import preset  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402
from fivefold.train.bench import cpu_model, git_revision, machine  # noqa: E402

BLOCKS_BUDGET = 2**28  # 256 MiB of K/V per rank


def workload(n: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 129, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]


def run(engine, prompts, output: int):
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    return {"seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
            "steps": engine.num_steps}, tokens


def _worker(rank: int, name: str, pp: int) -> None:
    from fivefold.serve import pp_worker

    torch.set_num_threads(1)
    model = build_model(preset(name), seed=0).eval()
    pp_worker.run_worker(model, pp, pp_worker.pp_groups(pp))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--preset", default="llama-25m")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_pp.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = preset(args.preset)
    model = build_model(cfg, seed=0).eval()
    prompts = workload(args.requests, cfg.vocab_size)
    one, one_tokens = run(Engine(model, kv_cache_bytes=BLOCKS_BUDGET, max_model_len=256),
                          prompts, args.output)

    from fivefold.serve import pp_worker
    from fivefold.serve.tp_worker import start_world

    procs = start_world(args.pp, "gloo", _worker, (args.preset, args.pp))
    groups = pp_worker.pp_groups(args.pp)
    engine = pp_worker.driver_engine(model, args.pp, groups, kv_cache_bytes=BLOCKS_BUDGET,
                                     max_model_len=256)
    many, many_tokens = run(engine, prompts, args.output)
    pp_worker.send_object(None, groups[1])
    for proc in procs:
        proc.join(timeout=30)
    same = sum(a == b for a, b in zip(one_tokens, many_tokens))
    ratio = many["tokens_per_s"] / one["tokens_per_s"]
    print(f"{cfg.name} fp32, {args.requests} requests (prompts 16-128, {args.output} output "
          f"tokens): pp 1 {one['tokens_per_s']:.1f} tokens/s, pp {args.pp} "
          f"{many['tokens_per_s']:.1f} tokens/s: {ratio:.2f}x; identical greedy outputs "
          f"{same}/{args.requests}")
    info = machine(torch.device("cpu"))
    info["cpu_model"] = cpu_model()
    result = {"benchmark": "serve_pp", "model": cfg.name, "pp": args.pp,
              "requests": args.requests, "output_tokens": args.output,
              "threads_per_rank": 1, "pp1": one, f"pp{args.pp}": many,
              "tokens_per_s_ratio": ratio, "identical_greedy_outputs": same,
              "machine": info, "git": git_revision(),
              "command": "python bench/serve/serve_pp.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
