"""Checkpoints that do not depend on the layout that wrote them, written and read in shards.

A checkpoint is a torch.distributed.checkpoint (DCP) directory holding one *logical* tensor
per name — the full, unsplit tensor the single-device model would have — for the weights
(`model/NAME`), the fp32 master weights and Adam moments (`optim/NAME/master`, ...), plus the
trainer's small state (step, data position, loss scaler). No rank ever holds a logical
tensor whole: each describes what it owns as `Chunked` parts — boxes of the logical tensor
(its tensor-parallel slice, cut to its ZeRO range) that are views of its flat shards — and
DCP writes those parts as the tensor's chunks (replicas hold identical boxes, which DCP's
save planner writes once; it also checks that the chunks tile the tensor exactly). On load
each rank asks for the boxes it owns under its own layout; DCP reads from every saved chunk
that overlaps one, straight into the views. Each saved tensor must be one the model reads,
with its exact logical shape (train/checkpoint_planners.py: another model is refused in one
line, never read in part). So a run saved at dp 4 with ZeRO-3 resumes at dp 2, at tp 2 or
at pp 2: resharding is intersecting boxes, and no rank's memory grows beyond a saved chunk
in transit.

Writes are atomic and durable: everything goes into `step_N.tmp`; when every rank has
finished, its files and the directory are fsynced, and only then is it renamed to `step_N`
and the `latest` pointer replaced (each rename followed by an fsync of the parent). A crash
before the rename leaves the last good checkpoint untouched; the leftover `.tmp` directory
is removed by the next save. The last file written before the publish is `manifest.json`,
the size and sha256 of every file of the step (train/manifest.py); every load checks it
first, so a truncated or corrupted shard is one line naming the bad step and the newest
good one, never NaN losses. A file that cannot be written (a full disk) raises on every
rank at the same point, so no rank waits for a peer that has given up.

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
from torch.distributed.checkpoint.api import CheckpointException

from fivefold.config import ConfigError
from fivefold.models.presets import PARAMETER_KEYS  # noqa: F401 - this module's API too
from fivefold.train.checkpoint_planners import (  # noqa: F401 - Chunked, ModelMismatch: API here
    Chunked,
    ChunkedLoadPlanner,
    ChunkedSavePlanner,
    ModelMismatch,
)
from fivefold.train.manifest import (  # noqa: F401 - verify_step is this module's API too
    damaged_message,
    published_steps,
    verify_step,
    write_manifest,
)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then the directories (so the names are durable too)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _step_of(path: Path) -> int | None:
    name = path.name.removesuffix(".old")
    digits = name.removeprefix("step_")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def candidates(root: str, resume: str) -> list[Path]:
    """The checkpoints to resume from, best first.

    'never' (or ''): none. A path: that one alone. 'auto': the step the `latest` pointer
    names, then every older published step, newest first; a step's `.old` copy stands in for
    it when a re-save crashed between its two renames. Steps above the one `latest` names
    belong to a history that a resume replaced and are not offered. The trainer loads the
    first that loads and says why it skipped any before it. 'latest': the first of auto's
    alone (no fallback: a damaged one is an error naming the newest good one).
    """
    if resume in ("", "never"):
        return []
    if resume == "latest":
        return candidates(root, "auto")[:1]
    if resume != "auto":
        return [Path(resume)]
    root_path = Path(root)
    if not root_path.is_dir():
        return []
    steps: dict[int, Path] = {}
    for path in root_path.glob("step_*"):
        step = _step_of(path)
        if step is None or path.suffix == ".tmp" or not path.is_dir():
            continue
        if path.suffix != ".old" or step not in steps:
            steps[step] = path  # the renamed-in copy wins over the one moved aside
    pointer = root_path / "latest"
    named = _step_of(Path(pointer.read_text().strip())) if pointer.is_file() else None
    if named is not None:
        steps = {s: p for s, p in steps.items() if s <= named}
    return [steps[s] for s in sorted(steps, reverse=True)]


def resolve(root: str, resume: str) -> Path | None:
    """The first of `candidates` (None: start fresh)."""
    found = candidates(root, resume)
    return found[0] if found else None


def ensure_intact(path: Path, fix: str = "checkpoint.resume", strict: bool | None = None
                  ) -> None:
    """Raise a one-line ConfigError when the step directory fails its manifest check.
    `strict`: a step without a manifest listing every file fails it too; by default it is
    for the commands that name a step with --checkpoint (generate, convert: they refuse an
    incomplete step) and not for training (which falls back to the step before)."""
    strict = fix == "--checkpoint" if strict is None else strict
    problem = verify_step(path, strict) if (Path(path) / "meta.json").is_file() else None
    if problem:
        raise ConfigError(damaged_message(path, problem, fix, strict))


def read_meta(path: Path, fix: str = "checkpoint.resume", strict: bool | None = None) -> dict:
    """The step's meta.json, after checking every file of the step against its manifest."""
    ensure_intact(path, fix, strict)
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
    """The saved model config against this one, key by key of PARAMETER_KEYS (a key an older
    save did not record is left to the tensor check of `load`)."""
    saved = meta["model"]
    for key in PARAMETER_KEYS:
        if key in saved and saved[key] != getattr(model_cfg, key):
            raise ModelMismatch(
                f"checkpoint {path} holds a model with model.{key} = {saved[key]}, but the "
                f"config asks for {getattr(model_cfg, key)}; use the checkpoint's model "
                f"settings or a different checkpoint.dir")


