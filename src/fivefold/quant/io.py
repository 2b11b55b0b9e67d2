"""Quantised checkpoints: one directory that `fivefold generate`, `eval` and `serve` load.

Layout of a directory written by `fivefold quantize`:

    quantized.json      format, version, the QuantSpec, the model shape (ModelConfig), the
                        tokenizer, which linears are quantised, the size report and where
                        the weights came from
    model.safetensors   every persistent tensor of the quantised model: packed codes,
                        scales and zero points as the quant/linear.py buffers name them,
                        and the float embedding, norms and head
    tokenizer.json      a copy of the tokenizer, when it is a file (not built in)

Loading builds the model from its shape without allocating float weights for the linears,
swaps in empty quantised layers at the recorded names and loads the state dict strictly.
Writing goes to a temporary sibling directory renamed into place, so a failed or
interrupted write leaves no half checkpoint and never touches an existing one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

from torch import nn

from fivefold.config import ConfigError
from fivefold.config.rules import QUANTIZED_MARKER
from fivefold.quant.convert import QuantSpec, quantize_structure_
from fivefold.quant.linear import QuantLinear

FORMAT = "fivefold-quantized"
VERSION = 1
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"


def is_quantized(path: str | os.PathLike) -> bool:
    return (Path(path) / QUANTIZED_MARKER).is_file()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def size_report(float_bytes: int, float_element_size: int, quant_model: nn.Module) -> dict:
    """Bytes of the weights before (`float_bytes`: the float model's state dict as loaded,
    taken before quantising) and after, for the quantised linears and the whole model."""
    after = tensor_bytes(quant_model.state_dict().values())
    quantised = [m for m in quant_model.modules() if isinstance(m, QuantLinear)]
    linear_after = sum(m.quantized_bytes() for m in quantised)
    linear_params = sum(m.in_features * m.out_features for m in quantised)
    return {"model_bytes_before": float_bytes, "model_bytes_after": after,
            "linear_bytes_before": linear_params * float_element_size,
            "linear_bytes_after": linear_after,
            "linear_bits_per_param": 8 * linear_after / max(linear_params, 1),
            "quantized_linears": len(quantised)}


def describe_size(report: dict) -> str:
    mib = 1 << 20
    return (f"size: linears {report['linear_bytes_before'] / mib:.2f} MiB -> "
            f"{report['linear_bytes_after'] / mib:.2f} MiB "
            f"({report['linear_bits_per_param']:.2f} bits/param, "
            f"{report['quantized_linears']} linears); whole model "
            f"{report['model_bytes_before'] / mib:.2f} MiB -> "
            f"{report['model_bytes_after'] / mib:.2f} MiB "
            f"({report['model_bytes_before'] / max(report['model_bytes_after'], 1):.2f}x "
            f"smaller)")


def _tokenizer_entry(spec, staging: Path):
    """The tokenizer as quantized.json records it; a tokenizer file is copied alongside."""
    if isinstance(spec, dict):
        spec = spec.get("path") or "byte"
    spec = str(spec)
    if spec.endswith(".json") and Path(spec).is_file():
        shutil.copyfile(spec, staging / TOKENIZER)
        return TOKENIZER
    return spec


def save_quantized(model: nn.Module, model_cfg, spec: QuantSpec, out: str | os.PathLike,
                   tokenizer, source: dict, report: dict, overwrite: bool = False,
                   extra: dict | None = None) -> Path:
    """Write the directory atomically (see the module docstring)."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out} already exists; give a new directory or add "
                          f"--overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(staging / WEIGHTS), metadata={"format": FORMAT})
        manifest = {"format": FORMAT, "version": VERSION, "quant": spec.to_dict(),
                    "model": dataclasses.asdict(model_cfg),
                    "tokenizer": _tokenizer_entry(tokenizer, staging),
                    "quantized": names, "size": report, "source": source, **(extra or {})}
        (staging / QUANTIZED_MARKER).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            retired = out.with_name(f".{out.name}.old")
            out.rename(retired)
            staging.rename(out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def read_manifest(path: str | os.PathLike) -> dict:
    p = Path(path) / QUANTIZED_MARKER
    try:
        manifest = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p} cannot be read ({e}); quantise the model again with "
                          f"`fivefold quantize`") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ConfigError(f"{p} is not a version-{VERSION} {FORMAT} manifest; quantise the "
                          f"model again with this fivefold")
    return manifest


def load_quantized(path: str | os.PathLike, device="cpu"):
    """(model, model_cfg, tokenizer_spec) from a quantised checkpoint directory."""
    from safetensors.torch import load_file

    from fivefold.models.init import build_meta
    from fivefold.models.llama import Rotary, rope_inv_freq
    from fivefold.models.presets import MODEL_FIELDS, ModelConfig

    p = Path(path)
    manifest = read_manifest(p)
    unknown = sorted(set(manifest["model"]) - set(MODEL_FIELDS))
    if unknown:
        raise ConfigError(f"{p / QUANTIZED_MARKER} describes a model with {unknown[0]}, which "
                          f"this fivefold does not know; load it with the version that saved it")
    model_cfg = ModelConfig(**manifest["model"])
    model = build_meta(model_cfg)
    spec = QuantSpec(**manifest["quant"])
    quantize_structure_(model, spec, manifest["quantized"])
    model.to_empty(device=device)
    weights = p / WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{weights} is missing; the quantised checkpoint is incomplete, "
                          f"quantise the model again")
    state = load_file(str(weights), device=str(device))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ConfigError(f"{weights} does not match {p / QUANTIZED_MARKER} "
                          f"({first[1].strip() if len(first) > 1 else first[0]}); quantise the "
                          f"model again") from None
    for module in model.modules():
        if isinstance(module, Rotary):
            module.inv_freq = rope_inv_freq(module.cfg).to(device)
    tokenizer = manifest.get("tokenizer", "byte")
    if tokenizer == TOKENIZER:
        tokenizer = str(p / TOKENIZER)
    return model.eval(), model_cfg, tokenizer
