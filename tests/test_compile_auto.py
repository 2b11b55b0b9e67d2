"""train.compile = auto (the default): each block compiled on CUDA, eager on a CPU; the old
booleans still work, anything else is one line and exit 2."""

import subprocess
import sys

import pytest

from fivefold import config as fconfig
from fivefold.config.train import compile_value, resolve_compile
from fivefold.errors import ConfigError


@pytest.mark.parametrize("given,value", [("auto", "auto"), ("true", "true"), ("on", "true"),
                                         (True, "true"), ("false", "false"), (False, "false"),
                                         ("0", "false")])
def test_compile_values(given, value):
    cfg = fconfig.from_dict({"train": {"compile": given}})
    assert cfg.train.compile == value == compile_value(given)


def test_auto_compiles_on_cuda_only():
    assert fconfig.Config().train.compile == "auto"
    assert resolve_compile("auto", "cuda") is True
    assert resolve_compile("auto", "cpu") is False
    assert resolve_compile("auto", "meta") is False
    assert resolve_compile("true", "cpu") is True
    assert resolve_compile("false", "cuda") is False
    with pytest.raises(ConfigError, match="train.compile = 'sometimes'"):
        compile_value("sometimes")


def test_auto_trains_eager_on_a_cpu(tmp_path):
    """The default on a CPU: no block is compiled (torch.compile leaves a module's
    _compiled_call_impl set); the key resolves to a bool once the device is known."""
    from common import small_config

    from fivefold.train.trainer import Trainer

    trainer = Trainer(small_config(tmp_path), quiet=True)
    try:
        assert trainer.cfg.train.compile is False
        blocks = list(trainer.model.chunks[0].layers)
        assert blocks and all(getattr(b, "_compiled_call_impl", None) is None for b in blocks)
    finally:
        trainer.close()


def test_a_bad_compile_value_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--train.compile",
                           "sometimes", "--checkpoint.dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.compile" in lines[0], proc.stderr
