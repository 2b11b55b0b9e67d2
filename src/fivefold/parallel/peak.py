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

Activations are counted the same way, from what autograd really keeps: inside `saving()` (the
trainer's and the pipeline's forwards) every tensor saved for backward is packed into a
holder that lives exactly as long as the graph keeps it, and the tracker's `activations`
and `logits_loss` sources (`activation_sources`) count the live holders' storages, leaving
out the parameters'. A tensor is `logits_loss` when it is saved between the final norm's
entry and its chunk's exit (`mark_head`), else `activations`. Also counted: the inputs a
recomputed region keeps (parallel/recompute.py), the tensors its recomputation brings back
in backward (the working set), and the loss's transient chunk of logits (models/loss.py
reports it through `loss.observe_transients`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import weakref
from collections.abc import Callable, Iterable

import torch

from fivefold.models import loss

# A process-wide slot, not a context variable: on CUDA, backward hooks run on autograd's
# device threads, which do not see the caller's context.
_ACTIVE: list[PeakTracker] = []

Source = Callable[[], Iterable[torch.Tensor]]


def sample(point: str) -> None:
    """Let the active tracker (if any) count the live bytes now; `point` names the moment."""
    if _ACTIVE:
        _ACTIVE[-1].sample(point)


def active() -> bool:
    return bool(_ACTIVE)


# --- activations: what autograd keeps, alive exactly as long as it keeps it -----------------
ACTIVATIONS, LOGITS_LOSS = "activations", "logits_loss"
_REGION = [ACTIVATIONS]  # the item a tensor saved now belongs to
_LIVE: dict[int, tuple[weakref.ref, str]] = {}  # key -> (holder or tensor, item)
_KEYS = itertools.count()
_TRANSIENT: dict[str, list[torch.Tensor]] = {}  # item -> tensors a computation holds now


class Saved:
    """A tensor saved for backward. Detached: a saved *output* holding its own grad_fn would be
    a reference cycle that outlives the graph (autograd ignores the metadata on unpack)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()


def track(obj, item: str | None = None):
    """Count `obj` (a holder with `.tensor`, or a tensor) under `item` (default: the region
    running now) while it is alive. Returns obj."""
    key = next(_KEYS)
    _LIVE[key] = (weakref.ref(obj, lambda _, key=key: _LIVE.pop(key, None)),
                  item or _REGION[-1])
    return obj


def _pack(t: torch.Tensor) -> Saved:
    return track(Saved(t))


def saving():
    """Count what autograd saves inside the block (a forward), if a tracker is active."""
    if not _ACTIVE:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack, lambda held: held.tensor)


_RECOMPUTED: list[torch.Tensor] = []  # what the recomputation running now brought back


@contextlib.contextmanager
def recomputing():
    """Inside a checkpointed region's recomputation (backward): count what it stores through
    the checkpoint's own saved-tensor hooks, sampling as this working set grows. All of it is
    alive at the end of the recomputation, before the region's backward consumes it."""
    pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if not _ACTIVE or pack is None:
        yield
        return

    def counting_pack(t):
        _RECOMPUTED.append(t.detach())
        sample("recomputed")
        return pack(t)

    try:
        with torch.autograd.graph.saved_tensors_hooks(counting_pack, unpack):
            yield
    finally:
        _RECOMPUTED.clear()


def _live_tensors(item: str) -> list[torch.Tensor]:
    out = []
    for ref, kind in list(_LIVE.values()):
        obj = ref() if kind == item else None
        if obj is not None:
            out.append(obj if isinstance(obj, torch.Tensor) else obj.tensor)
    out += _TRANSIENT.get(item, [])
    return out + _RECOMPUTED if item == ACTIVATIONS else out


def activation_sources(params: Iterable[torch.Tensor]) -> dict[str, Source]:
    """`activations` and `logits_loss` for a tracker: the live saved tensors, less the
    parameters' storages (weights are model state, counted under params)."""
    param_keys = {p.untyped_storage()._cdata for p in params}

    def source(item):
        return lambda: [t for t in _live_tensors(item)
                        if t.untyped_storage()._cdata not in param_keys]

    return {ACTIVATIONS: source(ACTIVATIONS), LOGITS_LOSS: source(LOGITS_LOSS)}


def transient(item: str, point: str, tensors: list[torch.Tensor]) -> None:
    """Sample with `tensors` (held by a computation, not saved) counted under `item`."""
    if _ACTIVE:
        _TRANSIENT[item] = tensors
        try:
            sample(point)
        finally:
            _TRANSIENT.pop(item, None)


loss.observe_transients(lambda point, tensors: transient(LOGITS_LOSS, point, tensors))


def _head(module, args) -> None:
    _REGION[-1] = LOGITS_LOSS


def _body(*_) -> None:
    _REGION[-1] = ACTIVATIONS


def mark_head(chunks: Iterable[torch.nn.Module]) -> list:
    """Tensors a chunk saves from its final norm's entry to its exit are `logits_loss` (the
    planner's item: final norm, head and loss), the rest `activations`: hooks on each chunk
    and its `norm`. Returns the hook handles."""
    handles = []
    for chunk in chunks:
        handles.append(chunk.register_forward_pre_hook(_body))
        handles.append(chunk.register_forward_hook(_body))
        norm = getattr(chunk, "norm", None)
        if norm is not None:
            handles.append(norm.register_forward_pre_hook(_head))
    return handles


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


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


class ResidentPeak:
    """The most resident memory the process gained inside the block, in bytes (Linux).

    Counts every allocation, the engine's and its libraries' (DCP's read and write buffers
    included), which storage counting cannot see. The kernel's high-water mark is reset on
    entry (`/proc/self/clear_refs`, "5"), so `grown` = peak RSS in the block − RSS on entry.

    Resident memory follows what is allocated only if the allocator gives freed buffers back:
    call `pin_allocator()` once at the start of a measured process (see there). Without it
    the growth can be several MB above the most bytes alive at once."""

    available = os.path.exists("/proc/self/clear_refs")

    @staticmethod
    def pin_allocator(threshold: int = 128 * 1024) -> bool:
        """Make glibc map every buffer of `threshold` bytes or more on its own and unmap it
        when freed, for the rest of the process. Returns whether the allocator took it.

        By default glibc raises its mmap threshold to the size of each large buffer freed (up
        to 32 MB) and its trim threshold to twice that, so later buffers of that size are cut
        from the heap and stay resident once freed: the peak RSS of a block then adds up
        buffers that were never alive together (a checkpoint load's checksum reads, DCP's
        read of each chunk, the tensor made of it), by how much depends on the heap's layout
        at the time. Setting the thresholds switches that adjustment off. Call it before the
        process allocates what is measured: a buffer freed into the heap earlier is reused
        from there."""
        libc = _libc()
        if libc is None or not hasattr(libc, "mallopt"):
            return False
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)
                    and libc.mallopt(_M_TRIM_THRESHOLD, threshold))

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
