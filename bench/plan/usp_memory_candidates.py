"""Candidate memory terms for the nanotron convention, each judged the honest way.

    python bench/plan/usp_memory_candidates.py     # a few minutes; prints the table, writes
                                                   # bench/results/usp_memory_candidates.json

For each candidate the memory factors (`usp_fit.MEMORY_FITTED`, plus the candidate's own
coefficient where it has one) and the headroom are refitted on the 16-GPU runs and judged on
the 128-GPU runs, and the other way, as bench/plan/usp_calibration.py does for the
convention; the time factors play no part in memory. A candidate is a change to rank 0's
planned items, applied to the nanotron convention only (the engine's convention and its
agreement tests see none of them):

- `baseline`: the convention as it is (the head's reserve given back at the limit,
  `allocator.released_cache`);
- `sp_saved_full`: REDUCE_SCATTER linears save the all-gathered input, not the shard;
- `grads_freed`: nanotron's FP32GradientAccumulator sets each bf16 `.grad` to None after
  accumulating it (optim/gradient_accumulator.py), so the bf16 gradients and the saved
  activations never coexist: max(grads, activations + loss) instead of their sum;
- `layer_tokens`: a fitted number of bytes per token, hidden unit, layer and micro-batch in
  flight, whatever tp is (a tensor tp does not shard);
- `embed_tokens`: a fitted number of bytes per token and hidden unit on a first stage
  without the head (the embedding's full-width output and gradient);
- `pipeline_reserve`: a fitted reserve per byte of activations on ranks that keep more than
  one micro-batch (1F1B frees activations out of the order it allocated them);
- `live_blocks`: a fitted number of MiB per live activation block (the caching allocator's
  segments pinned by a live block, as opposed to a share of the bytes);
- `inflight_tokens`: a fitted number of bytes per token, hidden unit and layer for every
  micro-batch in flight beyond the first (a pipeline rank's blocks that 1F1B's interleaved
  forwards and backwards pin; nothing at pp 1, where the head's reserve stands);
- `inflight_gathered`: the same, times 1 − 1/tp: blocks the size of a REDUCE_SCATTER
  linear's all-gathered input (freed after the linear, then split to hold the next
  micro-batch's sharded tensors, so the next gather needs a new segment);
- `ddp_buckets`: torch's DistributedDataParallel, which nanotron wraps the model in when
  dp > 1, keeps its gradient buckets as a copy of the gradients (`gradient_as_bucket_view`
  off by default, torch/nn/parallel/distributed.py): 2 more bytes per parameter on the
  rank, argued, not fitted;
- `p2p_storage`: nanotron's pipeline point-to-point (parallel/pipeline_parallel/p2p.py
  @3024b46): the sender passes its tensor's untyped storage size and the receiver allocates
  that many bytes (`P2PTensorMetaData.create_empty_storage`), so a view sent costs its
  whole storage. What is sent is a block's output, `hidden_states + residual` (a fresh
  tensor: storage = size), and its gradient, fresh from autograd; a first stage receives
  gradients only. Argued, not fitted: on a rank that sends forward, one boundary tensor (the
  output queued in `PipelineTrainBatchState.microbatches_activations_to_send` until the
  backward's `run_communication`, then the gradient received in its place); on a rank that
  receives, the received `sequence_mask` (one byte per token) per micro-batch in flight (the
  hidden states received are the first layer's saved input, already planned);
- `segment_tails`: the caching allocator's rounding per saved block instead of 1 MiB per
  block of 1 MiB or more (c10/cuda/CUDACachingAllocator.cpp: requests rounded to 512 bytes;
  up to 1 MiB served from 2 MiB segments, up to 10 MiB from 20 MiB segments, larger ones
  from their own segment rounded to 2 MiB): a block of v bytes wastes its share of the tail
  its segment leaves when filled with blocks of its size, (S mod v) / floor(S / v), or
  ceil(v / 2 MiB)·2 MiB − v from 10 MiB on. Argued, not fitted: the per-micro-batch blocks
  at large tp × pp are a few MiB, where a 20 MiB segment's tail is the largest share;
- `replayed_waste`: on a first stage with pp > 1, the reserved bytes beyond the allocated
  peak of a replay of its allocations through the caching allocator's rules
  (bench/plan/usp_allocator_replay.py) in place of the plan's rounding. Argued, not fitted;
- `reserve_released`: all the fitted reserves (the activation reserve too, not only the
  head's) are cached blocks the allocator releases before it fails (CUDACachingAllocator
  frees cached blocks and retries a failed cudaMalloc), so the planned reserved peak never
  passes the usable memory and a run fits if the rest does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
from pathlib import Path

import usp_allocator_replay
import usp_calibration as uc
import usp_fit as uf

import fivefold.plan.memory as memory
from fivefold.plan import conventions
from fivefold.plan.hardware import GIB, get_hardware
from fivefold.plan.layout import check_layout
from fivefold.plan.model_states import rank_param_counts
from fivefold.plan.placement import inflight_microbatches, stage
from fivefold.plan.torch_pipelining import stage_boundary_bytes

OUT = uc.ROOT / "bench" / "results" / "usp_memory_candidates.json"
MIB = 2**20
ORIGINAL = memory.memory_items


def _tokens_h(work, layout) -> float:
    return layout.mbs * work.seq_len / layout.cp * work.model.hidden_size


def _layer_tokens(work, layout, rank, items):
    n = inflight_microbatches(layout, work.num_microbatches(layout), rank)
    return n * stage(work.model, layout, rank)[0] * _tokens_h(work, layout)


def _embed_tokens(work, layout, rank, items):
    _, embed, head = stage(work.model, layout, rank)
    return float(embed and not head) * _tokens_h(work, layout)


def _pipeline_reserve(work, layout, rank, items):
    n = inflight_microbatches(layout, work.num_microbatches(layout), rank)
    return items["activations"] * (n - 1) / n


def _live_blocks(work, layout, rank, items):
    act = memory._activations(work, layout)
    n = inflight_microbatches(layout, work.num_microbatches(layout), rank)
    return sum(1 for v in act.layer_terms.values() if v > 0) * n * stage(
        work.model, layout, rank)[0] * MIB


def _inflight_tokens(work, layout, rank, items):
    n = inflight_microbatches(layout, work.num_microbatches(layout), rank)
    return max(n - 1, 0) * stage(work.model, layout, rank)[0] * _tokens_h(work, layout)


def _inflight_gathered(work, layout, rank, items):
    return _inflight_tokens(work, layout, rank, items) * (1 - 1 / layout.tp)


def _p2p_storage(work, layout, rank):
    """nanotron's pipeline p2p buffers on `rank` beyond the planned items (argued)."""
    if layout.pp == 1:
        return 0.0
    extra = 0.0
    if rank < layout.pp - 1:  # the output queued for sending, then the gradient received
        extra += stage_boundary_bytes(work, layout)
    if rank > 0:  # the sequence mask received with each micro-batch in flight
        n = inflight_microbatches(layout, work.num_microbatches(layout), rank)
        extra += n * layout.mbs * work.seq_len / layout.cp
    return extra


