"""Dimensions composed through the trainer: TP × DP × ZeRO parity, and checkpoints that
reshard across tp and dp. Reference: the single-process run of the same config (fp32).

Tolerances (the float32 error model of tests/tolerances.py, at 8 sequences of 32 tokens per
step through 2 blocks of 3 GEMMs): loss ≤ LOSS_RTOL relative per step, gradient norm and
final parameters (‖a − b‖ / ‖b‖ per tensor) ≤ TRAINED_RTOL; resumed losses ≤ LOSS_RTOL.
"""

import pathlib

import pytest
from common import small_config
from harness import run_ranks
from tolerances import loss_rtol, trained_rtol, within

from fivefold.parallel.mesh import ParallelDims
from fivefold.train.trainer import Trainer

BASE = ["--model.num_layers", "2", "--train.gbs", "8", "--parallel.mbs", "2",
        "--train.steps", "6", "--train.lr", "1e-3"]
STEPS = 4
LOSS_RTOL = loss_rtol(tokens=8 * 32, depth=3 * 2)
TRAINED_RTOL = trained_rtol(tokens=8 * 32, depth=3 * 2)


def train(rank, world, tmp, args, steps=STEPS):
    cfg = small_config(pathlib.Path(tmp), *BASE, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    records = [trainer.train_step() for _ in range(steps)]
    params = {k[len("model/"):]: v for k, v in trainer.logical_tensors().items()
              if k.startswith("model/")}
    return [(r["loss"], r["grad_norm"]) for r in records], params


def rel(a, b):
    return abs(a - b) / abs(b)


LAYOUTS = {
    "tp2-dp2-zero1": ["--parallel.tp", "2", "--parallel.dp", "2", "--parallel.zero", "1"],
    "tp2-sp-dp2-zero3": ["--parallel.tp", "2", "--parallel.sp", "true", "--parallel.dp", "2",
                         "--parallel.zero", "3"],
    "tp4-dp2-zero1": ["--parallel.tp", "4", "--parallel.dp", "2", "--parallel.zero", "1"],
    "tp4-sp-dp2-zero3": ["--parallel.tp", "4", "--parallel.sp", "true", "--parallel.dp", "2",
                         "--parallel.zero", "3"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(0, 1, str(tmp_path_factory.mktemp("ref")), [])


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tp_dp_zero_match_single_process(name, reference, tmp_path):
    args = LAYOUTS[name]
    world = small_config(tmp_path, *BASE, *args).parallel.world_size
    ref_steps, ref_params = reference
    for steps, params in run_ranks(train, world, str(tmp_path), args):
        for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps):
            assert within(rel(loss, ref_loss), LOSS_RTOL, name)
            assert within(rel(norm, ref_norm), TRAINED_RTOL, name)
        for key, value in ref_params.items():
            err = float((params[key] - value).norm() / value.norm())
            assert within(err, TRAINED_RTOL, f"{name} {key}"), (key, err)


def save_after(rank, world, tmp, args, steps):
    cfg = small_config(pathlib.Path(tmp), *BASE, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    head = [trainer.train_step()["loss"] for _ in range(steps)]
    trainer.save_checkpoint()
    tail = [trainer.train_step()["loss"] for _ in range(3)]
    return head, tail


def resume(rank, world, tmp, args):
    cfg = small_config(pathlib.Path(tmp), *BASE, *args, "--checkpoint.resume", "latest")
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    assert trainer.step == 3
    return [trainer.train_step()["loss"] for _ in range(3)]


@pytest.mark.parity
def test_checkpoint_from_tp2_dp2_resumes_at_tp1_tp4_and_dp4(tmp_path):
    saved = ["--parallel.tp", "2", "--parallel.dp", "2", "--parallel.zero", "1"]
    _, continued = run_ranks(save_after, 4, str(tmp_path), saved, 3)[0]
    for layout, world in (([], 1), (["--parallel.tp", "4"], 4), (["--parallel.dp", "4"], 4),
                          (["--parallel.tp", "2", "--parallel.sp", "true", "--parallel.dp", "2",
                            "--parallel.zero", "3"], 4)):
        if world == 1:
            losses = resume(0, 1, str(tmp_path), layout)
        else:
            losses = run_ranks(resume, world, str(tmp_path), layout)[0]
        for got, expected in zip(losses, continued):
            assert within(rel(got, expected), LOSS_RTOL, layout), (layout, losses, continued)
