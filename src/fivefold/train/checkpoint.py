"""Checkpoints that do not depend on the layout that wrote them.

A checkpoint is a torch.distributed.checkpoint (DCP) directory holding one *logical* tensor
per name — the full, unsplit tensor the single-device model would have — for the weights
(`model/NAME`), the fp32 master weights and Adam moments (`optim/NAME/master`, ...), plus the
trainer's small state (step, data position, loss scaler). Every rank contributes the logical
tensors of its own parameters; DCP writes each key once (its save planner drops duplicates),
and on load each rank reads back only the keys it needs and cuts its own shard. So a run
saved at dp 4 with ZeRO-3 resumes at dp 2, at tp 2 or at pp 2: resharding is slicing.

Writes are atomic: everything goes into `step_N.tmp`, and only when every rank has finished
is it renamed to `step_N` and the `latest` pointer replaced. A crash mid-save leaves the last
good checkpoint untouched; the leftover `.tmp` directory is removed by the next save.
The last file written before the publish is `manifest.json`, the size and sha256 of every
file of the step (train/manifest.py); every load checks it first, so a truncated or corrupted
shard is one line naming the bad step and the newest good one, never NaN losses.

Retention keeps the newest `keep` steps at or below the step just saved, by step number: a
run resumed from an older step never deletes what it has just written, and leaves the steps
of the abandoned later history alone.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fivefold.config import ConfigError
from fivefold.train.manifest import (  # noqa: F401 - verify_step is this module's API too
    damaged_message,
    published_steps,
    verify_step,
    write_manifest,
)

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "tie_embeddings", "qkv_bias", "mlp", "norm")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def resolve(root: str, resume: str) -> Path | None:
    """The checkpoint to resume from: 'latest' reads the pointer file; a path is itself."""
    if not resume:
        return None
    if resume != "latest":
        return Path(resume)
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None  # nothing saved yet: start fresh
    path = Path(root) / pointer.read_text().strip()
    aside = path.with_name(path.name + ".old")
    if not path.exists() and (aside / "meta.json").is_file():
        return aside  # a crash between the two renames of a re-save: the old copy is whole
    if not (path / "meta.json").is_file():
        raise ConfigError(damaged_message(path, f"{pointer} names it but it is incomplete",
                                          "checkpoint.resume"))
    return path


def ensure_intact(path: Path, fix: str = "checkpoint.resume") -> None:
    """Raise a one-line ConfigError when the step directory fails its manifest check."""
    problem = verify_step(path) if (Path(path) / "meta.json").is_file() else None
    if problem:
        raise ConfigError(damaged_message(path, problem, fix))


def read_meta(path: Path, fix: str = "checkpoint.resume") -> dict:
    """The step's meta.json, after checking every file of the step against its manifest."""
    ensure_intact(path, fix)
    meta_file = Path(path) / "meta.json"
    if not meta_file.is_file():
        raise ConfigError(f"{path} has no meta.json: it is not a fivefold checkpoint (or its "
                          f"save did not finish); give a step_* directory or a checkpoint.dir")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise ConfigError(f"{meta_file} is garbled (not the JSON a fivefold save writes); use "
                          f"another step_* directory")
    return meta


def check_model_shape(meta: dict, model_cfg, path: Path) -> None:
    saved = meta["model"]
    for key in SHAPE_KEYS:
        if key in saved and saved[key] != getattr(model_cfg, key):
            raise ConfigError(
                f"checkpoint {path} holds a model with {key} = {saved[key]}, but the config "
                f"asks for {getattr(model_cfg, key)}; use the checkpoint's model settings or "
                f"a different checkpoint.dir")


def save(root: str, step: int, tensors: dict[str, torch.Tensor], trainer_state: dict,
         meta: dict, keep: int) -> Path:
    """Write one checkpoint atomically; keep the newest `keep`. Every rank calls this."""
    root_path = Path(root)
    final = step_dir(root_path, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        root_path.mkdir(parents=True, exist_ok=True)
        for stale in root_path.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():  # DCP warns that a single process saves without a group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"tensors": tensors, "trainer": trainer_state}, checkpoint_id=str(tmp))
    torch.save(torch.get_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        write_manifest(tmp)  # last: it describes every file above
        aside = final.with_name(final.name + ".old")
        if final.exists():  # the same step saved again: keep the old copy until the new is in
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
        pointer_tmp = root_path / "latest.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, root_path / "latest")
        retire_old_steps(root_path, step, keep)
    _barrier()
    return final


def retire_old_steps(root: Path, saved_step: int, keep: int) -> None:
    """Keep the newest `keep` steps up to `saved_step` (by number, not name); later steps
    belong to a history this run replaced from an older checkpoint and are not ours to drop."""
    ours = [path for step, path in published_steps(root) if step <= saved_step]
    for old in ours[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, tensors: dict[str, torch.Tensor], trainer_state: dict,
         fix: str = "checkpoint.resume") -> None:
    """Fill `tensors` (logical shapes, keys this rank needs) and `trainer_state` in place."""
    state = {"tensors": tensors, "trainer": trainer_state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # a step saved before manifests, damaged: still one line
            first = str(e).strip().splitlines()
            why = f"reading it failed ({type(e).__name__}: {first[-1] if first else ''})"
            raise ConfigError(damaged_message(path, why[:300], fix)) from e
    trainer_state.update(state["trainer"])
    rng = Path(path) / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng))


def load_model_for_inference(path: str):
    """(model, model_cfg, tokenizer_spec) from a checkpoint directory, on CPU in fp32.

    `path` may be a step_* directory or a checkpoint root holding a `latest` pointer.
    """
    from fivefold.models.init import build_meta
    from fivefold.models.presets import ModelConfig

    p = Path(path)
    if (p / "latest").is_file():
        p = p / (p / "latest").read_text().strip()
    meta = read_meta(p, fix="--checkpoint")
    model_cfg = ModelConfig(**meta["model"])
    model = build_meta(model_cfg)
    model.to_empty(device="cpu")
    from fivefold.parallel.expert import expert_param_ids
    from fivefold.parallel.shards import expert_key

    experts = expert_param_ids([model])  # stacked expert weights are saved one expert a key
    stacked = {n for n, t in model.named_parameters() if id(t) in experts}
    tensors = {}
    for n, t in model.state_dict().items():
        if n in stacked:
            tensors.update({f"model/{expert_key(n, j)}": torch.empty(t.shape[1:])
                            for j in range(t.shape[0])})
        else:
            tensors[f"model/{n}"] = torch.empty_like(t, dtype=torch.float32)
    load(p, tensors, {}, fix="--checkpoint")
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in stacked:
                param.copy_(torch.stack([tensors[f"model/{expert_key(name, j)}"]
                                         for j in range(param.shape[0])]))
            else:
                param.copy_(tensors[f"model/{name}"])
    from fivefold.models.llama import Rotary, rope_inv_freq

    for module in model.modules():
        if isinstance(module, Rotary):
            module.inv_freq = rope_inv_freq(module.cfg)
    return model.eval(), model_cfg, meta.get("tokenizer", "byte")
