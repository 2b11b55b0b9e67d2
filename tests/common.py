"""Small configs shared by the tests."""

from __future__ import annotations

from fivefold import config


def small_config(tmp_path, *overrides: str, **kw) -> config.Config:
    """A tiny fp32 run on the bundled corpus that writes only under tmp_path."""
    args = [
        "--model.hidden_size", "32", "--model.intermediate_size", "64",
        "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--train.seq_len", "32", "--train.gbs", "4", "--train.steps", "5",
        "--train.warmup_steps", "0", "--train.eval_every", "0", "--train.precision", "fp32",
        "--train.device", "cpu",
        "--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.every", "0",
        "--log.dir", str(tmp_path / "log"), "--log.progress", "false",
        "--log.tensorboard", "false",
        # The tests' model and micro-batching, pinned: the byte tokenizer with tiny's
        # vocabulary, one sequence per micro-batch (the defaults are the default job's).
        "--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
        *overrides,
    ]
    return config.load(None, args)
