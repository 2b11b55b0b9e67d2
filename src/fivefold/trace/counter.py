"""Counting the aten ops of a step: which are kernels, what they move and compute, which sync.

`OpCounter` is a `TorchDispatchMode`: it sees every aten op after autograd and the composite
decompositions, i.e. the ops a device would run, and records one `Event` per op. Under a
trace the accelerator's tensors live on the meta device (shapes, no data) and the host's
stay real, so host code that reads its own tensors runs as always; what meta cannot give,
the counter supplies (`OpCounter._run`).

What counts as a kernel (one launch on the device):
- an op with a tensor on the traced device (meta, standing for the GPU) among its inputs or
  outputs, that is not a view or metadata op (`NOT_KERNELS`, and every op whose schema says
  its output aliases an input without writing it: view, transpose, expand, slice, ...);
- a `copy_` of a view onto the very same elements is not (it returns early);
- allocations (`empty*`) are not kernels; factories that fill (`zeros`, `full`, `arange`,
  random) are;
- ops on host tensors only are host work (`Event.kind == "host"`), not kernels.

Host syncs (the host waits for the device): `_local_scalar_dense` (`.item()`, `float(t)`,
`bool(t)`), a copy between the device and the host (`.cpu()`, `.to(device)` of a host
tensor without non_blocking: both wait for the stream), and ops whose output shape depends
on data (`nonzero`, `masked_select`, `unique`, ...).

Bytes: each tensor argument read (a broadcast dimension, stride 0, read once) plus each
output written; an in-place op reads and writes its target, a write-only op (`copy_`,
`_foreach_copy_`, `fill_`, `zero_`, random fills) only writes it. torch's fused Adam(W)
marks its gradients mutable but writes them only when it unscales them (`grad_scale`
given: aten/src/ATen/native/cuda/fused_adam_utils.cuh, "writes out gradients only when
grad_scale_ptr != nullptr"); without, they count as read only. FLOPs: the matrix ops of
torch's own FLOP table (`torch.utils.flop_counter`: mm, addmm, bmm, baddbmm, _scaled_mm,
convolution, the attention kernels), and 2 x M x K x N for `_scaled_mm_v2` and the grouped
GEMMs; 0 for the rest (elementwise work is bound by bytes; see roofline.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops that launch nothing: metadata, aliasing and allocation (names without the overload).
NOT_KERNELS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
    "lift_fresh", "lift_fresh_copy", "alias", "set_", "resize_", "_reshape_alias",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_same_storage_numel", "_local_scalar_dense", "record_stream", "_unsafe_view",
    "view", "_to_copy_noop", "as_strided", "unsqueeze_", "squeeze_", "t_", "transpose_",
    "as_strided_", "_nested_tensor_size", "is_pinned", "_pin_memory", "prim_layout",
})
WRITE_ONLY = frozenset({"copy_", "_foreach_copy_", "fill_", "zero_", "normal_", "uniform_",
                        "bernoulli_", "random_", "exponential_", "index_put_", "scatter_"})
# Ops whose `grads` argument is written only when a `grad_scale` is passed (see above).
GRADS_WRITTEN_WHEN_SCALED = frozenset({"_fused_adam_", "_fused_adamw_"})
# Mutable arguments an op writes without reading (by name): the one-pass AdamW's parameter
# (parallel/adamw_kernel.py), the FP8 gather's byte and value buffers (numerics/fp8_gather.py).
WRITE_ONLY_ARGS = {"adamw_mixed_": frozenset({"param"}),
                   "fp8_gather_unpack": frozenset({"codes", "full"})}
DYNAMIC_SHAPE = frozenset({"nonzero", "masked_select", "unique", "_unique", "_unique2",
                           "unique_consecutive", "unique_dim", "repeat_interleave",
                           "bincount"})
# Ops that read only the rows their indices pick from a table (the first tensor argument):
# the table counts as read for at most the bytes written (an embedding's forward reads 8192
# rows of a 128k-row weight, not the weight).
GATHERS = frozenset({"embedding", "index_select", "gather", "take"})
SYNC_KINDS = ("item", "d2h", "h2d", "dynamic_shape")


@dataclass
class Event:
    """One aten op in the order it ran."""

    name: str  # e.g. "aten.add_.Tensor"
    part: str
    kind: str  # "kernel", "view" (no launch), "host" (host tensors only), "sync"
    bytes_read: int = 0
    bytes_written: int = 0
    flops: float = 0.0
    sync: str | None = None  # one of SYNC_KINDS, where the op makes the host wait
    dtype: str | None = None  # the peak a FLOP runs at: "bf16" | "fp32" | "fp8"
    seconds: float = 0.0  # device time on the traced GPU (roofline.simulate sets it)

    @property
    def op(self) -> str:
        """The op without its overload: "aten.add_"."""
        return self.name.rsplit(".", 1)[0] if self.name.count(".") >= 2 else self.name


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a stride-0 dimension once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= int(size)
    return n * t.element_size() if t.numel() else 0


def _is_view(func) -> bool:
    schema = func._schema
    if not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def _same_data(dst, src) -> bool:
    """`dst.copy_(src)` of a view onto the very same elements returns early, launching
    nothing (aten/src/ATen/native/Copy.cpp, copy_impl: "self and src are views of the same
    data"); `x[i:j] += y` ends in one."""
    return (isinstance(src, torch.Tensor) and dst.device == src.device
            and torch._C._is_alias_of(dst, src)
            and dst.storage_offset() == src.storage_offset() and dst.shape == src.shape
            and dst.stride() == src.stride() and dst.dtype == src.dtype
            and dst.is_conj() == src.is_conj() and dst.is_neg() == src.is_neg())


def _named(func, args, kwargs, names) -> list[torch.Tensor]:
    """The tensors passed as the arguments called `names`."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in names:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


def _write_targets(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its mutable arguments)."""
    out = []
    base = func._schema.name.split("::")[-1]
    for i, arg in enumerate(func._schema.arguments):
        if (base in GRADS_WRITTEN_WHEN_SCALED and arg.name == "grads"
                and kwargs.get("grad_scale") is None):
            continue
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            flat, _ = tree_flatten(value)
            out.extend(t for t in flat if isinstance(t, torch.Tensor))
    return out


GROUPED = frozenset({"_grouped_mm", "_scaled_grouped_mm", "_scaled_grouped_mm_v2"})


def _flops(func, args, kwargs, out) -> float:
    base = func._schema.name.split("::")[-1]
    if base == "_scaled_mm_v2":  # torch >= 2.10's FP8 GEMM, absent from torch's table
        a, b = args[0], args[1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if base in GROUPED and isinstance(out, torch.Tensor):
        # one GEMM per group: 2 x output elements x the contracted size; a 2-D x 2-D call
        # (the weight gradient) contracts its groups' rows, each output block once
        a, b = args[0], args[1]
        if a.dim() == 2 and b.dim() == 2:
            return 2.0 * (out.numel() / out.shape[0]) * a.shape[-1]
        return 2.0 * out.numel() * a.shape[-1]
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:  # pragma: no cover - every torch this project supports has it
        return 0.0
    counter = flop_registry.get(func._overloadpacket)
    if counter is None:
        return 0.0
    try:
        return float(counter(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not know this overload's arguments
        return 0.0


def _peak_kind(tensors) -> str:
    dtypes = {t.dtype for t in tensors if t.dtype.is_floating_point}
    if any("float8" in str(d) for d in dtypes):
        return "fp8"
    if dtypes & {torch.bfloat16, torch.float16}:
        return "bf16"
    return "fp32"


# The values the host reads from a device that holds none: those of a clean step. A boolean
# answers by the op that made it: a "no bad value" test (isfinite is abs != inf times
# x == x; `all`) is True, a "some bad value" test (isnan, isinf, any, x != x) False.
CLEAN_TRUE = frozenset({"mul", "bitwise_and", "logical_and", "all", "eq", "isfinite"})
FLAGS_ZERO = ("non_finite", "found_inf", "isnan", "isinf")


def _scalar_for(t: torch.Tensor, producer: str | None = None):
    """The value a `.item()` (or a copy to the host) gives on the meta device: a boolean
    by its producer (CLEAN_TRUE), 0 for integers (no bad values, no overflow) and for a
    float written by a non-finite check (found_inf), 1.0 for other floats (a finite loss,
    norm or scale)."""
    if t.dtype == torch.bool:
        return producer in CLEAN_TRUE
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return 0.0 if producer and any(f in producer for f in FLAGS_ZERO) else 1.0
    return 0


class OpCounter(TorchDispatchMode):
    """Records an `Event` per aten op; `part` is called per op for its part's name.

    `device_type` is the device standing for the accelerator ("meta" under a trace)."""

    def __init__(self, part=lambda: "step", device_type: str = "meta"):
        super().__init__()
        self.part = part
        self.device_type = device_type
        self.events: list[Event] = []
        self.enabled = True
        from torch.utils.weak import WeakTensorKeyDictionary

        self.producer = WeakTensorKeyDictionary()  # small device tensor -> the op that made it

    def _on_device(self, tensors) -> bool:
        return any(t.device.type == self.device_type for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.enabled:
            return func(*args, **kwargs)
        name = str(func)  # "aten.add_.Tensor"
        base = func._schema.name.split("::")[-1]
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        part = self.part()
        if base == "_local_scalar_dense":
            t = args[0]
            if t.device.type == self.device_type:
                self.events.append(Event(name, part, "sync", t.element_size(), 0, 0.0, "item"))
                return _scalar_for(t, self.producer.get(t))
            self.events.append(Event(name, part, "host"))
            return func(*args, **kwargs)
        out = self._run(func, base, args, kwargs, flat_in)
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        event = self._event(func, name, base, part, args, kwargs, flat_in, flat_out, out)
        self.events.append(event)
        if event.kind == "kernel":
            for t in [*flat_out, *_write_targets(func, args, kwargs)]:
                if t.numel() <= 64 and t.device.type == self.device_type:
                    self.producer[t] = base
            if base == "_to_copy" and len(flat_out) == 1 and flat_in and (
                    flat_in[0].dtype == torch.bool and flat_out[0].numel() <= 64):
                # a flag cast to a number keeps its value: False -> 0.0 (as an overflow
                # flag `found_inf` reads), True -> 1.0
                value = _scalar_for(flat_in[0], self.producer.get(flat_in[0]))
                self.producer[flat_out[0]] = (
                    ("all" if value else "isnan") if flat_out[0].dtype == torch.bool
                    else ("from_true" if value else "found_inf"))
        return out

    def _run(self, func, base, args, kwargs, flat_in):
        """The op's output; where the device's tensors have no data (meta), what it would
        be: a copy to the host holds the values `.item()` gives (`_scalar_for`); an op whose
        output shape depends on data gives its largest output (every element selected),
        which also bounds its bytes."""
        dev = self.device_type
        if base == "_to_copy" and args[0].device.type == dev and (
                str(kwargs.get("device", dev)) == "cpu"):
            x = args[0]
            return torch.full(x.shape, _scalar_for(x, self.producer.get(x)),
                              dtype=kwargs.get("dtype") or x.dtype)
        if base == "copy_" and args[0].device.type == "cpu" and args[1].device.type == dev:
            return args[0].fill_(_scalar_for(args[1], self.producer.get(args[1])))
        if base in DYNAMIC_SHAPE and self._on_device(flat_in):
            x = args[0]
            if base == "nonzero":
                return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
            if base == "masked_select":
                return torch.empty((x.numel(),), dtype=x.dtype, device=x.device)
            if base == "bincount":  # its length is max(minlength, the largest value + 1)
                weights = args[1] if len(args) > 1 else kwargs.get("weights")
                length = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
                dtype = torch.long if weights is None else (
                    weights.dtype if weights.dtype.is_floating_point else torch.double)
                return torch.empty((max(int(length), 1),), dtype=dtype, device=x.device)
        return func(*args, **kwargs)

    def _event(self, func, name, base, part, args, kwargs, flat_in, flat_out, out) -> Event:
        on_device = self._on_device(flat_in) or self._on_device(flat_out)
        if not on_device:
            return Event(name, part, "host")
        if base in NOT_KERNELS or base.startswith("empty") or _is_view(func) or (
                base == "copy_" and _same_data(args[0], args[1])):
            return Event(name, part, "view")
        written = _write_targets(func, args, kwargs)
        written_ids = {id(t) for t in written}
        write_only = base in WRITE_ONLY
        read = 0
        first = {id(t) for t in tree_flatten(args[0] if args else None)[0]
                 if isinstance(t, torch.Tensor)}
        unread = {id(t) for t in _named(func, args, kwargs, WRITE_ONLY_ARGS.get(base, ()))}
        for t in flat_in:
            if write_only and id(t) in written_ids and id(t) in first or id(t) in unread:
                continue
            if id(t) in written_ids and not write_only:
                read += _tensor_bytes(t)  # read-modify-write: read here, written below
                continue
            if id(t) not in written_ids:
                read += _tensor_bytes(t)
        # outputs: an in-place op returns its target (counted once as written)
        seen, wrote = set(), 0
        for t in [*written, *flat_out]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            wrote += _tensor_bytes(t)
        if base in GATHERS and flat_in:
            table = flat_in[0]
            read -= _tensor_bytes(table) - min(_tensor_bytes(table), wrote)
        sync = None
        if base in ("_to_copy", "copy_", "to", "_copy_from", "_copy_from_and_resize"):
            devices = {t.device.type for t in [*flat_in, *flat_out]}
            if "cpu" in devices and self.device_type in devices:
                dst = (written[0] if written else (flat_out[0] if flat_out else None))
                blocking = not kwargs.get("non_blocking", False) and not (
                    base == "copy_" and len(args) > 2 and args[2])
                if dst is not None and blocking:
                    sync = "d2h" if dst.device.type == "cpu" else "h2d"
        elif base in DYNAMIC_SHAPE:
            sync = "dynamic_shape"
        flops = _flops(func, args, kwargs, out)
        return Event(name, part, "kernel", read, wrote, flops, sync,
                     _peak_kind(flat_in) if flops else None)


def fmt_count(n: float) -> str:
    """1234567 -> '1.23M'; for tables."""
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}" if n == math.floor(n) else f"{n:.3g}"
