"""The optimizer step's fp32 gradients are made a piece at a time (parallel/step_grads.py).

bf16 parameters with fp32 masters, on a CPU, through both owners of the step: the
single-replica `MasterWeightOptimizer` and ZeRO-1's `DataParallelOptimizer` (one rank).
Measured over the second step (Adam's moments exist by then): what the step allocates at
its peak (train/allocations.py: every storage created, until it is freed) grows by about one piece's
fp32 gradient, not by the whole shard's (before: all of them at once), and the project's
peak tracker sees that same copy at its "optimizer step" point. The numbers stay those of
the copy made all at once, bit for bit (gradient norms and fp32 masters).
"""

from __future__ import annotations

import pytest
import torch
from test_data_parallel import LR, build, make_cfg

from fivefold.parallel import step_grads
from fivefold.parallel.peak import PeakTracker
from fivefold.train.allocations import PeakAllocations

# Besides the copy: the norm's float64 and fp32 scalars, the clipping coefficient, the step
# counters' increments: a few hundred bytes (the tiny model's pieces are 256 to 49,152 values).
SCALARS = 4096


def _measure_second_step(opt) -> dict:
    """Wrap `opt.step`: its second call runs under `PeakAllocations` (train/allocations.py,
    handed every tensor the optimizer holds, so that only what the step adds grows it) and
    a PeakTracker."""
    step, calls, out = opt.step, [0], {}

    def measured(lr, loss=None):
        calls[0] += 1
        if calls[0] != 2:
            return step(lr, loss)
        held = [t for source in opt.peak_sources().values() for t in source()
                if t is not None]
        tracker = PeakTracker(opt.peak_sources())
        with tracker, PeakAllocations(held) as allocations:
            start = allocations.current
            stats = step(lr, loss)
        out["allocated"] = allocations.peak - start
        out["tracked"] = tracker.points["optimizer step"] - tracker.points["start"]
        return stats

    opt.step = measured
    return out


def _train(model, opt, steps: int) -> list[float]:
    """Gradient norms of `steps` steps whose gradients are fixed random numbers (bf16): a
    loss linear in the weights stands in for the model's, which would only add time."""
    params, norms = list(model.parameters()), []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        opt.zero_grad()
        opt.prepare_backward(final_microbatch=True)
        sum((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in params).backward()
        opt.finish_grad_sync()
        norms.append(opt.step(LR).grad_norm)  # about 900: clipped to train.grad_clip = 1
    return norms


def _run(zero: int, chunk: int, monkeypatch) -> tuple:
    """Two steps of the tiny model in bf16 (fp32 masters); the second one measured."""
    monkeypatch.setattr(step_grads, "STEP_CHUNK", chunk)
    model, _, opt = build(make_cfg(1, zero, preset="tiny"), torch.bfloat16)
    start = {k: v["master"].clone() for k, v in opt.param_states().items()}
    measured = _measure_second_step(opt)
    norms = _train(model, opt, steps=2)
    weights = {k: v["master"].clone() for k, v in opt.param_states().items()}
    assert not any(torch.equal(start[k], weights[k]) for k in weights)  # every weight moved
    sizes = [p.numel() for p in model.parameters()]
    return norms, weights, measured, 4 * max(sizes), 4 * sum(sizes)


@pytest.mark.parametrize("zero", [0, 1])
def test_step_holds_one_pieces_fp32_gradient_at_a_time(zero, monkeypatch):
    # One chunk of every piece is the step as it was: every fp32 copy made, scaled and
    # stepped at once. Its peak is the whole shard's fp32 gradients.
    norms_a, weights_a, at_once, _, whole = _run(zero, 1 << 40, monkeypatch)
    # Every piece a chunk of its own: the same bits (norms, weights) ...
    norms_b, weights_b, per_piece, largest, _ = _run(zero, 1, monkeypatch)
    assert norms_a == norms_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert whole >= 16 * largest  # 38 pieces: one piece's copy is far from all of them
    assert whole <= at_once["allocated"] <= whole + SCALARS, (at_once, whole)
    # ... with the largest piece's copy alive while its update runs, and none of the others.
    assert largest <= per_piece["allocated"] <= largest + SCALARS, (per_piece, largest)
    # The peak tracker counts the copies it samples at, as allocated.
    assert at_once["tracked"] == whole and per_piece["tracked"] == largest, (
        at_once, per_piece)


def test_the_devices_norm_reads_the_compute_dtype_gradients_when_nothing_is_pending():
    """The GPU's norm (`update.foreach_squares`) over bf16 gradients: with no factor
    pending it reads them directly, and the float64 sum equals the one over their fp32
    copies bit for bit (bf16 widens to fp32 exactly); with a factor pending (fp16's
    1/scale) it norms the scaled copies."""
    from fivefold.parallel.update import foreach_squares

    torch.manual_seed(0)
    sources = [torch.randn(n).bfloat16() for n in (3000, 17, 1 << 20)]
    masters = [torch.zeros(s.shape) for s in sources]
    shares = torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64)
    grads = step_grads.StepGrads(sources, torch.device("cpu"), copy=True, masters=masters)
    assert grads.exact_sources([0, 1]) == [sources[0], sources[1]]
    direct = foreach_squares(grads, shares)
    copies = [s.float() for s in sources]
    exact = sum(float(c.double().square().sum()) * w for c, w in zip(copies, shares.tolist()))
    assert direct.dtype == torch.float64
    assert torch.equal(direct, foreach_squares(step_grads.StepGrads(copies, torch.device("cpu"),
                                                                    copy=False), shares))
    assert abs(float(direct) - exact) <= 1e-12 * exact
    grads.scale_(0.25)  # pending: the copies are scaled, so they are what the norm reads
    assert grads.exact_sources([0]) is None
    assert torch.equal(foreach_squares(grads, shares), direct * 0.0625)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cast_and_the_first_factor_are_one_pass_bit_for_bit(dtype):
    """`make` multiplies each compute-dtype gradient by the first pending factor as it casts
    it (one `mul` of a one-element fp32 tensor: an fp32 result), the rest in place after:
    the same bits as the cast followed by each factor's multiplication in place, for a
    tensor factor (the clipping coefficient) and a float one (fp16's 1/loss scale), values
    from subnormal to large included."""
    torch.manual_seed(1)
    sources = [(torch.randn(n) * torch.logspace(-6, 4, n)).to(dtype) for n in (5000, 3)]
    sources.append(torch.tensor([1e-40, -3e-39, 65504.0, 0.0]).to(dtype))  # subnormal in fp32
    coef = torch.tensor(0.3719)  # an fp32 value that rounds every product
    for factors in ([coef], [2.0**-13, coef], [0.1, coef]):
        grads = step_grads.StepGrads(sources, torch.device("cpu"), copy=True,
                                     masters=[torch.zeros(s.shape) for s in sources])
        for f in factors:
            grads.scale_(f)
        want = [s.to(torch.float32, copy=True) for s in sources]
        for f in factors:
            torch._foreach_mul_(want, f)
        got = grads.make(list(range(len(sources))), sample=False)
        assert all(g.dtype == torch.float32 and g.shape == s.shape
                   for g, s in zip(got, sources))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), factors
        part = grads.make([0], 100, 200, sample=False)[0]  # a range: the same values
        assert torch.equal(part, want[0][100:200])
