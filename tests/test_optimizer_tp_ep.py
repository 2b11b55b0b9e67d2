"""The quantised AdamWs under tensor parallelism reproduce the single process.

The default test model's row-parallel shards cut its quantisation blocks (parallel/
optim_base.py refuses that layout), so these runs widen a one-layer model to hidden 512 and
ffn 512: every tp2 shard of every quantised tensor then holds whole blocks of 256 (8-bit) and
128 (4-bit) values, the same blocks as the whole tensor (o_proj's and down_proj's rows of 512
split into one 256-value block per rank; column-parallel and vocabulary-parallel tensors are
cut between rows).

Two checks per optimizer, in one start of two ranks:

1. The same gradients: after each backward, every gradient is replaced by values drawn from
   its logical tensor's name and the step (each rank takes its slice). tp2's weights and
   dequantised moments then equal the single process's bit for bit after 2 steps (the second
   reads the first's codes back): the update is elementwise, on the same blocks, so nothing
   is summed in another order.
2. The same data (seed, global batch of 4 sequences of 32 tokens, 3 steps, constant lr, no
   clipping): the runs differ by the order of the float32 sums, and then by the codes that
   difference flips. The bounds (`tp_bounds`):
   - float32 (tests/tolerances.py at 128 tokens, 3 GEMMs of length <= 512): losses
     `loss_rtol`, gradients `grad_rtol` in the first step and `trained_rtol` after it, the
     weights `trained_rtol` plus the flips' share;
   - flips. A moment is stored as the map point nearest to its value over its block's absmax
     A. Two runs whose values differ by dx (A by as much at most, hence 2 dx in all) store
     different codes only when a rounding midpoint lies between the two values: with the
     midpoints w apart around that code and the value's place among them uniform, that
     happens with probability 2|dx| / (w A), and the stored values then differ by w A, so
     E(stored difference)^2 = 2 w A |dx| per value. With |dx| = e times the block's rms
     (a float32 sum errs alike on small and large results), the moment's relative error
     r has r^2 = 2 e sum_b A_b rms_b sum_{i in b} w_i / ||x||^2 (`flip_weight`, from the
     reference's stored moments; e for v = g^2 is twice the gradient's). A flip survives
     into the next stored moment with probability ~ beta (the lerp keeps beta of the
     difference): r_t^2 = beta r_{t-1}^2 + 2 e_t (...);
   - a moment off by r changes Adam's update m / sqrt(v) by (r_m + r_v / 2) of itself to
     first order, and |update| <= U per value (Cauchy-Schwarz over the moments' exponential
     weights, bias corrections included: U = 1.001 up to step 3 at betas 0.9 / 0.95), so a
     tensor moves by lr U sqrt(n) (r_m + r_v / 2) more in each step after the first; the
     next gradients by as much relative; a loss by the gradient norm times the weights'
     distance over sqrt(n): flips point every way, and only their projection on the gradient
     counts;
   - lambda = 2 over these expected values, as in tolerances.py's item 1.
   The bounds are loose (measured: at most 1.4% of the bound for 8-bit weights, 0.6% for
   4-bit): tolerances.py's float32 model is, and a flip turns its square root into a code
   step. What check 2 still catches: a shard's update wrong as a whole (another lr or sign,
   a missed step, another rank's gradient) moves its half of a tensor by lr per value in
   that step, 0.1 of the tensor's norm at init std 0.02: 12-16x the 8-bit bounds, 1.5-3x
   the 4-bit ones. Check 1 catches each of those bit for bit.
"""

from __future__ import annotations

import math
import pathlib
import zlib

import pytest
import torch
from common import small_config
from harness import run_ranks
from tolerances import LAMBDA, grad_rtol, loss_rtol, trained_rtol, within

from fivefold.numerics.optim_states import block_size, qmap, quantisable
from fivefold.parallel.mesh import ParallelDims
from fivefold.train.trainer import Trainer

