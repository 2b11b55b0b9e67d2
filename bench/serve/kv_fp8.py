"""What the FP8 (e4m3) KV cache costs in quality, on trained checkpoints.

    python bench/serve/kv_fp8.py --checkpoint NAME=DIR [--checkpoint NAME=DIR ...]
        [--eval-tokens 8192] [--chunk 64] [--prompts 32] [--prompt-len 32] [--max-tokens 64]

For each checkpoint (a fivefold training run; its validation split is the text the run held
out), four KV caches: the model's dtype (fp32), bf16 (the rounding most servers accept
without a thought: a yardstick for the rest), FP8 with scales set on the fly by the first
write (what `fivefold serve --kv-cache-dtype fp8` does) and FP8 with scales calibrated on
the run's training split (`calibrate_kv_scales`, 8 windows). Measured:

- perplexity, teacher-forced through the paged cache: each window of the run's seq_len is
  fed in chunks of `--chunk` tokens; a chunk writes its keys and values into the cache and
  attends to the whole context read back from it, as serving's chunked prefill does, so
  every attention reads the stored (FP8: rounded) keys and values;
- greedy agreement: `--prompts` prompts of `--prompt-len` tokens from the validation split,
  `--max-tokens` greedy tokens each through the `Engine`: the share of sequences identical to
  the fp32 cache's, the share of tokens equal position by position, and the mean position of
  the first difference;
- blocks that a 64 MiB budget holds with each cache.

Prints a table and writes bench/results/kv_fp8.json with the machine (CPU model included),
versions and git revision.
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

from fivefold.data.dataset import default_corpus_tokens  # noqa: E402
from fivefold.evaluate.perplexity import checkpoint_validation, token_file  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.kv_cache import (  # noqa: E402
    FP8,
    PagedBatch,
    PagedKVCache,
    Prefill,
    calibrate_kv_scales,
)
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402
from fivefold.train.bench import cpu_model, git_revision, machine  # noqa: E402
from fivefold.train.checkpoint import load_model_for_inference, read_meta  # noqa: E402

BUDGET = 64 * 2**20


def step_dir(path: str) -> Path:
    p = Path(path)
    return p / (p / "latest").read_text().strip() if (p / "latest").is_file() else p


@torch.no_grad()
def paged_nll(model, tokens: torch.Tensor, seq_len: int, chunk: int, cache: PagedKVCache
              ) -> tuple[float, int]:
    """Summed NLL and target count over windows of seq_len + 1 tokens, each fed through the
    paged cache in chunks (block i of the cache holds the window's tokens 16 i ..)."""
    bs = cache.block_size
    total, count = 0.0, 0
    for start in range(0, tokens.numel() - seq_len - 1, seq_len):
        window = tokens[start:start + seq_len + 1]
        inputs, targets = window[:-1], window[1:]
        logits = []
        for begin in range(0, seq_len, chunk):
            end = min(begin + chunk, seq_len)
            blocks = torch.arange((end + bs - 1) // bs)
            context = None if begin == 0 else blocks
            cache.batch = PagedBatch(slot_mapping=torch.arange(begin, end),
                                     prefills=[Prefill(0, end - begin, begin, context)])
            try:
                logits.append(model(inputs[None, begin:end], cache=cache,
                                    positions=torch.arange(begin, end))[0].float())
            finally:
                cache.batch = None
        logits = torch.cat(logits)
        total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += targets.numel()
    return total, count


def make_cache(model, seq_len: int, kind: str, scales) -> PagedKVCache:
    cfg = model.cfg
    store = {"fp32": None, "bf16": torch.bfloat16}.get(kind, FP8)
    return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.dim_per_head,
                        (seq_len + 15) // 16, 16, torch.float32, "cpu", store,
                        scales if kind == "fp8-calibrated" else None)


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    equal = sum(x == y for a, b in zip(reference, other, strict=True)
                for x, y in zip(a, b, strict=False))
    first = []
    for a, b in zip(reference, other, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        first.append(diff)
    return {"sequences_identical": same / len(reference),
            "tokens_equal": equal / sum(len(a) for a in reference),
            "mean_first_difference": sum(first) / len(first)}


def run_checkpoint(name: str, directory: str, args) -> dict:
    path = step_dir(directory)
    model, cfg, _ = load_model_for_inference(str(path))
    model.eval()
    meta = read_meta(path)
    val, described, seq_len = checkpoint_validation(meta)
    val = torch.as_tensor(val[:args.eval_tokens + 1].astype("int64"))
    train_cfg = (meta.get("config") or {}).get("data") or {}
    train_tokens = token_file(train_cfg.get("path") or default_corpus_tokens(
        meta.get("tokenizer") or "byte"))
    calib = [train_tokens[i * seq_len:(i + 1) * seq_len].astype("int64").tolist()
             for i in range(8)]
    scales = calibrate_kv_scales(model, calib)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, val.numel() - args.prompt_len, (args.prompts,), generator=g)
    prompts = [val[s:s + args.prompt_len].tolist() for s in starts.tolist()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows, outputs = {}, {}
    for kind in ("fp32", "bf16", "fp8-on-the-fly", "fp8-calibrated"):
        t0 = time.perf_counter()
        cache = make_cache(model, seq_len, kind, scales)
        total, count = paged_nll(model, val, seq_len, args.chunk, cache)
        engine = Engine(model, kv_cache_bytes=BUDGET, max_num_seqs=args.prompts,
                        kv_cache_dtype={"fp32": "auto", "bf16": "bf16"}.get(kind, "fp8"),
                        kv_scales=scales if kind == "fp8-calibrated" else None)
        outputs[kind] = [o.token_ids for o in engine.generate(prompts, params)]
        loss = total / count
        rows[kind] = {"loss": loss, "perplexity": float(torch.tensor(loss).exp()),
                      "tokens": count, "blocks_in_64_mib": engine.num_blocks,
                      "kv_bytes_per_block": engine.cache.nbytes // engine.num_blocks,
                      "seconds": time.perf_counter() - t0}
        if kind != "fp32":
            rows[kind]["greedy"] = agreement(outputs["fp32"], outputs[kind])
            rows[kind]["perplexity_change"] = rows[kind]["perplexity"] / \
                rows["fp32"]["perplexity"] - 1
        print(f"{name:>14} {kind:>15}: perplexity {rows[kind]['perplexity']:.4f} "
              f"({count} tokens), blocks in 64 MiB {engine.num_blocks}"
              + (f", greedy sequences identical {rows[kind]['greedy']['sequences_identical']:.2%}"
                 f", tokens equal {rows[kind]['greedy']['tokens_equal']:.2%}"
                 if kind != "fp32" else ""), flush=True)
    return {"checkpoint": f"{name}/{path.name}", "model": cfg.name, "parameters": model.num_params()
            if hasattr(model, "num_params") else sum(p.numel() for p in model.parameters()),
            "train_steps": meta.get("step"),
            "eval": {"data": described.replace(str(Path.home()), "~"), "seq_len": seq_len,
                                                      "chunk": args.chunk},
            "greedy_workload": {"prompts": args.prompts, "prompt_len": args.prompt_len,
                                "max_tokens": args.max_tokens},
            "calibration": {"windows": len(calib), "seq_len": seq_len,
                            "data": "training split start"},
            "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", action="append", required=True, help="NAME=DIR")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench/results/kv_fp8.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the other checkpoints' results already in --out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    if args.merge and Path(args.out).is_file():
        results = json.loads(Path(args.out).read_text())["results"]
    for item in args.checkpoint:
        name, _, directory = item.partition("=")
        results[name] = run_checkpoint(name, directory, args)
    info = machine(torch.device("cpu"))
    info["cpu_model"] = cpu_model()
    report = {"machine": info, "git_revision": git_revision(),
              "args": {**{k: v for k, v in vars(args).items() if k not in ("out", "merge")},
                       "checkpoint": list(results)},
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