class WriteFailed(OSError):
    """A file of the checkpoint could not be written, on this rank or on another (each rank
    raises it at the same point, so none is left waiting in a barrier)."""


def _all_agree(problem: OSError | RuntimeError | None) -> None:
    """Raise on every rank when a file write failed on any: this rank's own error, or a
    WriteFailed naming another rank's. A plain barrier otherwise."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([0.0 if problem is None else 1.0 + _rank()], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed_rank = int(flag.item()) - 1
    else:
        failed_rank = -1 if problem is None else 0
    if problem is not None:
        raise problem
    if failed_rank >= 0:
        raise WriteFailed(f"rank {failed_rank} could not write its checkpoint files")


def save(root: str, step: int, tensors: dict[str, Chunked], trainer_state: dict,
         meta: dict, keep: int) -> Path:
    """Write one checkpoint atomically; keep the newest `keep`. Every rank calls this with
    the parts it owns (replicas may pass the same parts: each is written once). A write that
    fails on any rank raises on every rank (DCP's CheckpointException for the shards, which
    DCP itself spreads; OSError or WriteFailed for the files around them)."""
    root_path = Path(root)
    final = step_dir(root_path, step)
    tmp = final.with_name(final.name + ".tmp")
    problem = None
    if _rank() == 0:
        try:
            root_path.mkdir(parents=True, exist_ok=True)
            for stale in root_path.glob("step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            problem = e
    _all_agree(problem)
    with warnings.catch_warnings():  # DCP warns that a single process saves without a group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"trainer": trainer_state}, checkpoint_id=str(tmp),
                 planner=ChunkedSavePlanner(tensors))
    try:
        torch.save(torch.get_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    except (OSError, RuntimeError) as e:  # torch's writer: a RuntimeError on a full disk
        problem = e
    _all_agree(problem)
    if _rank() == 0:
        try:
            _publish(root_path, tmp, final, meta)
            retire_old_steps(root_path, step, keep)
        except OSError as e:
            problem = e
    _all_agree(problem)
    return final


def _publish(root: Path, tmp: Path, final: Path, meta: dict) -> None:
    """Rank 0, once every rank's files are in `tmp`: meta.json, the manifest, fsync, then
    the renames that make `final` the step `latest` names."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    write_manifest(tmp)  # last: it describes every file above
    _fsync_tree(tmp)  # durable before it is published: a crash cannot publish holes
    aside = final.with_name(final.name + ".old")
    if final.exists():  # the same step saved again: keep the old copy until the new is in
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(root)
    shutil.rmtree(aside, ignore_errors=True)
    pointer_tmp = root / "latest.tmp"
    pointer_tmp.write_text(final.name)
    _fsync(pointer_tmp)
    os.replace(pointer_tmp, root / "latest")
    _fsync(root)


