"""The model and tokenizer an evaluation runs: through the loaders `fivefold generate` uses
(a fivefold checkpoint, or a Hugging Face directory), so what is evaluated is what is
generated from. A quantised checkpoint goes through the quantisation package's loader when
that package provides one."""

from __future__ import annotations

import importlib
from pathlib import Path

from fivefold.config import ConfigError


def step_path(checkpoint: str | Path) -> Path:
    """A step_* directory, or the one a checkpoint root's `latest` pointer names."""
    path = Path(checkpoint)
    if not path.exists():
        raise ConfigError(f"--checkpoint {path} does not exist; give a step_* directory or a "
                          f"checkpoint.dir")
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    return path


def checkpoint_meta(checkpoint: str | Path) -> dict:
    """The step's meta.json, checked against its manifest."""
    from fivefold.train.checkpoint import read_meta

    return read_meta(step_path(checkpoint), fix="--checkpoint")


def _quantized_loader():
    """fivefold.quant's checkpoint loader, when the installed version has one."""
    try:
        module = importlib.import_module("fivefold.quant.io")
    except ImportError:
        return None
    return getattr(module, "load_quantized", None)


def load_model(args) -> tuple:
    """(model in eval mode, codec with encode/decode/eos_id) from args.checkpoint or args.hf;
    args carries device and dtype as `fivefold generate` takes them."""
    from fivefold.train.generate import load_for_generation

    if args.checkpoint:
        step_path(args.checkpoint)  # a missing path is one line before anything is imported
        loader = _quantized_loader()
        if loader is not None and getattr(importlib.import_module("fivefold.quant.io"),
                                           "is_quantized", lambda _p: False)(args.checkpoint):
            return loader(args)
    return load_for_generation(args)
