"""Checkpoints of the optimizers' states: saved as they are (8-bit codes and block scales,
Muon's momentum), resumed bit-exactly under another layout; adamw -> adamw8bit converts;
another optimizer is one line."""

from __future__ import annotations

import os
import tempfile

import pytest
from harness import run_ranks

from fivefold.config import Config, ConfigError, ParallelSection
from fivefold.parallel.mesh import ParallelDims

STEPS, SAVE_AT = 4, 2


def _cfg(ckpt_dir, optimizer, dp=1, zero=0, resume=""):
    cfg = Config()
    cfg.model.preset = "nano"  # with tensors big enough to quantise (>= 4096 values)
    cfg.model.overrides = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
    cfg.data.tokenizer = "byte"
    cfg.parallel = ParallelSection(dp=dp, zero=zero, bucket_mb=0.02, mbs=1)
    tr = cfg.train
    tr.steps, tr.gbs, tr.seq_len, tr.lr, tr.warmup_steps = STEPS, 4, 32, 3e-3, 1
    tr.precision, tr.device, tr.eval_every, tr.optimizer = "fp32", "cpu", 0, optimizer
    cfg.data.val_fraction = 0.0
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep = ckpt_dir, resume, 3
    cfg.log.dir = os.path.join(ckpt_dir, "log")
    return cfg


def _train(rank, world, ckpt_dir, optimizer, zero, resume, save_at):
    from fivefold.train.trainer import Trainer

    cfg = _cfg(ckpt_dir, optimizer, world, zero, resume)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    losses = []
    while trainer.step < STEPS:
        losses.append(trainer.train_step()["loss"])
        if trainer.step == save_at:
            trainer.save_checkpoint()
    trainer.close()
    return losses


def test_8bit_states_saved_at_dp2_zero3_resume_in_one_process():
    """The dp2/ZeRO-3 run saves its codes and scales at step 2 and goes on; one process
    resumes from the save: its steps 3-4 equal the dp2 run's to 1e-6 relative (the states
    are read back exactly, whole blocks each; what differs is the order of the gradient sums
    across the layouts, as for AdamW in test_zero.py)."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as tmp:
        dp2 = run_ranks(_train, 2, tmp, "adamw8bit", 3, "", SAVE_AT)[0]
        resumed = _train(0, 1, tmp, "adamw8bit", 0, "latest", -1)
        keys = dcp.FileSystemReader(tmp + "/step_00000002").read_metadata().state_dict_metadata
    assert len(resumed) == STEPS - SAVE_AT
    for a, b in zip(resumed, dp2[SAVE_AT:]):
        assert abs(a - b) <= 1e-6 * b, (resumed, dp2)
    name = "optim/layers.0.mlp.up_proj.weight"
    assert keys[f"{name}/exp_avg_codes"].size == (128, 64)  # uint8, one per value
    assert keys[f"{name}/exp_avg_sq_scale"].size == (32,)  # one per 256-value block
    assert "optim/layers.0.self_attn.k_proj.weight/exp_avg" in keys  # 2048 values: fp32


def test_adamw_checkpoint_resumes_as_adamw8bit_and_other_optimizers_are_refused():
    from fivefold.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        _train(0, 1, tmp, "adamw", 0, "", SAVE_AT)
        losses = _train(0, 1, tmp, "adamw8bit", 0, "latest", -1)  # quantises the moments
        assert len(losses) == STEPS - SAVE_AT
        with pytest.raises(ConfigError) as e:
            Trainer(_cfg(tmp, "muon", resume="latest"), quiet=True)
    msg = str(e.value)
    assert "holds train.optimizer = adamw states" in msg and "\n" not in msg
