"""The MoE model under dp 2, ZeRO-1, ZeRO-3, tp 2 (experts replicated) and pp 2 (1F1B)
reproduces the single process, with the balance loss, z-loss and expert-bias update on.

Tolerances (fp32; the float32 error model of tests/tolerances.py at 8 sequences of 32
tokens per step, 2 blocks of 3 GEMMs): loss and the aux loss (coefficient-weighted balance +
z losses) ≤ LOSS_RTOL relative per step, gradient norm and final parameters (per tensor) ≤
TRAINED_RTOL relative, tokens per expert equal, expert biases ≤ 1e-6 absolute. One forked pair
of ranks runs every layout in turn.
"""

import pathlib

import pytest
import torch
from common import small_config
from harness import run_ranks
from tolerances import loss_rtol, trained_rtol, within

from fivefold.parallel.mesh import ParallelDims
from fivefold.train.trainer import Trainer

MOE = ["--model.num_layers", "2", "--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "16", "--model.aux_loss_coeff", "0.01",
       "--model.z_loss_coeff", "0.001", "--model.expert_bias_rate", "0.01",
       "--model.shared_expert_intermediate_size", "16", "--model.shared_expert_gate", "true",
       "--train.gbs", "8", "--parallel.mbs", "2", "--train.lr", "1e-3"]
STEPS = 3
LOSS_RTOL = loss_rtol(tokens=8 * 32, depth=3 * 2)
TRAINED_RTOL = trained_rtol(tokens=8 * 32, depth=3 * 2)
LAYOUTS = {
    "dp2": ["--parallel.dp", "2"],
    "dp2-zero1": ["--parallel.dp", "2", "--parallel.zero", "1"],
    "dp2-zero3": ["--parallel.dp", "2", "--parallel.zero", "3"],
    "tp2": ["--parallel.tp", "2"],
    "pp2-1f1b": ["--parallel.pp", "2", "--parallel.schedule", "1f1b"],
}


def train(rank, world, tmp, args):
    cfg = small_config(pathlib.Path(tmp), *MOE, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    records = [trainer.train_step() for _ in range(STEPS)]
    tensors = {k: v for k, v in trainer.logical_tensors().items()
               if k.startswith(("model/", "buffer/"))}
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_tokens_max", "moe_tokens_min")
    return [{k: r[k] for k in keys} for r in records], tensors


def every_layout(rank, world, tmp):
    return {name: train(rank, world, f"{tmp}/{name}", args) for name, args in LAYOUTS.items()}


def rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parity
def test_moe_layouts_match_the_single_process(tmp_path):
    ref_steps, ref_tensors = train(0, 1, str(tmp_path / "ref"), [])
    assert ref_steps[-1]["moe_aux_loss"] > 0
    assert any(k.startswith("buffer/") and v.abs().sum() > 0 for k, v in ref_tensors.items())
    for rank_result in run_ranks(every_layout, 2, str(tmp_path)):
        for name, (steps, tensors) in rank_result.items():
            for got, want in zip(steps, ref_steps):
                assert within(rel(got["loss"], want["loss"]), LOSS_RTOL, name), name
                assert within(rel(got["grad_norm"], want["grad_norm"]), TRAINED_RTOL, name), name
                assert within(rel(got["moe_aux_loss"], want["moe_aux_loss"]), LOSS_RTOL, name)
                assert got["moe_tokens_max"] == want["moe_tokens_max"], name
                assert got["moe_tokens_min"] == want["moe_tokens_min"], name
            for key, value in tensors.items():
                ref = ref_tensors[key]
                if key.startswith("buffer/"):
                    assert torch.allclose(value, ref, rtol=0, atol=1e-6), (name, key)
                else:
                    err = float((value - ref).norm() / ref.norm())
                    assert within(err, TRAINED_RTOL, f"{name} {key}"), (name, key, err)


def test_resume_restores_the_expert_bias(tmp_path):
    """Save after 2 steps, resume: steps 3 and 4 equal the uninterrupted run's (the expert
    biases, which steer routing, are in the checkpoint), and the log carries the MoE metrics."""
    args = [*MOE, "--checkpoint.every", "2"]
    whole = Trainer(small_config(tmp_path / "a", *args), quiet=True)
    losses = [whole.train_step()["loss"] for _ in range(4)]
    first = Trainer(small_config(tmp_path / "b", *args), quiet=True)
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    again = Trainer(small_config(tmp_path / "b", *args, "--checkpoint.resume", "latest"),
                    quiet=True)
    bias = again.moe.expert_biases()
    assert all(torch.equal(b, first.moe.expert_biases()[k]) for k, b in bias.items())
    assert any(b.abs().sum() > 0 for b in bias.values())
    records = [again.train_step() for _ in range(2)]
    assert [r["loss"] for r in records] == pytest.approx(losses[2:], rel=1e-6)
    assert records[-1]["moe_balance_loss"] > 0 and len(records[-1]["moe_tokens_max"]) == 2
