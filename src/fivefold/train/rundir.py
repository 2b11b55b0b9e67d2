"""The run's directories: a fresh run never lands on another's work, and one run at a time.

`fivefold train` calls `open_run` after the config is validated and before any process group
exists, so every rank decides from the same, untouched directories:

- a fresh run (`checkpoint.resume = never`; the default `auto` resumes whatever is there)
  into a `checkpoint.dir` holding checkpoints, or a
  `log.dir` holding metrics, is refused in one line: resume it, pick other directories, or
  pass `--overwrite` (which then removes the old checkpoints and metrics, and says so);
- the first rank takes an exclusive lock (flock on the directory itself) on both directories
  for the whole run; a second trainer on them is refused. The kernel drops the lock when the
  process ends, however it ends, so a crash leaves no stale lock and no lock file;
- leftovers of an interrupted save (`step_N.tmp`) are removed, with a note, so they do not
  hold disk space that the next save needs.

Imports no torch.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.config import Config, ConfigError
from fivefold.text import count
from fivefold.train.manifest import published_steps


@dataclass
class RunDirs:
    notes: list[str] = field(default_factory=list)  # what was cleaned or removed, to print
    _locks: list = field(default_factory=list)
    _created: list[Path] = field(default_factory=list)  # directories this launch made

    def close(self, failed: bool = False) -> None:
        """Release the locks. After a failure, directories this launch created that hold
        nothing but its lock file are removed again: a bad input leaves no trace."""
        for handle in self._locks:
            handle.close()  # closing the descriptor releases the flock
        self._locks.clear()
        if failed:
            for directory in reversed(self._created):
                if directory.is_dir() and not any(directory.iterdir()):
                    directory.rmdir()
        self._created.clear()


def _metrics_file(cfg: Config) -> Path:
    return Path(cfg.log.dir) / "metrics.jsonl"


def _existing_work(cfg: Config) -> list[str]:
    """What a fresh run would overwrite: checkpoints, the `latest` pointer, metrics."""
    ck = Path(cfg.checkpoint.dir)
    found = []
    steps = published_steps(ck)
    if steps:
        found.append(f"{count(len(steps), 'checkpoint')} up to step {steps[-1][0]} in {ck}")
    elif (ck / "latest").is_file():
        found.append(f"a latest pointer in {ck}")
    metrics = _metrics_file(cfg)
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(f"{metrics}")
    return found


class _DirLock:
    """An exclusive flock on the directory itself: no lock file to leave behind, and the
    kernel drops it when the process ends, however it ends."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(directory, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise ConfigError(f"{directory} is in use by another running `fivefold train`; "
                              f"wait for it to finish, or give this run another log.dir and "
                              f"checkpoint.dir") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _remove_old_run(cfg: Config) -> list[str]:
    ck = Path(cfg.checkpoint.dir)
    steps = published_steps(ck)
    for _, path in steps:
        shutil.rmtree(path)
    for name in ("latest", "latest.tmp"):
        (ck / name).unlink(missing_ok=True)
    notes = [f"--overwrite: removed {count(len(steps), 'checkpoint')} from {ck}"] if steps else []
    metrics = _metrics_file(cfg)
    if metrics.is_file():
        metrics.unlink()
        notes.append(f"--overwrite: removed {metrics}")
    return notes


def _clean_temporaries(ck: Path) -> list[str]:
    stale = sorted(p for p in ck.glob("step_*.tmp") if p.is_dir())
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [f"removed {p}, left by an interrupted save" for p in stale]


def open_run(cfg: Config, first_rank: bool, overwrite: bool = False) -> RunDirs:
    """Check the run directories for this launch; on the first rank, lock and tidy them."""
    resume = cfg.checkpoint.resume
    fresh = resume in ("", "never")
    if overwrite and not fresh and resume != "auto":
        raise ConfigError(f"--overwrite starts afresh but checkpoint.resume = '{resume}' "
                          f"continues a run; give one of them")
    existing = _existing_work(cfg)
    if existing and fresh and not overwrite:
        raise ConfigError(f"this run would overwrite an earlier one ({'; '.join(existing)}); "
                          f"continue it with --checkpoint.resume latest, give another log.dir "
                          f"and checkpoint.dir, or pass --overwrite to replace it")
    dirs = RunDirs()
    if not first_rank:
        return dirs
    for directory in dict.fromkeys(Path(d).resolve() for d in (cfg.log.dir,
                                                                cfg.checkpoint.dir)):
        missing = [d for d in (directory, *directory.parents) if not d.exists()]
        dirs._locks.append(_DirLock(directory))
        dirs._created += reversed(missing)  # outermost first; close() goes innermost first
    if overwrite:
        dirs.notes += _remove_old_run(cfg)
    dirs.notes += _clean_temporaries(Path(cfg.checkpoint.dir))
    return dirs


def check_budget_fits(cfg: Config, device) -> None:
    """recompute = auto plans under train.memory_budget_gib: a budget past what this device
    holds (a GPU's memory, or this machine's RAM on CPU) bounds nothing, so the plan it picks
    can run out of memory. Refused before any model is built."""
    budget = cfg.train.memory_budget_gib
    if cfg.train.recompute != "auto" or budget <= 0:
        return
    if device.type == "cuda":
        import torch

        total, what = torch.cuda.get_device_properties(device).total_memory, "GPU memory"
    else:
        total, what = meminfo_bytes("MemTotal"), "RAM"
    if total and budget * 2**30 > total:
        raise ConfigError(f"train.memory_budget_gib = {budget:g} is more than this machine's "
                          f"{total / 2**30:.1f} GiB of {what}: a plan under it may not fit; set "
                          f"train.memory_budget_gib to at most {total / 2**30:.1f}")


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo (Linux) in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where it cannot be read."""
    return meminfo_bytes("MemAvailable")


def start_notes(cfg: Config, resumed_meta: dict | None, resumed_step: int) -> list[str]:
    """What a user should know as the run starts: no checkpoint to resume, a changed
    schedule."""
    notes = []
    resume = cfg.checkpoint.resume
    if resume not in ("", "never", "auto") and resumed_meta is None:
        notes.append(f"note: checkpoint.resume = '{resume}' but {cfg.checkpoint.dir} holds no "
                     f"checkpoint yet: starting fresh")
    if resumed_meta is not None:
        saved = resumed_meta.get("config", {}).get("train", {}).get("steps")
        if saved is not None and saved != cfg.train.steps:
            notes.append(f"note: train.steps is {cfg.train.steps} but the checkpoint's run "
                         f"planned {saved}: the learning-rate schedule (warmup and decay over "
                         f"train.steps) changes from step {resumed_step} on")
    return notes


def memory_warning(planned_bytes: float, ranks_here: int) -> str | None:
    """A warning when the planned peak of the ranks on this machine exceeds its free RAM."""
    free = available_memory_bytes()
    need = planned_bytes * ranks_here
    if free is None or need <= free:
        return None
    return (f"warning: the plan predicts a peak of {need / 2**30:.1f} GiB for {ranks_here} "
            f"rank(s) on this CPU machine but only {free / 2**30:.1f} GiB is available; the "
            f"run may be killed for memory: lower train.gbs, train.seq_len or the model size")
