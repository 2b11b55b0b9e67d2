"""What one timed training step reports, shared by `fivefold bench`'s own runner and its
transformers peer (train/peer.py), so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepRecord:
    loss: float
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    cpu_seconds: float = 0.0  # this process's CPU time over the step (all its threads)