def retire_old_steps(root: Path, saved_step: int, keep: int) -> None:
    """Keep the newest `keep` steps up to `saved_step` (by number, not name); later steps
    belong to a history this run replaced from an older checkpoint and are not ours to drop."""
    ours = [path for step, path in published_steps(root) if step <= saved_step]
    for old in ours[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _first_failure(exc: BaseException) -> BaseException:
    """What went wrong inside DCP's CheckpointException (a dict rank -> (exception, stack),
    the same on every rank): a refusal first, else the lowest rank's; other exceptions are
    themselves."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return exc
    causes = [failures[rank][0] for rank in sorted(failures)]
    return next((c for c in causes if isinstance(c, ConfigError)), causes[0])


def load(path: Path, tensors: dict[str, Chunked], trainer_state: dict,
         fix: str = "checkpoint.resume", no_dist: bool = False) -> None:
    """Fill the parts of `tensors` (the boxes this rank owns) and `trainer_state` in place.
    no_dist: this process reads alone, with no collective, even inside a process group
    (an inference load, which each serving rank makes on its own)."""
    state = {"trainer": trainer_state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, checkpoint_id=str(path),
                     planner=ChunkedLoadPlanner(tensors, Path(path)), no_dist=no_dist)
        except ConfigError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's wrapper reaches every rank
            cause = _first_failure(e)
            if isinstance(cause, ConfigError):  # a planner's refusal (ModelMismatch)
                raise cause.with_traceback(None) from None
            # a step saved before manifests, damaged: still one line
            first = str(cause).strip().splitlines()
            why = f"reading it failed ({type(cause).__name__}: {first[-1] if first else ''})"
            raise ConfigError(damaged_message(path, why[:300], fix)) from e
    trainer_state.update(state["trainer"])
    rng = Path(path) / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng))


def inference_step(path: str):
    """(step directory, meta, ModelConfig) of the checkpoint `path` names (a step_* directory
    or a root holding `latest`), checked: the step complete against its manifest, its model
    one this fivefold knows. Every problem is one ConfigError line."""
    from fivefold.models.presets import MODEL_FIELDS, ModelConfig

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--checkpoint {p} does not exist; give a step_* directory or a "
                          f"checkpoint.dir holding a `latest` pointer")
    if (p / "latest").is_file():
        named = (p / "latest").read_text().strip()
        if not (p / named).is_dir():
            raise ConfigError(f"{p / 'latest'} names {named!r}, which is not in {p}; give a "
                              f"step_* directory as --checkpoint")
        p = p / named
    meta = read_meta(p, fix="--checkpoint")
    unknown = sorted(set(meta["model"]) - set(MODEL_FIELDS))
    if unknown:
        raise ConfigError(f"{p / 'meta.json'} describes a model with {unknown[0]}, which this "
                          f"fivefold does not know; load it with the version that saved it")
    return p, meta, ModelConfig(**meta["model"])


def load_model_for_inference(path: str):
    """(model, model_cfg, tokenizer_spec) from a checkpoint directory, on CPU in fp32.

    `path` may be a step_* directory or a checkpoint root holding a `latest` pointer. The
    step must be complete (a manifest listing every file, each matching it) and hold exactly
    the model its meta.json describes; anything else is one ConfigError line.
    """
    from fivefold.models.init import build_meta

    p, meta, model_cfg = inference_step(path)
    model = build_meta(model_cfg)
    model.to_empty(device="cpu")
    # Alone: a tensor-parallel serving rank loads the whole model itself, inside its group.
    load(p, inference_parts(model), {}, fix="--checkpoint", no_dist=True)
    from fivefold.models.llama import Rotary, rope_inv_freq

    for module in model.modules():
        if isinstance(module, Rotary):
            module.inv_freq = rope_inv_freq(module.cfg)
    return model.eval(), model_cfg, meta.get("tokenizer", "byte")


def inference_parts(model) -> dict[str, Chunked]:
    """Every weight and persistent buffer of a whole (unsplit) model as the checkpoint names
    them: stacked expert weights one expert a key, buffers (the MoE router's expert bias)
    under `buffer/`."""
    from fivefold.parallel.expert import expert_param_ids
    from fivefold.parallel.shards import expert_key

    experts = expert_param_ids([model])
    stacked = {n for n, t in model.named_parameters() if id(t) in experts}
    params = {n for n, _ in model.named_parameters()}
    tensors = {}
    for n, t in model.state_dict().items():
        t = t.detach()
        if n not in params:
            tensors[f"buffer/{n}"] = Chunked(tuple(t.shape), [((0,) * t.dim(), t)])
        elif n in stacked:
            tensors.update({f"model/{expert_key(n, j)}": Chunked(tuple(t.shape[1:]),
                                                                [((0,) * (t.dim() - 1), t[j])])
                            for j in range(t.shape[0])})
        else:
            tensors[f"model/{n}"] = Chunked(tuple(t.shape), [((0,) * t.dim(), t)])
    return tensors
