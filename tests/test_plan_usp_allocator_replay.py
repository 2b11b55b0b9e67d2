"""bench/plan/usp_allocator_replay.py: the caching allocator's rules by hand, and the replayed
first stage against the planner's saved activations."""

import sys
from pathlib import Path

from fivefold.plan.hardware import get_hardware
from fivefold.plan.memory import memory_items

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "plan"))
import usp_allocator_replay as replay  # noqa: E402
import usp_calibration as usp  # noqa: E402

MIB = 2**20


def test_caching_allocator_rules_by_hand():
    a = replay.CachingAllocator()
    assert a.malloc(MIB) is None  # the small pool is left out
    h1 = a.malloc(3 * MIB)  # under 10 MiB: a 20 MiB segment, 17 MiB left cached
    assert a.reserved == 20 * MIB and a.free == [(17 * MIB, 0, 3 * MIB)]
    h2 = a.malloc(12 * MIB + 1)  # rounded to 512 bytes, best fit in the cached 17 MiB
    assert a.reserved == 20 * MIB and a.allocated == 15 * MIB + 512
    h3 = a.malloc(29 * MIB + 1)  # over 10 MiB: its own segment, rounded up to 2 MiB, and
    assert a.reserved == 50 * MIB  # the 1 MiB left (not more than 1 MiB) is not split off
    assert a.allocated == 45 * MIB + 512
    a.release(h1)
    a.release(h2)  # merges with the free blocks on both sides: the segment whole again
    assert a.free == [(20 * MIB, 0, 0)]
    h4 = a.malloc(19.5 * MIB)  # 0.5 MiB would be left: not split, the block served whole
    assert a.free == [] and a.allocated == 50 * MIB and a.reserved == 50 * MIB
    a.release(h3)
    a.release(h4)
    assert a.allocated == 0 and a.peak_reserved == 50 * MIB and a.peak_allocated == 50 * MIB


def test_record_stream_lag_holds_the_buffers_until_the_sync():
    a = replay.CachingAllocator()
    a.lagging = True
    h = a.malloc(16 * MIB)
    a.nccl_release(h)
    a.malloc(16 * MIB)  # the first block is still held: a second segment
    assert a.reserved == 32 * MIB
    a.sync()
    a.malloc(16 * MIB)  # now the first one serves it
    assert a.reserved == 32 * MIB


def test_replayed_stage_holds_the_planned_activations():
    """8B on 128 GPUs, dp 2, tp 16, pp 4, 8 sequences per micro-batch: at its peak the
    replayed first stage holds the saved tensors the planner counts (its activations, the
    same layer terms for the same micro-batches in flight) plus at most the transients of
    one layer's backward: the kept gather buffer and one full-width gradient (T·h each),
    the MLP's input gradients (4 intermediate-sized), a few sequence shards (the boundary
    tensor held, the received gradient, the residual's), one weight's gradient, the
    embedding's. Blocks of 1 MiB or less (the norms' statistics) are left out of the
    replay, 0.1% of these bytes."""
    row = next(r for r in usp.load() if (r["model"], r["n_gpus"], r["dp"], r["tp"], r["pp"],
                                         r["mbs"], r["status"]) ==
               ("8B", "128", "2", "16", "4", "8", "ok"))
    work, layout = usp.workload_layout(row)
    _, assume = get_hardware("h100-sxm")
    activations = memory_items(work, layout, assume, 0)[0]["activations"]
    stage = replay.Stage(work, layout)
    transients = (2 * stage.full + 4 * stage.f + 6 * stage.shard + max(stage.weights)
                  + stage.embedding_grad)
    got = replay.replay(work, layout, 40)["peak_allocated_gib"] * 2**30
    assert 0.999 * activations <= got <= activations + transients