def _block_waste(v: float) -> float:
    """Reserved minus requested for one live block of `v` bytes whose segment is filled with
    blocks of its size (PyTorch's caching allocator rules, in `segment_tails` above)."""
    if v <= 0:
        return 0.0
    v = -(-v // 512) * 512
    if v >= 10 * MIB:
        return -(-v // (2 * MIB)) * 2 * MIB - v
    seg = 2 * MIB if v <= MIB else 20 * MIB
    return (seg % v) / (seg // v)


def _layer_blocks(act) -> list[float]:
    """A layer's saved tensors as allocated blocks: the SwiGLU MLP's saved bytes are the
    merged gate-up output (half) and two intermediate-sized tensors."""
    blocks = []
    for name, v in act.layer_terms.items():
        if name == "mlp_hidden":
            blocks += [v / 2, v / 4, v / 4]
        else:
            blocks.append(v)
    return blocks


def _segment_tails(work, layout, rank):
    """This rounding less the convention's (1 MiB per layer block of 1 MiB or more)."""
    act = memory._activations(work, layout)
    n = inflight_microbatches(layout, work.num_microbatches(layout), rank)
    layer_microbatches = n * stage(work.model, layout, rank)[0]
    now = sum(1 for v in act.layer_terms.values() if v >= MIB) * MIB
    return layer_microbatches * (sum(_block_waste(v) for v in _layer_blocks(act)) - now)


REPLAYED: dict[str, float] = {}


def _replayed(work, layout) -> float:
    key = repr((work, layout))
    if key not in REPLAYED:
        REPLAYED[key] = usp_allocator_replay.replay(work, layout, 40)["waste_gib"] * GIB
    return REPLAYED[key]


def _replayed_waste(work, layout, rank):
    """bench/plan/usp_allocator_replay.py's waste on a first stage with pp > 1 in place of
    the plan's 1 MiB per live block (argued: no factor; other ranks unchanged)."""
    if layout.pp == 1 or rank != 0:
        return 0.0
    act = memory._activations(work, layout)
    n = inflight_microbatches(layout, work.num_microbatches(layout), rank)
    now = sum(1 for v in act.layer_terms.values() if v >= MIB) * MIB
    return _replayed(work, layout) - n * stage(work.model, layout, rank)[0] * now


ARGUED = {"p2p_storage": _p2p_storage, "segment_tails": _segment_tails,
          "replayed_waste": _replayed_waste}


COLUMNS = {"layer_tokens": _layer_tokens, "embed_tokens": _embed_tokens,
           "pipeline_reserve": _pipeline_reserve, "live_blocks": _live_blocks,
           "inflight_tokens": _inflight_tokens, "inflight_gathered": _inflight_gathered}


class Candidate:
    """One change to the nanotron convention's items: an extra fitted column, a rule."""

    def __init__(self, name: str):
        self.name, self.coef = name, 0.0

    def items(self, work, layout, assume, rank=0, act=None, limit=None):
        items, cpu = ORIGINAL(work, layout, assume, rank, act, limit)
        if not (work.fp32_grad_accum and work.softmax_loss):  # nanotron's alone
            return items, cpu
        items = dict(items)
        if self.name == "grads_freed":
            items["grads"] = max(0.0, items["grads"] - items["activations"]
                                 - items["logits_loss"])
        elif self.name == "ddp_buckets":
            if layout.dp * layout.cp > 1:
                items["comm_buffers"] += rank_param_counts(work.model, layout, rank)[
                    "dense"] * work.dtype_bytes
        elif self.name in ARGUED:
            items["overhead"] += ARGUED[self.name](work, layout, rank)
        elif self.name in COLUMNS:
            items["overhead"] += self.coef * COLUMNS[self.name](work, layout, rank, items)
        elif self.name == "reserve_released":
            head = stage(work.model, layout, rank)[2]
            fitted = (assume.activation_reserve * items["activations"]
                      + assume.loss_reserve * items["logits_loss"]
                      + head * assume.head_token_bytes * _tokens_h(work, layout))
            rest = sum(items.values()) - fitted
            room = (uc.HW["memory_gib"] - assume.memory_headroom_gib) * GIB - rest
            items["overhead"] -= fitted - max(0.0, min(fitted, room))
        return items, cpu

    def install(self):
        memory.memory_items = uc.memory_items = uf.memory_items = self.items


def fit(rows: list[dict], cand: Candidate) -> dict:
    """usp_fit.fit's memory part, with the candidate's column beside the convention's, then
    the headroom that makes the most verdicts right (each headroom planned anew: a candidate
    may depend on it)."""
    zero = {k: 0.0 for k in uf.FITTED}
    cand.coef = 0.0
    names = list(uf.MEMORY_FITTED) + ([cand.name] if cand.name in COLUMNS else [])
    columns, target = [], []
    for row in rows:
        if row["status"] != "ok":
            continue
        work, layout = uc.workload_layout(row)
        if check_layout(work, layout):
            continue
        _, assume = get_hardware("h100-sxm", zero)
        items, _ = memory.memory_items(work, layout, assume, 0)
        measured = float(row["gpu_memory_GB"]) * GIB
        unit, _ = memory.memory_items(work, layout, dataclasses.replace(
            assume, head_token_bytes=1.0), 0)
        column = {"activation_reserve": items["activations"],
                  "loss_reserve": items["logits_loss"],
                  "head_token_bytes": unit["overhead"] - items["overhead"]}
        if cand.name in COLUMNS:
            column[cand.name] = COLUMNS[cand.name](work, layout, 0, items)
        columns.append([column[k] / measured for k in names])
        target.append((measured - sum(items.values()) + assume.context_gib * GIB) / measured)
    coef = dict(zip(names, uf._nonnegative_lad(columns, target)))
    cand.coef = coef.pop(cand.name, 0.0)
    best = None
    for h in uf.HEADROOM_GRID:
        preds = uc.run(rows, "nanotron", {**uc.HW, **coef, "memory_headroom_gib": h})
        right = sum(p["fits"] == (r["status"] == "ok") for r, p in zip(rows, preds))
        if best is None or right > best[0]:
            best = (right, h)
    return {**coef, "memory_headroom_gib": best[1], "candidate_coefficient": cand.coef}


def judge(rows: list[dict], cand: Candidate, factors: dict) -> dict:
    cand.coef = factors["candidate_coefficient"]
    overrides = {k: v for k, v in factors.items() if k != "candidate_coefficient"}
    s = uc.score(rows, uc.run(rows, "nanotron", {**uc.HW, **overrides}))
    return {k: s[k] for k in ("memory_median_abs_error", "memory_within_10pct",
                              "memory_median_signed_error", "fits_right")}


def ceiling(rows: list[dict]) -> dict:
    """The most runs of each half within 10% that the convention's two main memory factors
    can reach, chosen on a grid (activation_reserve 0 to 0.6 by 0.025, head_token_bytes 0 to
    160 by 4) on that half itself: the best any refit of those two terms could do."""
    zero = {k: 0.0 for k in uf.FITTED}
    parts = {"16": [], "128": []}
    for row in rows:
        work, layout = uc.workload_layout(row)
        if row["status"] != "ok" or check_layout(work, layout):
            continue
        _, assume = get_hardware("h100-sxm", zero)
        items, _ = ORIGINAL(work, layout, assume, 0)
        unit, _ = ORIGINAL(work, layout, dataclasses.replace(assume, head_token_bytes=1.0), 0)
        parts[row["n_gpus"]].append((sum(items.values()) - assume.context_gib * GIB,
                                     items["activations"], unit["overhead"] - items["overhead"],
                                     float(row["gpu_memory_GB"]) * GIB))
    out = {}
    for half, runs in parts.items():
        best = (0.0, 0.0, 0.0)
        for i in range(25):
            for j in range(41):
                a, h = i * 0.025, j * 4.0
                share = sum(abs((b + a * act + h * tok) / m - 1) <= 0.10
                            for b, act, tok, m in runs) / len(runs)
                best = max(best, (share, a, h))
        out[half] = {"within_10pct": best[0], "activation_reserve": best[1],
                     "head_token_bytes": best[2]}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these candidates alone "
                    "(and the baseline); the ceiling is computed either way")
    args = ap.parse_args(argv)
    rows = uc.load()
    split = uc.halves(rows)
    names = ("baseline", "sp_saved_full", "grads_freed", *COLUMNS, "ddp_buckets",
             *ARGUED, "reserve_released")
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            print(f"usp_memory_candidates.py: no candidate {', '.join(unknown)} "
                  f"(candidates: {', '.join(names)})", file=sys.stderr)
            raise SystemExit(2)
        names = ("baseline", *[n for n in names if n in args.only and n != "baseline"])
    nanotron = conventions.CONVENTIONS["nanotron"]
    result = {}
    print("candidate: fitted on 16 judged on 128 | fitted on 128 judged on 16 "
          "(memory median error, within 10%, fits right)")
    for name in names:
        cand = Candidate(name)
        cand.install()
        if name == "sp_saved_full":
            conventions.CONVENTIONS["nanotron"] = dataclasses.replace(
                nanotron, layout={**nanotron.layout, "sp_saved": "full"})
        out = {}
        for train, test in (("16", "128"), ("128", "16")):
            factors = fit(split[train], cand)
            out[f"fit_{train}_judge_{test}"] = {"factors": factors,
                                               **judge(split[test], cand, factors)}
        conventions.CONVENTIONS["nanotron"] = nanotron
        result[name] = out
        print(f"{name:<17} " + " | ".join(
            f"{s['memory_median_abs_error']:.1%} {s['memory_within_10pct']:.0%} "
            f"{s['fits_right']:.1%}" for s in out.values()))
    memory.memory_items = uc.memory_items = uf.memory_items = ORIGINAL
    top = ceiling(rows)
    for half, c in top.items():
        print(f"ceiling on {half} GPUs, the two factors chosen on that half itself: "
              f"{c['within_10pct']:.0%} within 10% (activation_reserve "
              f"{c['activation_reserve']:.3g}, head_token_bytes {c['head_token_bytes']:.3g})")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=uc.ROOT).stdout.strip()
    args.out.write_text(json.dumps({
        "machine": {"host": platform.node(), "cpu": uc._cpu_model(),
                    "python": platform.python_version()},
        "git": rev, "data": "bench/data/usp-calibration.csv", "candidates": result,
        "ceiling": top},
        indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
