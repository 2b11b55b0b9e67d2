"""ZeRO-2/3 keep their promise during backward, not only after the step: a rank holds its
gradient shard plus at most `parallel.buckets_in_flight` full buckets, measured from the
storages the engine owns (parallel/peak.py) at every gradient staged, bucket launched and
end of backward."""

import pytest
import torch
from harness import run_ranks
from test_data_parallel import GBS, SEQ, build, global_batch, make_cfg

from fivefold.parallel.peak import PeakTracker

UNBOUNDED = 1000  # more buckets than the model has: the behaviour before the bound


def _gradient_peaks(rank, world):
    out = {}
    for zero in (2, 3):
        shards = {}
        for in_flight in (1, 2, UNBOUNDED):
            cfg = make_cfg(world, zero)
            cfg.model.overrides = {"num_layers": 4}  # 5 ZeRO-3 units, ~8 ZeRO-2 buckets
            cfg.parallel.buckets_in_flight = in_flight
            model, dims, opt = build(cfg)
            reducer, layout = opt.reducer, opt.layout
            tracker = PeakTracker({
                "shard": lambda r=reducer: [r.grad_shard],
                "whole": lambda lay=layout: [s.param.grad for s in lay.params],
                "staging": lambda r=reducer: list(r.staging.values())})
            x, y = global_batch(0, 64)
            per = GBS // world
            opt.zero_grad()
            opt.prepare_backward(final_microbatch=True)
            with tracker:
                loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
                (loss / (GBS * SEQ)).backward()
                opt.finish_grad_sync()
            shards[in_flight] = reducer.grad_shard.clone()
            out[(zero, in_flight)] = {
                "peak": tracker.peak, "staging": tracker.item_peaks["staging"],
                "whole": tracker.item_peaks["whole"], "points": dict(tracker.points),
                "shard": reducer.grad_shard.numel() * 4,
                "largest": max(s.size for s in layout.segments) * 4,
                "smallest": min(s.size for s in layout.segments) * 4,
                "segments": len(layout.segments), "full": layout.total * 4}
            opt.close()
        # The bound changes when buckets are freed, never what they reduce to.
        for in_flight in (1, 2):
            assert torch.equal(shards[in_flight], shards[UNBOUNDED]), (zero, in_flight)
    return out


@pytest.mark.parametrize("dp", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_gradient_side_peak_is_shard_plus_buckets_in_flight(dp):
    for (zero, in_flight), r in run_ranks(_gradient_peaks, dp)[0].items():
        assert r["segments"] >= 4, r
        assert r["whole"] == 0, r  # on the final micro-batch no gradient is kept whole
        if in_flight == UNBOUNDED:
            # What the tracker sees without the bound: every bucket alive at the end of
            # backward, the whole gradient (the bug this guards against).
            assert r["staging"] == r["full"], r
            continue
        # ZeRO-3's rest unit (embedding and head) fills from backward's first gradient (the
        # head's) to its last (the embedding's), so one bucket in flight means two there.
        alive = max(in_flight, 2) if zero == 3 else in_flight
        bound = r["shard"] + alive * r["largest"]
        assert r["peak"] <= bound, (zero, in_flight, r)
        assert r["staging"] >= min(in_flight, 2) * r["smallest"], r  # it measured buckets
        assert r["staging"] < r["full"], r
