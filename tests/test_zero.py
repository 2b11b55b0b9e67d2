"""ZeRO through the Trainer: layout-independent checkpoints (resharding), and lost ranks."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tolerances import loss_rtol, within

from fivefold.config import Config, ParallelSection
from fivefold.parallel.mesh import ParallelDims


def trainer_cfg(ckpt_dir: str, dp: int, zero: int, resume: str = "") -> Config:
    cfg = Config()
    cfg.model.preset = "nano"
    cfg.model.overrides = {"vocab_size": 256, "tie_embeddings": True}  # the byte tokenizer
    cfg.data.tokenizer = "byte"
    cfg.parallel = ParallelSection(dp=dp, zero=zero, bucket_mb=0.02, mbs=1)
    tr = cfg.train
    tr.steps, tr.gbs, tr.seq_len, tr.lr, tr.warmup_steps = 6, 8, 32, 3e-3, 2
    tr.precision, tr.device, tr.eval_every = "fp32", "cpu", 0
    cfg.data.val_fraction = 0.0
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep = ckpt_dir, resume, 5
    cfg.log.dir = os.path.join(ckpt_dir, "log")
    return cfg


def _run_trainer(rank, world, ckpt_dir, zero, resume, save_at, steps):
    from fivefold.train.trainer import Trainer

    cfg = trainer_cfg(ckpt_dir, world, zero, resume)
    dims = ParallelDims.from_config(cfg.parallel)
    trainer = Trainer(cfg, dims, quiet=True)
    losses = []
    while trainer.step < steps:
        losses.append(trainer.train_step()["loss"])
        if trainer.step == save_at:
            trainer.save_checkpoint()
    return trainer.step, losses


@pytest.mark.parity
def test_checkpoint_at_dp4_zero3_resumes_at_dp2_zero1_and_dp1():
    """Saved after 3 steps at dp 4 / ZeRO-3; the next 3 losses at dp 2 / ZeRO-1 and at
    dp 1 equal those of the dp 4 run going on (fp32, tests/tolerances.py's loss bound at 8
    sequences of 32 tokens through nano's 2 blocks)."""
    with tempfile.TemporaryDirectory() as tmp:
        _, losses4 = run_ranks(_run_trainer, 4, tmp, 3, "", 3, 6)[0]
        _, losses2 = run_ranks(_run_trainer, 2, tmp, 1, "latest", -1, 6)[0]
        _, losses1 = run_ranks(_run_trainer, 1, tmp, 0, "latest", -1, 6)[0]
    assert len(losses4) == 6 and len(losses2) == 3 and len(losses1) == 3
    tol = loss_rtol(tokens=8 * 32, depth=3 * 2)
    for a, b, c in zip(losses4[3:], losses2, losses1):
        assert within(abs(b - a) / a, tol, "dp2") and within(abs(c - a) / a, tol, "dp1"), \
            (losses4, losses2, losses1)
    assert losses4[5] != losses4[3]  # the model keeps training: the losses are not frozen


# --- a rank dies mid-step ------------------------------------------------------------------
def _fault_rank(rank, world, init_file, out_dir, victim, how, timeout_s):
    # This rank's stderr (fd 2 and Python's, which pytest's capture replaced) to a file.
    sys.stderr = open(os.path.join(out_dir, f"err{rank}"), "w", buffering=1)  # noqa: SIM115
    os.dup2(sys.stderr.fileno(), 2)
    torch.set_num_threads(1)
    from test_data_parallel import GBS, SEQ, build, global_batch, make_cfg

    # gloo's own timeout is long: ending the hang within timeout_s is fivefold's doing.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    cfg = make_cfg(world, zero=2)
    cfg.parallel.timeout_s = timeout_s
    model, _, opt = build(cfg)
    if rank == victim:
        def die(_):
            with open(os.path.join(out_dir, "killed_at"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        model.layers[0].mlp.down_proj.weight.register_post_accumulate_grad_hook(
            lambda p: die(p) if step[0] == 2 else None)
    step = [0]
    per = GBS // world
    for step[0] in range(5):
        x, y = global_batch(step[0], 64)
        opt.zero_grad()
        opt.prepare_backward(True)
        (model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) / (GBS * SEQ)
         ).backward()
        opt.finish_grad_sync()
        opt.step(1e-3)
    os._exit(0)


def _fault_run(how: str, timeout_s: float = 3.0, world: int = 4, victim: int = 2):
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_fault_rank, args=(r, world, init, tmp, victim, how,
                                                         timeout_s)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.time() + 60
        survivors = [p for r, p in enumerate(procs) if r != victim]
        while time.time() < deadline and any(p.is_alive() for p in survivors):
            time.sleep(0.05)
        ended = time.time()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        killed_at = float(Path(tmp, "killed_at").read_text())
        errors = {r: Path(tmp, f"err{r}").read_text() for r in range(world)}
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    return codes, errors, ended - killed_at


def test_a_killed_rank_is_named_and_nothing_hangs():
    """SIGKILL rank 2 in its backward at step 2: gloo fails the others' collectives, and
    each survivor exits non-zero within parallel.timeout_s, naming rank 2."""
    codes, errors, took = _fault_run("kill", timeout_s=3.0)
    assert codes[2] == -signal.SIGKILL
    for r in (0, 1, 3):
        assert codes[r] not in (0, None), (r, codes, errors[r][-2000:])
        assert "lost rank 2" in errors[r], errors[r][-2000:]
        assert not any(f"lost rank {o}" in errors[r] for o in (0, 1, 3)), errors[r][-2000:]
    # Far below gloo's own 120 s: the watchdog ended it. How far below is a benchmark's
    # business (bench/runs/lost_rank.py: about timeout_s + a heartbeat on an idle machine).
    assert took < 30.0, f"survivors took {took:.1f} s"


def test_a_frozen_rank_is_named_within_the_timeout():
    """SIGSTOP rank 2 (alive, silent, holding its sockets: gloo would wait 120 s): the
    watchdog ends every survivor within parallel.timeout_s (+ one heartbeat), naming it."""
    codes, errors, took = _fault_run("stop", timeout_s=3.0)
    for r in (0, 1, 3):
        assert codes[r] not in (0, None), (r, codes)
        assert "lost rank 2" in errors[r], errors[r][-2000:]
        assert not any(f"lost rank {o}" in errors[r] for o in (0, 1, 3)), errors[r][-2000:]
    # Far below gloo's own 120 s: the watchdog ended it. How far below is a benchmark's
    # business (bench/runs/lost_rank.py: about timeout_s + a heartbeat on an idle machine).
    assert took < 30.0, f"survivors took {took:.1f} s"
