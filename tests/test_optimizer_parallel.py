"""adamw8bit and Muon under DP x ZeRO-1/2/3 track the single-process run.

A model with tensors big enough to quantise (>= 4096 values, whole 256-value blocks: the
embedding, q, o and the MLP) and some that are not (k, v, norms), 3 steps of 16 sequences,
2 micro-batches per rank (test_data_parallel's loop). The only difference between the runs
is the order of the gradient sums (the micro-batches of two ranks are summed by a reduction,
not by one process's accumulation): gradients differ in their last bits (~1e-7 relative).

Tolerances from that error model:
- adamw8bit's losses and gradient norms: 1e-5 relative (test_data_parallel's fp32 bound
  for AdamW);
- adamw8bit: a gradient 1e-7 off moves a moment across a code boundary only when it lies
  within 1e-7 of one; then that value's moment moves by one code step (the map's widest
  relative step, 1.4% of the block's absmax) and its update by at most lr times that:
  |Δparam| <= STEPS · lr · 0.014 per flip (the quantisation blocks themselves are the same
  on every rank: the ZeRO layout is block-aligned, tested by `test_shards_hold_whole_blocks`);
- Muon: tests/optimizer_bounds.py's model (`muon_mover`, `parity_bounds`), as in
  test_optimizer_tp_ep.py, with the gain taken at the reference's own inputs. Each step's
  gradient differs by the float32 sums' order (tests/tolerances.py: 256 tokens, 6 GEMMs of
  length <= 128; after a step, plus the weights' relative distance so far), a change of
  independent entries; Newton-Schulz multiplies its norm (after U/||U||_F: at most 2e for a
  relative change e) by the root mean square of its derivative's factors at that input
  (`ns_gain_rms`: 12-20 for the 64x128 and 32x64 matrices, ~220 for the square ones,
  whose momentum is nearly rank-deficient; the bound over every input and direction,
  `ns_gain`, is 851, and a^5 = 485 counts only the smallest singular values), times
  lambda = 2 for the spread about it; the step lr·0.2·sqrt(max(A, B))·O (match_rms_adamw)
  moves the matrix by that much more. Losses and gradient norms get the bounds that
  distance implies, step by step (losses within 1e-5); weights, each tensor's (1e-3 for
  the MLP, 2-3.5% for the square matrices). Measured here: losses and gradient norms equal,
  every Muon matrix's error under 1e-4 of its bound. In bf16 the same gain times 2^-8 bounds
  nothing (measured here once: 9% of the weights' movement), so the parity runs use
  optim.muon_ns_dtype = fp32.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from optimizer_bounds import Run, muon_mover, ns_gain, ns_gain_rms, parity_bounds
from test_data_parallel import GBS, LR, SEQ, assert_close_run, build, final_params, make_cfg, train
from tolerances import within

from fivefold.config.optim import ns_coefficients
from fivefold.models.init import build_model
from fivefold.parallel import muon
from fivefold.parallel.buffers import FlatLayout
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.muon import takes
from fivefold.train.optim import MasterWeightOptimizer
from fivefold.train.precision import LossScaler

STEPS = 3
OVERRIDES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
ADAMW8BIT_TOLERANCE = STEPS * LR * 0.014
# GBS sequences of SEQ tokens a step; nano's 2 blocks of 3 GEMMs (attention output, MLP down,
# gate/up) between the loss and the deepest weight; the longest GEMM: the MLP's 128
MUON_RUN = Run(tokens=GBS * SEQ, depth=3 * 2, width=128, lr=LR, steps=STEPS)


def _cfg(dp, zero, optimizer):
    cfg = make_cfg(dp, zero)
    cfg.model.overrides = dict(OVERRIDES)
    cfg.train.optimizer = optimizer
    if optimizer == "muon":
        cfg.optim.muon_ns_dtype = "fp32"
    return cfg


def _run(rank, world, configs):
    out = {}
    for zero, optimizer in configs:
        model, _, opt = build(_cfg(world, zero, optimizer))
        losses, norms = train(model, opt, rank, world, STEPS)
        params = final_params(opt)
        if optimizer == "adamw8bit":  # every piece of a quantised tensor holds whole blocks
            for pc in opt.pieces:
                slot = opt.layout.params[pc.slot]
                assert pc.lo % 256 == 0 and (pc.hi % 256 == 0 or pc.hi == slot.numel)
        opt.close()
        if rank == 0:
            out[(zero, optimizer)] = (losses, norms, params)
    return out


def test_adamw8bit_and_muon_under_dp2_zero_track_one_process(monkeypatch):
    configs = [(zero, opt) for opt in ("adamw8bit", "muon") for zero in (1, 2, 3)]
    got = run_ranks(_run, 2, configs)[0]
    ns_inputs, original = [], muon.newton_schulz  # the reference's inputs, for the gains

    def newton_schulz(update, *args, **kwargs):
        ns_inputs.append(update.detach().clone())
        return original(update, *args, **kwargs)

    monkeypatch.setattr(muon, "newton_schulz", newton_schulz)
    for optimizer in ("adamw8bit", "muon"):
        cfg = _cfg(1, 0, optimizer)  # the reference, with the run's [optim] keys
        model = build_model(cfg.model.resolve(), cfg.train.seed)
        opt = MasterWeightOptimizer(list(model.named_parameters()), cfg.train,
                                    ParallelDims.single(), LossScaler(), cfg.optim)
        ref = (*train(model, opt, 0, 1, STEPS), final_params(opt))
        for zero in (1, 2, 3):
            label = f"dp2 zero{zero} {optimizer}"
            if optimizer == "adamw8bit":
                assert_close_run(got[(zero, optimizer)], ref, 1e-5, 1e-5, ADAMW8BIT_TOLERANCE,
                                 label)
            else:
                _check_muon(got[(zero, optimizer)], ref, cfg.optim, ns_inputs, label)


def _ns_gains(oc, ns_inputs) -> list[dict[tuple, float]]:
    """Per step, per matrix shape: the largest `ns_gain_rms` of the reference's inputs."""
    per_step = len(ns_inputs) // STEPS
    assert per_step and len(ns_inputs) == STEPS * per_step
    gains = [{} for _ in range(STEPS)]
    for i, update in enumerate(ns_inputs):
        gain = ns_gain_rms(update, ns_coefficients(oc.muon_ns_coefficients), oc.muon_ns_steps)
        step = gains[i // per_step]
        step[tuple(update.shape)] = max(step.get(tuple(update.shape), 0.0), gain)
    return gains


def _check_muon(got, ref, oc, ns_inputs, label):
    """Losses and gradient norms per step, weights per tensor, within `parity_bounds`."""
    ref_losses, ref_norms, ref_weights = ref
    move = muon_mover(MUON_RUN, lambda n: takes(n, ref_weights[n], oc.muon_exclude),
                      ns_coefficients(oc.muon_ns_coefficients), oc.muon_ns_steps,
                      _ns_gains(oc, ns_inputs))
    weight_bounds, loss_bounds, norm_bounds = parity_bounds(
        MUON_RUN, move, ref_weights, list(zip(ref_losses, ref_norms)))
    losses, norms, weights = got
    for t, (a, b, na, nb) in enumerate(zip(losses, ref_losses, norms, ref_norms, strict=True)):
        assert within(abs(a - b) / b, loss_bounds[t], f"{label} loss"), (label, t, a, b)
        assert within(abs(na - nb) / nb, norm_bounds[t], f"{label} norm"), (label, t, na, nb)
    assert weights.keys() == ref_weights.keys()
    for name, ref_value in ref_weights.items():
        err = float((weights[name] - ref_value).norm() / ref_value.norm())
        assert within(err, weight_bounds[name], f"{label} {name}"), (label, name, err)


def test_shards_hold_whole_blocks():
    """align=256 over 3 ranks: every parameter starts on a block, every rank's share too."""
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in
             enumerate([300, 4096, 5000, 17])]
    layout = FlatLayout(named, [[0, 1], [2, 3]], 3, align=256)
    for rank in range(3):
        for pc in layout.pieces(rank):
            assert pc.lo % 256 == 0 and pc.flat % 256 == 0
    assert layout.padding < 256 * (len(named) + 3 * len(layout.segments))


