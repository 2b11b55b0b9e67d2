"""The model and tokenizer an evaluation runs: through the loader `fivefold generate` uses
(a fivefold checkpoint, a LoRA or quantised one, or a Hugging Face directory), so what is
evaluated is what is generated from."""

from __future__ import annotations

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
    """The step's meta.json, checked against its manifest. For a quantised checkpoint
    (`fivefold quantize`), the meta.json of the fivefold checkpoint it was made from, so
    its validation split is the one the float model held out."""
    from fivefold.quant.io import is_quantized, read_manifest
    from fivefold.train.checkpoint import read_meta

    if is_quantized(checkpoint):
        source = read_manifest(checkpoint).get("source") or {}
        if not source.get("checkpoint"):
            raise ConfigError(f"--checkpoint {checkpoint} was quantised from "
                              f"{source.get('hf') or 'a model'} with no validation split on "
                              f"record; give --data TOKENS")
        return read_meta(step_path(source["checkpoint"]), fix="--data TOKENS")
    return read_meta(step_path(checkpoint), fix="--checkpoint")


def load_model(args) -> tuple:
    """(model in eval mode, codec with encode/decode/eos_id) from args.checkpoint or args.hf;
    args carries device and dtype as `fivefold generate` takes them. The generate loader
    also reads the checkpoints `fivefold quantize` writes."""
    from fivefold.train.generate import load_for_generation

    if args.checkpoint:
        step_path(args.checkpoint)  # a missing path is one line before anything is imported
    return load_for_generation(args)