WIDE = ["--model.hidden_size", "512", "--model.intermediate_size", "512",
        "--model.num_layers", "1", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--train.lr", "3e-3", "--train.lr_schedule", "constant", "--train.grad_clip", "0"]
STEPS, SAME_GRAD_STEPS, LR, BETAS = 3, 2, 3e-3, (0.9, 0.95)
TOKENS, DEPTH, WIDTH = 4 * 32, 3, 512  # gbs 4 x seq 32; o_proj, down_proj, gate/up
OPTIMIZERS = {"adamw8bit": 8, "adamw4bit": 4}


def _trainer(tmp, optimizer, tp):
    cfg = small_config(pathlib.Path(tmp), *WIDE, "--train.optimizer", optimizer,
                       "--parallel.tp", str(tp))
    dims = ParallelDims.from_config(cfg.parallel) if tp > 1 else ParallelDims.single()
    return Trainer(cfg, dims, quiet=True)


def _same_gradients(trainer):
    """After each backward, every gradient becomes a draw seeded by its logical name and the
    step (rows of different scales, so blocks see different absmaxes); a tp rank takes its
    slice of the logical tensor."""
    backward = trainer.forward_backward

    def replaced(*args, **kw):
        loss = backward(*args, **kw)
        for name, p in trainer.model.named_parameters():
            shape = tuple(getattr(p, "_full_shape", p.shape))
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{trainer.step}".encode()))
            full = torch.randn(shape, generator=gen) * 1e-3
            full *= torch.rand(shape[:1] + (1,) * (len(shape) - 1), generator=gen) * 10
            spec = getattr(p, "_tp_slice", None)
            if spec is not None:
                dim, start, stop = spec
                full = full.narrow(dim, start, stop - start)
            p.grad.copy_(full.reshape(p.shape))
        return loss

    trainer.forward_backward = replaced


def tp_runs(rank, world, tmp):
    """{optimizer: (steps' loss/grad norm/lr, weights, states after each step, weights and
    states after the same-gradient steps)}; only rank 0's."""
    out = {}
    for optimizer in OPTIMIZERS:
        with _trainer(f"{tmp}/{optimizer}", optimizer, world) as trainer:
            records, states = [], []
            for _ in range(STEPS):
                rec = trainer.train_step()
                records.append((rec["loss"], rec["grad_norm"], rec["lr"]))
                if world == 1:  # the reference's stored moments, for the flip model
                    states.append({k: v for k, v in trainer.logical_tensors().items()
                                   if k.startswith("optim/") and "/exp_avg" in k})
            weights = {k: v for k, v in trainer.logical_tensors().items()
                       if k.startswith("model/")}
        with _trainer(f"{tmp}/{optimizer}-same", optimizer, world) as trainer:
            _same_gradients(trainer)
            for _ in range(SAME_GRAD_STEPS):
                trainer.train_step()
            same = trainer.logical_tensors()
        if rank == 0:
            out[optimizer] = (records, weights, states, same)
    return out


# --- the error model ---------------------------------------------------------------------
def flip_weight(x: torch.Tensor, bits: int, signed: bool) -> float:
    """sum_b A_b rms_b sum_{i in b} w_i / ||x||^2: the stored moment's blocks (absmax A_b,
    rms rms_b) and the spacing w_i of the map's rounding midpoints around each value's code."""
    table = qmap(bits, signed).double()
    gaps = table[1:] - table[:-1]
    spacing = torch.cat([gaps[:1], (gaps[1:] + gaps[:-1]) / 2, gaps[-1:]])
    blocks = x.reshape(-1, block_size(bits)).double()
    amax = blocks.abs().amax(1, keepdim=True).clamp_min(1e-30)
    codes = (torch.searchsorted(table, (blocks / amax).contiguous()) - 1).clamp(0, len(table) - 2)
    lower = table[codes]
    codes = torch.where((blocks / amax - lower) * 2 > table[codes + 1] - lower, codes + 1, codes)
    rms = blocks.norm(dim=1) / math.sqrt(blocks.shape[1])
    return float((amax.squeeze(1) * rms * spacing[codes].sum(1)).sum() / blocks.square().sum())


def update_bound(steps: int, beta1: float, beta2: float) -> float:
    """max over t <= steps of |m_hat| / sqrt(v_hat) (Cauchy-Schwarz over the moments'
    exponential weights: sum_k w_k^2 / u_k, bias corrections included)."""
    out = 0.0
    for t in range(1, steps + 1):
        r = beta1 ** 2 / beta2
        s = (1 - beta1) ** 2 * (1 - beta2 ** t) / ((1 - beta2) * (1 - beta1 ** t) ** 2)
        out = max(out, math.sqrt(s * (1 - r ** t) / (1 - r)))
    return out


def tp_bounds(bits, ref_states, ref_weights, ref_records):
    """Per weight tensor: its relative bound after STEPS; per step: the loss's bound."""
    grad0, trained = grad_rtol(TOKENS, DEPTH, WIDTH), trained_rtol(TOKENS, DEPTH, WIDTH)
    u = update_bound(STEPS, *BETAS)
    moved = {}  # relative distance of each weight tensor from the flips, by step
    for name, p in ref_weights.items():
        key = name.removeprefix("model/")
        if not quantisable(p.numel(), bits):
            moved[name] = [0.0] * STEPS
            continue
        r = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
        flips, dist = [0.0], 0.0
        for t in range(STEPS - 1):  # moments stored after step t + 1, used in step t + 2
            e_grad = (grad0 if t == 0 else trained) + dist
            for moment, beta, e in (("exp_avg", BETAS[0], e_grad),
                                    ("exp_avg_sq", BETAS[1], 2 * e_grad)):  # v ~ g^2
                c = flip_weight(ref_states[t][f"optim/{key}/{moment}"], bits,
                                moment == "exp_avg")
                r[moment] = math.sqrt(beta * r[moment] ** 2 + 2 * e * c)
            step = LAMBDA * LR * u * math.sqrt(p.numel()) * (
                r["exp_avg"] + r["exp_avg_sq"] / 2)
            dist += step / float(p.norm())
            flips.append(dist)
        moved[name] = flips
    weights = {name: trained + flips[-1] for name, flips in moved.items()}
    losses, total = [], sum(p.numel() for p in ref_weights.values())
    for t, (loss, norm, _) in enumerate(ref_records):
        away = math.sqrt(sum((m[t] * float(ref_weights[n].norm())) ** 2
                             for n, m in moved.items()))
        # flips point in random directions: their projection on the gradient ~ 1/sqrt(n)
        losses.append(loss_rtol(TOKENS, DEPTH, WIDTH) + LAMBDA * norm * away
                      / math.sqrt(total) / loss)
    return weights, losses


@pytest.mark.parity
def test_quantised_adamw_under_tp2_tracks_one_process(tmp_path):
    got = run_ranks(tp_runs, 2, str(tmp_path / "tp2"))[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: on shared cores, spinning threads slow a step
    try:
        ref = tp_runs(0, 1, str(tmp_path / "ref"))
    finally:
        torch.set_num_threads(threads)
    for optimizer, bits in OPTIMIZERS.items():
        records, weights, _, same = got[optimizer]
        ref_records, ref_weights, ref_states, ref_same = ref[optimizer]
        assert same.keys() == ref_same.keys()
        assert any(k.endswith("o_proj.weight/exp_avg") for k in same)
        for key, value in ref_same.items():  # 1. the same gradients: bit for bit
            assert torch.equal(same[key], value), (optimizer, key)
        bounds, loss_bounds = tp_bounds(bits, ref_states, ref_weights, ref_records)
        for t, ((a, _, lr), (b, _, _)) in enumerate(zip(records, ref_records)):
            assert lr == LR
            assert within(abs(a - b) / b, loss_bounds[t], f"tp2 {optimizer} loss"), \
                (optimizer, t, a, b, loss_bounds[t])
        for name, value in ref_weights.items():  # 2. the same data: within the model
            err = float((weights[name] - value).norm() / value.norm())
            assert within(err, bounds[name], f"tp2 {optimizer} {name}"), \
                (optimizer, name, err, bounds[name])
