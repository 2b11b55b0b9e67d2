"""adamw8bit and Muon under DP x ZeRO-1/2/3 track the single-process run.

A model with tensors big enough to quantise (>= 4096 values, whole 256-value blocks: the
embedding, q, o and the MLP) and some that are not (k, v, norms), 3 steps of 16 sequences,
2 micro-batches per rank (test_data_parallel's loop). The only difference between the runs
is the order of the gradient sums (the micro-batches of two ranks are summed by a reduction,
not by one process's accumulation): gradients differ in their last bits (~1e-7 relative).

Tolerances from that error model:
- losses: 1e-5 relative (test_data_parallel's fp32 bound for AdamW), gradient norms too
  except under Muon (NORM_TOLERANCES);
- adamw8bit: a gradient 1e-7 off moves a moment across a code boundary only when it lies
  within 1e-7 of one; then that value's moment moves by one code step (the map's widest
  relative step, 1.4% of the block's absmax) and its update by at most lr times that:
  |Δparam| <= STEPS · lr · 0.014 per flip (the quantisation blocks themselves are the same
  on every rank: the ZeRO layout is block-aligned, tested by `test_shards_hold_whole_blocks`);
- Muon: Newton-Schulz multiplies a small singular value by up to a = 3.4445 per iteration,
  so a relative input change ε comes out as up to a^5·ε = 485ε (parallel/muon.py). In bf16
  that is 485·2^-8: no useful bound (measured here: 9% of the weights' movement), so the
  parity runs use optim.muon_ns_dtype = fp32: ε ~ 2^-23 relative, an update element
  of at most lr·0.2·sqrt(128)·1.5 (match_rms_adamw on 128 columns, |O| <= 1.5):
  |Δparam| <= STEPS · lr · 0.2 · sqrt(128) · 1.5 · 485 · 2^-23; its effect on the next
  gradients is of the same order (losses and norms within 1e-5).
"""

from __future__ import annotations

from harness import run_ranks
from test_data_parallel import LR, assert_close_run, build, final_params, make_cfg, train

from fivefold.models.init import build_model
from fivefold.parallel.buffers import FlatLayout
from fivefold.parallel.mesh import ParallelDims
from fivefold.train.optim import MasterWeightOptimizer
from fivefold.train.precision import LossScaler

STEPS = 3
OVERRIDES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
TOLERANCES = {"adamw8bit": STEPS * LR * 0.014,
              "muon": STEPS * LR * 0.2 * 128 ** 0.5 * 1.5 * 485 * 2 ** -23}


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


def test_adamw8bit_and_muon_under_dp2_zero_track_one_process():
    configs = [(zero, opt) for opt in ("adamw8bit", "muon") for zero in (1, 2, 3)]
    got = run_ranks(_run, 2, configs)[0]
    for optimizer in ("adamw8bit", "muon"):
        cfg = _cfg(1, 0, optimizer)  # the reference, with the run's [optim] keys
        model = build_model(cfg.model.resolve(), cfg.train.seed)
        opt = MasterWeightOptimizer(list(model.named_parameters()), cfg.train,
                                    ParallelDims.single(), LossScaler(), cfg.optim)
        ref = (*train(model, opt, 0, 1, STEPS), final_params(opt))
        for zero in (1, 2, 3):
            assert_close_run(got[(zero, optimizer)], ref, 1e-5, 1e-5, TOLERANCES[optimizer],
                             f"dp2 zero{zero} {optimizer}")


def test_shards_hold_whole_blocks():
    """align=256 over 3 ranks: every parameter starts on a block, every rank's share too."""
    import torch

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