# --- tensor and pipeline parallelism, through the trainer --------------------------------
def _trainer_cfg(tmp, optimizer, tp=1, pp=1):
    from test_optimizer_checkpoint import _cfg as checkpoint_cfg

    cfg = checkpoint_cfg(tmp, optimizer)
    cfg.parallel.tp, cfg.parallel.pp = tp, pp
    cfg.checkpoint.every = 0
    if optimizer == "muon":
        cfg.optim.muon_ns_dtype = "fp32"
    return cfg


def _trainer_losses(rank, world, tmp, cases):
    from fivefold.train.trainer import Trainer

    out = []
    for optimizer, tp, pp in cases:
        cfg = _trainer_cfg(f"{tmp}/{optimizer}{tp}{pp}", optimizer, tp, pp)
        dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
        with Trainer(cfg, dims, quiet=True) as trainer:
            out.append([trainer.train_step()["loss"] for _ in range(3)])
    return out


def test_muon_under_tp2_and_pp2_and_adamw8bit_under_pp2_track_one_process(tmp_path):
    """Muon gathers each tensor-parallel matrix whole before orthogonalising (parallel/
    muon.py), so tp2 equals one device up to the gradient sums' order (fp32 NS: losses
    within 1e-5 relative, as above); pp splits whole tensors, so each stage updates exactly
    what one device would."""
    cases = [("muon", 2, 1), ("muon", 1, 2), ("adamw8bit", 1, 2)]
    got = run_ranks(_trainer_losses, 2, str(tmp_path), cases)[0]
    ref = _trainer_losses(0, 1, str(tmp_path / "ref"), [("muon", 1, 1), ("adamw8bit", 1, 1)])
    for (optimizer, tp, pp), losses in zip(cases, got):
        want = ref[0] if optimizer == "muon" else ref[1]
        for a, b in zip(losses, want):
            assert abs(a - b) <= 1e-5 * b, (optimizer, tp, pp, losses, want)


@pytest.mark.usefixtures("one_thread")
def test_ns_gain_rms_predicts_how_far_random_changes_move_newton_schulz():
    """`ns_gain_rms` against float64 Newton-Schulz: changes of independent entries, relative
    size 1e-8, move the output by the predicted gain on average (30 draws: within 15%) and
    never by more than lambda = 2 times it; the bound over every direction is far above."""
    coefficients = ns_coefficients("3.4445,-4.7750,2.0315")
    g = torch.Generator().manual_seed(0)
    for shape in ((64, 64), (64, 128), (128, 32)):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        out = muon.newton_schulz(x, coefficients, 5, dtype=torch.float64)
        moved = []
        for _ in range(30):
            change = torch.randn(*shape, generator=g, dtype=torch.float64)
            change *= 1e-8 * x.norm() / change.norm()
            moved.append(float((muon.newton_schulz(x + change, coefficients, 5,
                                                   dtype=torch.float64) - out).norm()) / 1e-8)
        predicted = ns_gain_rms(x, coefficients, 5)
        assert abs(sum(moved) / len(moved) / predicted - 1) < 0.15, (shape, moved, predicted)
        assert max(moved) <= 2 * predicted < ns_gain(coefficients, 5), (shape, moved)
