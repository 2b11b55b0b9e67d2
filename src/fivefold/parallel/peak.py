"""Peak memory, counted from the storages the engine owns, at the moments the peak can occur.

On CPU the process's resident size is too coarse to see one gradient bucket, and after
`step()` the transient buffers are gone. So the engine calls `sample(point)` where a peak
can occur — a gradient staged into its bucket, a bucket launched, the end of backward of
each micro-batch, inside the optimizer step, during a checkpoint save or load — and an
active `PeakTracker` counts, item by item, the bytes of the distinct storages its sources
hold at that moment. Without an active tracker `sample` returns at once.

Sources are named after the planner's memory items (plan/memory.py): `params`, `grads`,
`master`, `optimizer`, `grad_buffer` (gradients accumulating whole over micro-batches),
`comm_buffers` (gradient buckets in flight, ZeRO-3's gathered units), plus whatever a caller
registers (a checkpoint's read buffers). A storage is counted once, under the first source
that names it; a storage resized to 0 bytes (a freed ZeRO-3 unit) counts nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable

import torch

# A process-wide slot, not a context variable: on CUDA, backward hooks run on autograd's
# device threads, which do not see the caller's context.
_ACTIVE: list[PeakTracker] = []

Source = Callable[[], Iterable[torch.Tensor]]


def sample(point: str) -> None:
    """Let the active tracker (if any) count the live bytes now; `point` names the moment."""
    if _ACTIVE:
        _ACTIVE[-1].sample(point)


class PeakTracker:
    def __init__(self, sources: dict[str, Source] | None = None):
        self.sources: dict[str, Source] = dict(sources or {})
        self.peak = 0  # the largest total seen
        self.at = ""  # the point where it was seen
        self.items_at_peak: dict[str, int] = {}
        self.item_peaks: dict[str, int] = {}  # each item's own maximum, at any point
        self.points: dict[str, int] = {}  # the largest total seen at each point

    def add(self, item: str, source: Source) -> None:
        self.sources[item] = source

    def live(self) -> dict[str, int]:
        """Bytes per item now, each distinct storage counted once."""
        seen, out = set(), {}
        for item, source in self.sources.items():
            total = 0
            for t in source():
                if t is None:
                    continue
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in seen and storage.nbytes():
                    seen.add(key)
                    total += storage.nbytes()
            out[item] = total
        return out

    def sample(self, point: str) -> None:
        items = self.live()
        total = sum(items.values())
        for item, n in items.items():
            self.item_peaks[item] = max(self.item_peaks.get(item, 0), n)
        self.points[point] = max(self.points.get(point, 0), total)
        if total > self.peak:
            self.peak, self.at, self.items_at_peak = total, point, items

    def reset(self) -> None:
        self.peak, self.at, self.items_at_peak = 0, "", {}
        self.item_peaks.clear()
        self.points.clear()

    def __enter__(self) -> PeakTracker:
        _ACTIVE.append(self)
        self.sample("start")
        return self

    def __exit__(self, *exc) -> None:
        self.sample("end")
        _ACTIVE.remove(self)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class ResidentPeak:
    """The most resident memory the process gained inside the block, in bytes (Linux).

    Counts every allocation, the engine's and its libraries' (DCP's read and write buffers
    included), which storage counting cannot see. The kernel's high-water mark is reset on
    entry (`/proc/self/clear_refs`, "5"), so `grown` = peak RSS in the block − RSS on entry.
    Only figures far above the allocator's noise (a few MB) mean anything."""

    available = os.path.exists("/proc/self/clear_refs")

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    def __enter__(self) -> ResidentPeak:
        # Hand free heap pages back to the kernel first: a forked child (or a process that
        # freed a lot earlier) would otherwise reuse pages already resident, and the growth
        # of the block would not show in RSS at all.
        _malloc_trim()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.grown = self._status("VmHWM") - self.start
