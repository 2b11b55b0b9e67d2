"""Dimensions composed through the trainer: TP × DP × ZeRO parity, and checkpoints that
reshard across tp and dp. Reference: the single-process run of the same config (fp32).

Tolerances: loss ≤ 1e-6 relative per step, gradient norm ≤ 1e-5 relative per step, final
parameters ≤ 1e-5 relative (‖a − b‖ / ‖b‖ per tensor); resumed losses ≤ 1e-5 relative.
"""

import pathlib

import pytest
from common import small_config
from harness import run_ranks

from fivefold.parallel.mesh import ParallelDims
from fivefold.train.trainer import Trainer

BASE = ["--model.num_layers", "2", "--train.gbs", "8", "--parallel.mbs", "2",
        "--train.steps", "6", "--train.lr", "1e-3"]
STEPS = 4


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


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tp_dp_zero_match_single_process(name, reference, tmp_path):
    args = LAYOUTS[name]
    world = small_config(tmp_path, *BASE, *args).parallel.world_size
    ref_steps, ref_params = reference
    for steps, params in run_ranks(train, world, str(tmp_path), args):
        for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps):
            assert rel(loss, ref_loss) <= 1e-6
            assert rel(norm, ref_norm) <= 1e-5
        for key, value in ref_params.items():
            assert float((params[key] - value).norm() / value.norm()) <= 1e-5, key


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
            assert rel(got, expected) <= 1e-5, (layout, losses, continued)
