"""Hugging Face weights for training: checked like `load_hf`, and each rank reads only its slices.

`fivefold train --model.hf_path DIR` fills a model that is already split: a tensor-parallel
rank holds a slice of a matrix, a pipeline stage some layers. So:

1. The safetensors headers (names, dtypes, shapes, byte offsets; no tensor data) are read
   from every shard, and checked against the model's logical shapes before anything is
   copied: an unexpected tensor, a missing one, a wrong shape (a (1, 64) tensor is never
   broadcast into a (64, 64) parameter) or a tensor stored twice is one line naming it.
2. Each local parameter reads just its box of the stored tensor with positioned reads into
   a buffer of the box's size: a row slice is one read, a column slice one read per row.
   No file is memory-mapped, so a rank's peak host memory while loading is about its own
   slices plus one parameter, not the checkpoint.

Mixture-of-experts checkpoints store one tensor per expert where fivefold stacks them; those
stream one stored tensor at a time through `iter_hf_tensors` instead, with the same checks.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.config import ConfigError
from fivefold.models.hf import _weight_files, check_tensor, hf_to_ours, ours_to_hf
from fivefold.models.init import build_meta
from fivefold.models.presets import ModelConfig

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass
class Stored:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte, from the start of the file


def _header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20 or length > os.path.getsize(path):
                raise ValueError("header length out of range")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"{path} is damaged (its safetensors header cannot be read: {e}); "
                          f"re-download or re-export it") from None
    header.pop("__metadata__", None)
    return {name: (info, 8 + length) for name, info in header.items()}


def stored_tensors(directory: str | os.PathLike, tied: bool) -> dict[str, Stored]:
    """Our name -> where and how each weight is stored, from the headers alone."""
    out: dict[str, Stored] = {}
    for path in _weight_files(Path(directory)):
        size = os.path.getsize(path)
        for hf_name, (info, base) in _header(path).items():
            if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
                continue
            name = hf_to_ours(hf_name)
            if name in out:
                raise ConfigError(f"{directory}: tensor '{hf_name}' is stored twice; fix the "
                                  f"safetensors index")
            try:
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                start, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"{path}: the header entry of '{hf_name}' is malformed "
                                  f"({info}); re-export the checkpoint") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if end - start != nbytes or base + end > size:
                raise ConfigError(f"{path} is damaged: tensor '{hf_name}' needs bytes "
                                  f"{start}-{end} of a {size}-byte file (truncated?); "
                                  f"re-download or re-export it")
            out[name] = Stored(path, dtype, shape, base + start)
    return out


def check_against(stored: dict[str, Stored], cfg: ModelConfig, source: str) -> None:
    """Every logical parameter present with its shape, nothing else: one line otherwise."""
    logical = {n: tuple(p.shape) for n, p in build_meta(cfg).named_parameters()}
    for name, entry in stored.items():
        check_tensor(source, name, tuple(entry.shape), logical)
    missing = [n for n in logical if n not in stored]
    if missing:
        raise ConfigError(f"{source}: missing tensor '{ours_to_hf(missing[0])}'"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                          f"the checkpoint is incomplete or for another model")


def read_box(entry: Stored, box: list[tuple[int, int]]) -> torch.Tensor:
    """The sub-tensor [start:stop) along every dimension, read with positioned reads."""
    sizes = [stop - start for start, stop in box]
    out = torch.empty(sizes, dtype=entry.dtype)
    if out.numel() == 0:
        return out
    sliced = [d for d, (start, stop) in enumerate(box) if (start, stop) != (0, entry.shape[d])]
    k = sliced[-1] if sliced else 0  # contiguous runs: the box's extent in dims k, k+1, ...
    strides = [math.prod(entry.shape[d + 1:]) for d in range(len(entry.shape))]
    run = out.numel() if not sliced else sizes[k] * strides[k]
    leading = itertools.product(*(range(a, b) for a, b in box[:k])) if sliced else [()]
    item = entry.dtype.itemsize
    raw = memoryview(out.view(-1).view(torch.uint8).numpy())
    with open(entry.path, "rb", buffering=0) as f:
        for j, index in enumerate(leading):
            first = sum(i * s for i, s in zip(index, strides)) + (
                box[k][0] * strides[k] if sliced else 0)
            chunk = raw[j * run * item:(j + 1) * run * item]
            f.seek(entry.offset + first * item)
            if f.readinto(chunk) != len(chunk):
                raise ConfigError(f"{entry.path} ended early while reading a tensor; the file "
                                  f"is truncated, re-download it")
    return out


def _box(param: torch.Tensor, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    box = [(0, n) for n in shape]
    spec = getattr(param, "_tp_slice", None)
    if spec is not None:
        dim, start, stop = spec
        box[dim] = (start, stop)
    return box


def load_hf_slices(directory: str | os.PathLike, named_params, cfg: ModelConfig) -> None:
    """Fill this rank's parameters (logical names) from a Hugging Face directory."""
    source = str(directory)
    if cfg.num_experts:
        _load_streamed(directory, named_params, cfg, source)
        return
    stored = stored_tensors(directory, cfg.tie_embeddings)
    check_against(stored, cfg, source)
    with torch.no_grad():
        for name, p in named_params:
            entry = stored[name]
            piece = read_box(entry, _box(p, entry.shape))
            spec = getattr(p, "_tp_slice", None)
            if spec is not None and piece.shape[spec[0]] < p.shape[spec[0]]:  # padding rows
                padded = torch.zeros(p.shape, dtype=piece.dtype)
                padded.narrow(spec[0], 0, piece.shape[spec[0]]).copy_(piece)
                piece = padded
            p.copy_(piece.to(p.dtype))


def _load_streamed(directory, named_params, cfg: ModelConfig, source: str) -> None:
    from fivefold.models.hf import iter_hf_tensors
    from fivefold.parallel.shards import local_piece

    logical = {n: tuple(p.shape) for n, p in build_meta(cfg).named_parameters()}
    local = dict(named_params)
    seen = set()
    with torch.no_grad():
        for name, tensor in iter_hf_tensors(directory):
            if name.endswith(".mlp.router.expert_bias"):  # dots.llm1's e_score_correction_bias
                raise ConfigError(f"{source}: training from a checkpoint whose routers hold an "
                                  f"expert bias is not supported yet (it would restart at zero "
                                  f"and route otherwise); generate, convert and evaluate read it")
            check_tensor(source, name, tuple(tensor.shape), logical)
            seen.add(name)
            if name in local:
                local[name].copy_(local_piece(local[name], tensor).to(local[name].dtype))
    missing = [n for n in logical if n not in seen]
    if missing:
        raise ConfigError(f"{source}: missing tensor '{ours_to_hf(missing[0])}'; the "
                          f"checkpoint is incomplete or for another model")
