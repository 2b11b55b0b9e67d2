"""Recovering from a damaged checkpoint or a failed save; the trainer calls these.

- `resume`: try the checkpoints `checkpoint.candidates` offers, newest first; one that cannot
  be read is named in one line and the one before it is tried (resume = auto; `latest` or a
  path is that checkpoint alone, and its failure is the error).
- `agree`: every rank takes the same decision about a checkpoint it tried to read.
- `unwritable`: rank 0's probe of the checkpoint directory before a save, agreed on by all
  ranks, so an unwritable directory stops every rank at the same point (rank 0 alone would
  otherwise fail while its peers wait in a barrier).
- `save_failed`: a save that hit a full disk or an unwritable directory becomes one line;
  its half-written `step_N.tmp` is removed and `latest` still names the previous step.
- `save_error`: the one-line error for any failed save: a write failure (above) or a rank
  lost during it, saying whether the step's checkpoint was published all the same.

What a full disk looks like: torch's DCP writer serialises each shard with `torch.save`,
whose zip writer reports a short write as a RuntimeError ("[enforce fail at
inline_container.cc] unexpected pos …", no errno), and DCP hands it to every rank wrapped
in its CheckpointException (a BaseException). So a write failure is recognised by the
writer's messages, and a full file system is named from `os.statvfs` of the directory.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from fivefold.config import ConfigError
from fivefold.parallel import comm
from fivefold.parallel.watchdog import RankLostError
from fivefold.train import checkpoint as ckpt
from fivefold.train.lifecycle import CheckpointWriteError, ledger_paused


def resume(trainer, root: str, mode: str) -> None:
    """Load the first checkpoint of `ckpt.candidates` that loads. With 'auto', one that
    fails to load (garbled metadata, a truncated shard) is named in one line and the one
    before it is tried; a named path that fails is an error."""
    skipped = []
    for path in ckpt.candidates(root, mode):
        problem = trainer.load_checkpoint(path)
        if problem is None:
            return
        if mode != "auto":  # asked for this one: its own error, or one line about it
            if problem.startswith("ConfigError: "):
                raise ConfigError(problem.removeprefix("ConfigError: "))
            raise ConfigError(f"checkpoint {path} cannot be loaded: {problem}; point "
                              f"checkpoint.resume at another step_* directory")
        skipped.append(path.name)
        if trainer.dims.rank == 0:
            print(f"fivefold: checkpoint {path} cannot be loaded ({problem}); trying the "
                  f"previous one", file=sys.stderr, flush=True)
    if skipped:
        raise ConfigError(f"no checkpoint in {root} loads (tried {', '.join(skipped)}); "
                          f"set checkpoint.resume = never to start afresh, or another "
                          f"checkpoint.dir")


def agree(trainer, problem: str | None) -> str | None:
    """Every rank takes the same decision: a problem on any rank is a problem on all."""
    flag = torch.tensor([0.0 if problem is None else 1.0], device=trainer.device)
    with ledger_paused(trainer.dims):
        comm.all_reduce(flag, trainer.dims["world"], op="max")
    if flag.item() and problem is None:
        problem = "another rank could not read it"
    return problem


def save_failed(trainer, error: BaseException) -> Exception:
    """The one-line error for a save that could not be written, after removing its
    half-written directory (rank 0)."""
    root = Path(trainer.cfg.checkpoint.dir)
    final = ckpt.step_dir(root, trainer.step)
    if trainer.dims.rank == 0:  # half-written: never left for a resume to trip on
        shutil.rmtree(final.with_name(final.name + ".tmp"), ignore_errors=True)
    last = ckpt.resolve(str(root), "auto")
    return CheckpointWriteError(
        f"saving step {trainer.step} to {root} failed ({write_cause(error, root)}); the previous "
        f"checkpoint {last.name if last else '(none)'} is intact and `latest` still names "
        f"it. Free space or fix the directory's permissions, then rerun: it resumes from "
        f"there")


def unwritable(root: str) -> str | None:
    """Why `root` cannot take a checkpoint (created if missing), or None: a probe file is
    written and removed, which also catches a read-only file system and a full disk's
    refusal of new files."""
    probe = Path(root) / f".write-probe-{os.getpid()}"
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"fivefold")
        probe.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


# What torch's zip writer (caffe2/serialize/inline_container.cc) says about a failed write.
_WRITER_FAILURES = ("inline_container.cc", "PytorchStreamWriter failed", "file write failed")


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc`, or what DCP's CheckpointException wraps (rank -> (exception, stack))."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [failures[rank][0] for rank in sorted(failures)]
    return [exc] + ([exc.__cause__] if exc.__cause__ is not None else [])


def _is_write_failure(exc: BaseException) -> bool:
    return isinstance(exc, OSError) or (
        isinstance(exc, RuntimeError) and any(w in str(exc) for w in _WRITER_FAILURES))


def is_write_error(exc: BaseException) -> bool:
    """A file that could not be written: an OSError, or torch's writer failing (a full disk),
    raised here or on some rank and wrapped by DCP."""
    return any(_is_write_failure(c) for c in _causes(exc))


def write_cause(exc: BaseException, root: str | os.PathLike) -> str:
    """Why the save could not be written, in a few words: the OSError, or a full file system
    when torch's writer failed without an errno and the directory has next to no room."""
    cause = next((c for c in _causes(exc) if _is_write_failure(c)), exc)
    if isinstance(cause, OSError):
        return one_line(cause)
    try:
        fs = os.statvfs(root)
        free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    except OSError:
        return one_line(cause)
    if free < max(size // 100, 1 << 20):  # under 1% or 1 MiB left: it is full
        return (f"no space left on device: {free / 2**20:.1f} MiB free of {size / 2**20:.1f} "
                f"MiB on the file system of {root}")
    return one_line(cause)


def save_error(trainer, error: BaseException) -> Exception | None:
    """The one-line error for a save that raised `error`, or None when it is none of ours
    (then the caller re-raises it): a write failure (`save_failed`), or a rank lost during
    the save, naming the rank and what became of the step's checkpoint."""
    if is_write_error(error):
        return save_failed(trainer, error)
    if not isinstance(error, RuntimeError) and not any(
            isinstance(c, RuntimeError) for c in _causes(error)):
        return None
    watchdog = trainer.watchdog
    lost = watchdog.lost_ranks() if watchdog.active else []
    if not lost:
        return None
    who = ", ".join(f"rank {r}" for r in lost)
    root = trainer.cfg.checkpoint.dir
    final = ckpt.step_dir(Path(root), trainer.step)
    if ckpt.resolve(root, "auto") == final and ckpt.verify_step(final) is None:
        # Rank 0 published the step before the peer's loss reached it (in the last barrier).
        return RankLostError(f"lost {who} at the end of saving step {trainer.step}; its "
                             f"checkpoint {final} is complete and `latest` names it: a "
                             f"restart resumes from step {trainer.step}")
    last = ckpt.resolve(root, "auto")
    return RankLostError(f"saving step {trainer.step} failed: lost {who}; the previous "
                         f"checkpoint {last.name if last else '(none)'} in {root} is "
                         f"untouched and `latest` still names it")


def one_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (DCP's carry whole tracebacks)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1][:400] if lines else ''}"

