"""The machine a result came from, in words a reader can tell apart: the CPU's model name
(two x86_64 machines round float32 sums differently, and run at different speeds), its
architecture and core count. No torch import: the planner and the benches both use it."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """'AMD EPYC 7B13', 'Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz', ...: /proc/cpuinfo's
    'model name' (x86) or 'Model'/'Hardware' (ARM), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_label() -> str:
    """One line for a result's `machine`/`device` field: 'AMD EPYC (x86_64, 2 CPU cores)'."""
    return f"{cpu_model()} ({platform.machine()}, {os.cpu_count()} CPU cores)"
