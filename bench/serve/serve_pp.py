"""Pipeline-parallel serving against one rank on this machine: tokens/s of `--pp N` (serve/
pp_worker.py, N gloo ranks of one thread each), of `--pp N --tp M` (N stages of M
tensor-parallel ranks) and of one engine (one thread), same requests, same weights.

    python bench/serve/serve_pp.py [--pp 2] [--tp 2] [--rounds 3] [--requests 32]

Greedy requests, prompts of 16-128 tokens and 32 output tokens each, all at t = 0; each
layout runs once a round, in turn, and the medians count. Prints each rate, its ratio to
pp 1 and whether the greedy tokens agree; JSON in
bench/results/serve_pp.json with the machine, versions and git revision. With one thread a
rank, N·M ranks use N·M cores where pp 1 uses one: the ratio is what the layout buys on
this machine, not a per-core figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _worker(rank: int, name: str, pp: int, tp: int) -> None:
    from fivefold.serve import pp_worker
    from fivefold.serve.tp_worker import shard_model

    torch.set_num_threads(1)
    model = build_model(preset(name), seed=0).eval()
    groups = pp_worker.pp_groups(pp, tp)
    pp_worker.run_worker(shard_model(model, groups) if tp > 1 else model, pp, groups)


def run_layout(model, name: str, pp: int, tp: int, prompts, output: int):
    """One pp · tp world (ranks 1.. spawned), the same requests; the world torn down."""
    import torch.distributed as dist

    from fivefold.serve import pp_worker
    from fivefold.serve.tp_worker import shard_model, start_world

    procs = start_world(pp * tp, "gloo", _worker, (name, pp, tp))
    groups = pp_worker.pp_groups(pp, tp)
    model = build_model(model.cfg, seed=0).eval()  # a fresh copy: the stage frees the rest
    if tp > 1:
        model = shard_model(model, groups)
    engine = pp_worker.driver_engine(model, pp, groups, kv_cache_bytes=BLOCKS_BUDGET,
                                     max_model_len=256)
    result, tokens = run(engine, prompts, output)
    pp_worker.send_object(None, groups.control)
    for proc in procs:
        proc.join(timeout=30)
    dist.destroy_process_group()
    return result, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2, help="also pp x tp ranks (1: pp alone)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="each layout once a round, in turn; "
                    "the medians are reported (a shared machine's load drifts)")
    ap.add_argument("--preset", default="llama-25m")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_pp.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = preset(args.preset)
    model = build_model(cfg, seed=0).eval()
    prompts = workload(args.requests, cfg.vocab_size)
    layouts = [(1, 1), (args.pp, 1)] + ([(args.pp, args.tp)] if args.tp > 1 else [])
    runs = {layout: [] for layout in layouts}
    same = {layout: [] for layout in layouts}
    print(f"{cfg.name} fp32, {args.requests} requests (prompts 16-128, {args.output} output "
          f"tokens), one thread a rank, {args.rounds} rounds")
    for r in range(args.rounds):
        for pp, tp in layouts:
            if pp == 1:
                engine = Engine(model, kv_cache_bytes=BLOCKS_BUDGET, max_model_len=256)
                result, tokens = run(engine, prompts, args.output)
                reference = tokens
            else:
                result, tokens = run_layout(model, args.preset, pp, tp, prompts, args.output)
            runs[(pp, tp)].append(result)
            same[(pp, tp)].append(sum(a == b for a, b in zip(reference, tokens)))
        print(f"round {r + 1}: " + ", ".join(
            f"{_label(pp, tp)} {runs[(pp, tp)][-1]['tokens_per_s']:.1f}"
            for pp, tp in layouts) + f" tokens/s (load average {os.getloadavg()[0]:.1f})")
    median = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    result = {"benchmark": "serve_pp", "model": cfg.name, "requests": args.requests,
              "output_tokens": args.output, "threads_per_rank": 1, "rounds": args.rounds,
              "layouts": []}
    for pp, tp in layouts:
        ratio = median[(pp, tp)] / median[(1, 1)]
        if pp > 1:
            print(f"{_label(pp, tp)} ({pp * tp} ranks): median {median[(pp, tp)]:.1f} "
                  f"tokens/s, {ratio:.2f}x pp 1 ({median[(1, 1)]:.1f}); identical greedy "
                  f"outputs {min(same[(pp, tp)])}/{args.requests} in every round")
        result["layouts"].append({
            "pp": pp, "tp": tp, "ranks": pp * tp, "median_tokens_per_s": median[(pp, tp)],
            "tokens_per_s_ratio": ratio, "runs": runs[(pp, tp)],
            "identical_greedy_outputs": min(same[(pp, tp)])})
    info = machine(torch.device("cpu"))
    info["cpu_model"] = cpu_model()
    info["load_average"] = list(os.getloadavg())
    result.update(machine=info, git=git_revision(),
                  command="python bench/serve/serve_pp.py " + " ".join(argv or sys.argv[1:]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


def _label(pp: int, tp: int) -> str:
    return f"pp {pp}" + (f" x tp {tp}" if tp > 1 else "")


if __name__ == "__main__":
    sys.exit(main())
