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
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from fivefold.config import ConfigError
from fivefold.parallel import comm
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
        f"saving step {trainer.step} to {root} failed ({one_line(error)}); the previous "
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


def is_write_error(exc: BaseException) -> bool:
    """An OSError, or DCP's wrapper of one raised on some rank."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        return any(isinstance(pair[0], OSError) for pair in failures.values())
    return isinstance(exc, OSError) or isinstance(exc.__cause__, OSError)


def one_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (DCP's carry whole tracebacks)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1][:400] if lines else ''}"

