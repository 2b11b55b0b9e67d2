"""The optimizer step's fp32 gradients are made a piece at a time (parallel/step_grads.py).

bf16 parameters with fp32 masters, on a CPU, through both owners of the step: the
single-replica `MasterWeightOptimizer` and ZeRO-1's `DataParallelOptimizer` (one rank).
Measured over the second step (Adam's moments exist by then): what the step allocates at
its peak (every storage its operators create, until it is freed) grows by about one piece's
fp32 gradient, not by the whole shard's (before: all of them at once), and the project's
peak tracker sees that same copy at its "optimizer step" point. The numbers stay those of
the copy made all at once, bit for bit.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from test_data_parallel import build, make_cfg, train
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.parallel import step_grads
from fivefold.parallel.peak import PeakTracker

# Besides the copy: the norm's float64 and fp32 scalars, the clipping coefficient, the step
# counters' increments: a few hundred bytes (the tiny model's pieces are 256 to 49,152 values).
SCALARS = 4096


class NewStorages(TorchDispatchMode):
    """Bytes of the storages the operators inside the block create (an output whose storage
    is none of the op's inputs'), alive now and at most, each counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in inputs and key not in self.refs:
                    self._count(storage, key)
        return out

    def _count(self, storage, key: int) -> None:
        size = storage.nbytes()
        self.now += size
        self.peak = max(self.peak, self.now)

        def freed(_, key=key, size=size):
            self.now -= size
            self.refs.pop(key, None)

        self.refs[key] = weakref.ref(storage, freed)


def _measure_second_step(opt) -> dict:
    """Wrap `opt.step`: its second call runs under `NewStorages` and a PeakTracker."""
    step, calls, out = opt.step, [0], {}

    def measured(lr, loss=None):
        calls[0] += 1
        if calls[0] != 2:
            return step(lr, loss)
        allocations, tracker = NewStorages(), PeakTracker(opt.peak_sources())
        with tracker, allocations:
            stats = step(lr, loss)
        out["allocated"] = allocations.peak
        out["tracked"] = tracker.points["optimizer step"] - tracker.points["start"]
        return stats

    opt.step = measured
    return out


def _run(zero: int, chunk: int, monkeypatch) -> tuple:
    """Two steps of the tiny model in bf16 (fp32 masters); the second one measured."""
    monkeypatch.setattr(step_grads, "STEP_CHUNK", chunk)
    model, _, opt = build(make_cfg(1, zero, preset="tiny"), torch.bfloat16)
    measured = _measure_second_step(opt)
    losses, norms = train(model, opt, 0, 1, steps=2)
    weights = {k: v["master"].clone() for k, v in opt.param_states().items()}
    sizes = [p.numel() for p in model.parameters()]
    return losses, norms, weights, measured, 4 * max(sizes), 4 * sum(sizes)


@pytest.mark.parametrize("zero", [0, 1])
def test_step_holds_one_pieces_fp32_gradient_at_a_time(zero, monkeypatch):
    # One chunk of every piece is the step as it was: every fp32 copy made, scaled and
    # stepped at once. Its peak is the whole shard's fp32 gradients.
    losses_a, norms_a, weights_a, at_once, _, whole = _run(zero, 1 << 40, monkeypatch)
    # Every piece a chunk of its own: the same bits (losses, norms, weights) ...
    losses_b, norms_b, weights_b, per_piece, largest, _ = _run(zero, 1, monkeypatch)
    assert losses_a == losses_b and norms_a == norms_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert losses_a[0] != losses_a[1]  # it trained: the weights moved
    assert whole >= 16 * largest  # 38 pieces: one piece's copy is far from all of them
    assert whole <= at_once["allocated"] <= whole + SCALARS, (at_once, whole)
    # ... with the largest piece's copy alive while its update runs, and none of the others.
    assert largest <= per_piece["allocated"] <= largest + SCALARS, (per_piece, largest)
    # The peak tracker counts the copies it samples at, as allocated.
    assert at_once["tracked"] == whole and per_piece["tracked"] == largest, (
        at_once, per_piece)
