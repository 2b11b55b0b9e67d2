"""A replay of a nanotron first pipeline stage's allocations through PyTorch's caching
allocator rules: does fragmentation explain what the planner misses at large tp x pp?

    python bench/plan/usp_allocator_replay.py     # about a minute; prints the table, writes
                                                  # bench/results/usp_allocator_replay.json

The planner models the caching allocator by a share (plan/allocator.py: 1 MiB per live
saved block of 1 MiB or more, the largest transient freed before the peak, and the fitted
`activation_reserve`). Here the allocations themselves are replayed, for rank 0 of every
run of bench/data/usp-calibration.csv with pp > 1 (the first stage: no head), and the
reserved bytes beyond the allocated ones at the reserved peak are set beside what the run
logged beyond the planned bytes (the memory factors at 0).

The allocator (c10/cuda/CUDACachingAllocator.cpp, defaults: no max_split_size, no
expandable segments, one stream): a request is rounded up to 512 bytes; requests over 1 MiB
come from the large pool, served best-fit (the smallest cached free block that holds it),
split when more than 1 MiB is left; failing that, a new segment of 20 MiB (requests under
10 MiB) or the request rounded up to 2 MiB; a freed block merges with its free neighbours
in its segment; segments are never returned (the runs' peaks are far from the limit).
Requests of 1 MiB or less (the small pool) are left out: their segments are 2 MiB.

The trace (nanotron's Llama under tp_mode REDUCE_SCATTER, flash attention, no
recomputation; models/llama.py, parallel/tensor_parallel): per layer and micro-batch, the
tensors the plan saves (plan/activations.py's layer terms: the layer input and the two
norms' outputs as sequence shards T·h/tp, q, k, v, the attention output, the MLP's merged
gate-up output and two intermediate-sized tensors) in forward order, with the transients
between them: each column linear's all-gathered input (T·h, in one buffer kept for the
run, `Stage.gathered`), the fused qkv output (freed after the q, k, v copies), each row
linear's full-width output (T·h, freed after its reduce-scatter), the residual sums. At
tp 1 there is no collective and none of the full-width buffers. Backward, layer by layer
in reverse: the gathered output gradient of each row linear, the full-width input gradient
of each column linear before its reduce-scatter, its input gathered again for its weight
gradient (tp_recompute_allgather, into the kept buffer), each weight's bf16 gradient
(freed when the fp32 accumulator takes it: optim/gradient_accumulator.py), the input
gradients, then the layer's saved tensors freed. The schedule is nanotron's 1F1B
(parallel/pipeline_parallel/engine.py): pp − 1 warm-up forwards whose outputs are sent at
once, then one forward (its output kept until the next backward's communication) before
each backward, then the rest of the backwards; each backward starts with the received
gradient. At most `--max-microbatches` micro-batches are replayed (the peak of a 1F1B
stage is reached within the first pp backwards; the cap is printed).

A variant (`lag_waste_gib`) holds every transient buffer a collective wrote or read until
the next host sync, as the caching allocator does under record_stream while the host runs
ahead of the GPU: the host syncs at each pipeline message, whose metadata it copies from
pageable memory and reads back (parallel/pipeline_parallel/p2p.py `_send_meta`,
`_recv_meta`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import usp_calibration as uc
import usp_fit as uf

import fivefold.plan.memory as memory
from fivefold.plan.activations import kv_heads_per_rank
from fivefold.plan.hardware import GIB, get_hardware
from fivefold.plan.layout import check_layout
from fivefold.plan.placement import inflight_microbatches, stage

OUT = uc.ROOT / "bench" / "results" / "usp_allocator_replay.json"
MIB = 2**20


class CachingAllocator:
    """The large pool of PyTorch's CUDA caching allocator (rules in the module docstring)."""

    def __init__(self):
        self.free: list[tuple[int, int, int]] = []  # (size, segment, offset), sorted
        self.blocks: list[dict[int, list]] = []  # per segment: offset -> [size, is_free]
        self.live: dict[int, tuple[int, int, int]] = {}  # handle -> (segment, offset, size)
        self.reserved = self.allocated = 0
        self.peak_reserved = self.allocated_at_peak = self.peak_allocated = 0
        self.next_handle = 0
        self.lagging = False  # NCCL's buffers wait for the next host sync (--nccl-lag)
        self.deferred: list[int] = []

    def nccl_release(self, handle: int | None) -> None:
        """Free a buffer a collective wrote or read: at once, or (lagging) at the next host
        sync, as record_stream holds it until the host sees the collective's event pass."""
        if self.lagging:
            self.deferred.append(handle)
        else:
            self.release(handle)

    def sync(self) -> None:
        for handle in self.deferred:
            self.release(handle)
        self.deferred.clear()

    def malloc(self, nbytes: float) -> int | None:
        size = -(-int(nbytes) // 512) * 512
        if size <= MIB:
            return None
        i = bisect.bisect_left(self.free, (size, -1, -1))
        if i < len(self.free):
            bsize, seg, off = self.free.pop(i)
        else:
            bsize = 20 * MIB if size < 10 * MIB else -(-size // (2 * MIB)) * 2 * MIB
            seg, off = len(self.blocks), 0
            self.blocks.append({0: [bsize, True]})
            self.reserved += bsize
        blocks = self.blocks[seg]
        if bsize - size > MIB:  # split: the rest stays cached
            blocks[off] = [size, False]
            blocks[off + size] = [bsize - size, True]
            bisect.insort(self.free, (bsize - size, seg, off + size))
        else:
            blocks[off] = [bsize, False]
            size = bsize
        self.next_handle += 1
        self.live[self.next_handle] = (seg, off, size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        if self.reserved > self.peak_reserved or (
                self.reserved == self.peak_reserved and self.allocated > self.allocated_at_peak):
            self.peak_reserved, self.allocated_at_peak = self.reserved, self.allocated
        return self.next_handle

    def release(self, handle: int | None) -> None:
        if handle is None:
            return
        seg, off, size = self.live.pop(handle)
        self.allocated -= size
        blocks = self.blocks[seg]
        offsets = sorted(blocks)
        k = offsets.index(off)
        start, total = off, size
        if k + 1 < len(offsets) and blocks[offsets[k + 1]][1]:  # merge with the next
            nxt = offsets[k + 1]
            self.free.remove((blocks[nxt][0], seg, nxt))
            total += blocks.pop(nxt)[0]
        if k > 0 and blocks[offsets[k - 1]][1]:  # and the previous
            prev = offsets[k - 1]
            self.free.remove((blocks[prev][0], seg, prev))
            start, total = prev, total + blocks[prev][0]
            del blocks[off]
        blocks[start] = [total, True]
        bisect.insort(self.free, (total, seg, start))


class Stage:
    """Rank 0's tensors for one micro-batch (bytes, by the names of the module docstring)."""

    def __init__(self, work, layout):
        mc = work.model
        T = layout.mbs * work.seq_len / layout.cp
        B, tp, h = work.dtype_bytes, layout.tp, mc.hidden_size
        d = mc.dim_per_head
        self.q = T * mc.num_heads * d / tp * B
        self.kv = T * kv_heads_per_rank(mc, tp) * d * B
        self.f = T * mc.intermediate_size / tp * B
        self.shard = T * h / tp * B
        self.full = T * h * B if tp > 1 else 0.0  # no collective (nor its buffer) at tp 1
        # the layer's weights on this rank, bf16 gradients: qkv, o, gate-up, down
        q_w, kv_w = mc.num_heads * d / tp, kv_heads_per_rank(mc, tp) * d
        self.weights = [h * (q_w + 2 * kv_w) * B, q_w * h * B,
                        2 * h * mc.intermediate_size / tp * B, mc.intermediate_size / tp * h * B]
        self.embedding_grad = -(-mc.vocab_size // tp) * h * B
        self.layers = stage(mc, layout, 0)[0]
        self.gather_buffer: int | None = None

    def gathered(self, a: CachingAllocator) -> None:
        """A column linear's all-gathered input: nanotron's `MemoryBuffer().get("allgather",
        ...)` (tp_recompute_allgather, its default; parallel/tensor_parallel/functional.py),
        one buffer kept for the run and reused by every gather, forward and backward."""
        if self.gather_buffer is None and self.full:
            self.gather_buffer = a.malloc(self.full)

    def forward(self, a: CachingAllocator, x: int | None) -> tuple[list, int | None]:
        """One micro-batch's forward; returns its saved handles and its output."""
        saved = []
        for _ in range(self.layers):
            n1 = a.malloc(self.shard)
            self.gathered(a)
            qkv = a.malloc(self.q + 2 * self.kv)
            q, k, v = a.malloc(self.q), a.malloc(self.kv), a.malloc(self.kv)
            a.release(qkv)
            core = a.malloc(self.q)
            o_full = a.malloc(self.full)
            o_shard = a.malloc(self.shard)
            a.nccl_release(o_full)
            x2 = a.malloc(self.shard)
            a.release(o_shard)
            n2 = a.malloc(self.shard)
            self.gathered(a)
            gu = a.malloc(2 * self.f)
            act, prod = a.malloc(self.f), a.malloc(self.f)
            d_full = a.malloc(self.full)
            d_shard = a.malloc(self.shard)
            a.nccl_release(d_full)
            out = a.malloc(self.shard)
            a.release(d_shard)
            saved.append([x, n1, q, k, v, core, x2, n2, gu, act, prod])
            x = out
        return saved, x

    def backward(self, a: CachingAllocator, saved: list, dy: int | None) -> None:
        w_qkv, w_o, w_gu, w_down = self.weights
        for x, n1, q, k, v, core, x2, n2, gu, act, prod in reversed(saved):
            g = a.malloc(self.full)  # down (row linear): the gathered output gradient
            d_prod = a.malloc(self.f)
            a.release(a.malloc(w_down))
            a.nccl_release(g)
            d_act, d_gu = a.malloc(self.f), a.malloc(2 * self.f)
            a.release(d_prod)
            a.release(d_act)
            g = a.malloc(self.full)  # gate-up (column linear): input gradient, reduce-scattered
            d_n2 = a.malloc(self.shard)
            a.nccl_release(g)
            self.gathered(a)  # its input gathered again for the weight gradient
            a.release(a.malloc(w_gu))
            a.release(d_gu)
            for t in (act, prod, gu, n2):
                a.release(t)
            d_x2 = a.malloc(self.shard)  # the norm's gradient plus the residual's
            a.release(d_n2)
            a.release(dy)
            a.release(x2)
            g = a.malloc(self.full)  # o (row linear)
            d_core = a.malloc(self.q)
            a.release(a.malloc(w_o))
            a.nccl_release(g)
            dq, dk, dv = a.malloc(self.q), a.malloc(self.kv), a.malloc(self.kv)
            a.release(d_core)
            for t in (q, k, v, core):
                a.release(t)
            d_qkv = a.malloc(self.q + 2 * self.kv)
            for t in (dq, dk, dv):
                a.release(t)
            g = a.malloc(self.full)  # qkv (column linear)
            d_n1 = a.malloc(self.shard)
            a.nccl_release(g)
            self.gathered(a)
            a.release(a.malloc(w_qkv))
            a.release(d_qkv)
            dy = a.malloc(self.shard)
            a.release(d_n1)
            a.release(d_x2)
            a.release(n1)
            if x is not None:  # the first layer's input is the embedding's output
                a.release(x)
        g = a.malloc(self.full)  # the embedding: its gathered gradient, its weight's
        a.release(a.malloc(self.embedding_grad))
        a.nccl_release(g)
        a.release(dy)


def replay(work, layout, cap: int) -> dict:
    """Rank 0 of a pp > 1 run under nanotron's 1F1B, GiB: the reserved peak, and beyond the
    allocated peak, with the collectives' buffers freed at once (`waste_gib`) and held
    until the next host sync (`lag_waste_gib`, against the same allocated peak)."""
    now = _replay(work, layout, cap, False)
    lag = _replay(work, layout, cap, True)
    return {"reserved_gib": now.peak_reserved / GIB,
            "waste_gib": (now.peak_reserved - now.peak_allocated) / GIB,
            "lag_waste_gib": (lag.peak_reserved - now.peak_allocated) / GIB,
            "peak_allocated_gib": now.peak_allocated / GIB,
            "replayed": min(work.num_microbatches(layout), cap)}


def _replay(work, layout, cap: int, lag: bool) -> CachingAllocator:
    a, s = CachingAllocator(), Stage(work, layout)
    a.lagging = lag
    p, m = layout.pp, min(work.num_microbatches(layout), cap)
    pending: list[list] = []

    def forward(send: bool):
        full = a.malloc(s.full)  # the embedding's partial sums, reduce-scattered
        x = a.malloc(s.shard)
        a.nccl_release(full)
        saved, out = s.forward(a, x)
        pending.append(saved)
        if send:  # the metadata's pageable copy syncs the host
            a.sync()
            a.release(out)
            return None
        return out

    warm = min(p - 1, m)
    for _ in range(warm):
        forward(True)
    for _ in range(m - warm):
        held = forward(False)
        a.sync()  # the backward's first communication: its metadata read on the host
        a.release(held)
        s.backward(a, pending.pop(0), a.malloc(s.shard))
    while pending:
        a.sync()
        s.backward(a, pending.pop(0), a.malloc(s.shard))
    a.sync()
    return a


def residual(row) -> tuple | None:
    """(work, layout, GiB logged beyond the plan with the memory factors at 0, the plan's own
    allocator waste in GiB) of an ok run with pp > 1, else None."""
    work, layout = uc.workload_layout(row)
    if row["status"] != "ok" or layout.pp == 1 or check_layout(work, layout):
        return None
    _, assume = get_hardware("h100-sxm", {k: 0.0 for k in uf.FITTED})
    items, _ = memory.memory_items(work, layout, assume, 0)
    act = memory._activations(work, layout)
    n = inflight_microbatches(layout, work.num_microbatches(layout), 0)
    planned_waste = (sum(1 for v in act.layer_terms.values() if v >= MIB)
                     * n * stage(work.model, layout, 0)[0] * MIB)
    logged = float(row["gpu_memory_GB"]) * GIB
    return work, layout, (logged - sum(items.values())) / GIB, planned_waste / GIB


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--max-microbatches", type=int, default=40)
    args = ap.parse_args(argv)
    if args.max_microbatches < 1:
        print("usp_allocator_replay.py: --max-microbatches must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    runs = []
    for row in uc.load():
        got = residual(row)
        if got is None:
            continue
        work, layout, missed, planned = got
        r = replay(work, layout, args.max_microbatches)
        runs.append({"model": row["model"], "n_gpus": int(row["n_gpus"]), "dp": layout.dp,
                     "tp": layout.tp, "pp": layout.pp, "mbs": layout.mbs,
                     "zero": layout.zero, "missed_gib": missed,
                     "planned_waste_gib": planned, **r})
    cells: dict[str, list[dict]] = {}
    for r in runs:
        cells.setdefault(f"{r['tp']} x {r['pp']}", []).append(r)
    print(f"{len(runs)} ok runs with pp > 1, rank 0, at most {args.max_microbatches} "
          "micro-batches replayed")
    print("tp x pp: runs | GiB logged beyond the plan (factors at 0) | replayed waste | "
          "with the collectives' buffers held to the next host sync | the plan's own "
          "rounding (medians)")
    table = {}
    for key in sorted(cells, key=lambda k: tuple(int(x) for x in k.split(" x "))):
        c = cells[key]
        table[key] = {f: statistics.median(r[f] for r in c) for f in
                      ("missed_gib", "waste_gib", "lag_waste_gib", "planned_waste_gib")}
        table[key]["runs"] = len(c)
        if len(c) >= 6:
            print(f"{key:>8}: {len(c):3d} | {table[key]['missed_gib']:6.2f} | "
                  f"{table[key]['waste_gib']:6.2f} | {table[key]['lag_waste_gib']:6.2f} | "
                  f"{table[key]['planned_waste_gib']:6.2f}")
    before = [r["missed_gib"] for r in runs]
    print(f"median |GiB missed|: the plan's rounding {statistics.median(map(abs, before)):.2f}"
          + "".join(f", {name} instead " + format(statistics.median(
              abs(r["missed_gib"] + r["planned_waste_gib"] - r[key]) for r in runs), ".2f")
              for name, key in (("the replay's waste", "waste_gib"),
                                ("held to the host sync", "lag_waste_gib"))))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=uc.ROOT).stdout.strip()
    args.out.write_text(json.dumps({
        "machine": {"host": platform.node(), "cpu": uc._cpu_model(),
                    "python": platform.python_version()},
        "git": rev, "data": "bench/data/usp-calibration.csv",
        "max_microbatches": args.max_microbatches, "by_tp_pp": table, "runs": runs},
        indent=2) + "\n")
    return table


if __name__ == "__main__":
    main()
