"""[checkpoint] and [log]: where a run writes, how often, and what it resumes from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fivefold.config.rules import not_quantized, positive, writable_dir
from fivefold.errors import ConfigError

# "latest" (the pointer file) and "" (fresh) are the older spellings of auto and never.
RESUME_MODES = ("auto", "latest", "never", "")


@dataclass
class CheckpointSection:
    dir: str = "runs/default/checkpoints"
    every: int = 100  # 0: only at the end
    keep: int = 2
    resume: str = "auto"  # auto (newest loadable, if any) | never | a step_* directory
    save_on_signal: bool = True  # SIGTERM: write a checkpoint at the next step boundary, exit


@dataclass
class LogSection:
    dir: str = "runs/default"
    every: int = 10
    progress: bool = True
    tensorboard: bool = True
    ledger: bool = False  # print a per-step summary of the communication ledger
    peak_tflops: float = 0.0  # 0: take the device's peak from the hardware table


def check_output(cfg) -> None:
    """Outputs must be writable before training starts; resume must name something real."""
    ck = cfg.checkpoint
    writable_dir("checkpoint.dir", ck.dir)
    writable_dir("log.dir", cfg.log.dir)
    positive("checkpoint.every", ck.every, allow_zero=True)
    positive("checkpoint.keep", ck.keep)
    if ck.resume not in RESUME_MODES and not Path(ck.resume).is_dir():
        raise ConfigError(f"checkpoint.resume = '{ck.resume}' is not a checkpoint directory; "
                          f"use 'auto', 'never' or a step_* path under checkpoint.dir")
    not_quantized("checkpoint.resume", ck.resume)
    not_quantized("checkpoint.dir", ck.dir)
    positive("log.every", cfg.log.every)
