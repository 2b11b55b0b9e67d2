"""What every optimizer other than torch's AdamW shares: an update rule over *pieces*.

A piece is what one rank updates of one parameter: the whole local tensor (one replica,
tensor-parallel slices included) or, under ZeRO, the flat range [lo, hi) of it that the rank
owns (`buffers.FlatLayout`). The owners (`train/optim.py`, `parallel/zero.py`) hand an
optimizer the pieces' fp32 masters, a `PieceInfo` for each, and an `Assembler` that turns
per-piece values into the whole logical tensor (all-gathered over ZeRO ranks and tensor-
parallel ranks) and back: the elementwise rules (8-bit and 4-bit AdamW) never call it; the
matrix rules (Muon's orthogonalisation, Adafactor's row and column statistics) do, one
matrix at a time each step, so that every layout computes them on the same whole matrix as
one device does without holding a whole copy of the model.

States are described for checkpoints by the logical tensors they form (`Derived`): an
elementwise state is shaped like its parameter; a quantised moment's scales are one value
per block of the logical tensor; a 4-bit moment's codes two values per byte. A layout may cut
a parameter only where a block ends (`derived`), so that each rank's states are whole blocks
of the logical ones, and a checkpoint resumes bit-exactly under any layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.errors import ConfigError


@dataclass
class PieceInfo:
    index: int  # position among the owner's pieces
    name: str
    param: nn.Parameter  # the local parameter (its tensor-parallel slice)
    lo: int  # the piece: elements [lo, hi) of the flattened local parameter
    hi: int
    decay: bool

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.param, "_full_shape", self.param.shape))

    @property
    def held_shape(self) -> tuple[int, ...]:
        """What this rank's pieces assemble to (`Assembler.each`): the logical tensor, of the
        rank's own experts only under expert parallelism."""
        shape = self.logical_shape
        if getattr(self.param, "_ep_slice", None) is not None:
            shape = (self.param.shape[0], *shape[1:])
        return shape

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """The shape of one matrix: stacked expert weights are one matrix per expert."""
        shape = self.logical_shape
        return shape[1:] if getattr(self.param, "_ep_slice", None) is not None or (
            len(shape) == 3) else shape


class Derived:
    """A state's logical tensor, described like a parameter for `shards.logical_parts`:
    the local `shape`, the logical `_full_shape` and the tensor-parallel `_tp_slice`."""

    def __init__(self, shape, full_shape, tp_slice, ratio: int):
        self.shape, self._full_shape, self.ratio = tuple(shape), tuple(full_shape), ratio
        if tp_slice is not None:
            self._tp_slice = tp_slice


def derived(info: PieceInfo, ratio: int, what: str) -> Derived:
    """The logical tensor with one value per `ratio` consecutive values of the parameter's
    flattened logical tensor (a quantisation block: scales; ratio 2: packed 4-bit codes).
    It keeps the parameter's leading dims down to the last one whose tail holds whole
    groups; a tensor-parallel cut must fall on a group boundary (else ConfigError)."""
    local, full = tuple(info.param.shape), info.logical_shape
    spec = getattr(info.param, "_tp_slice", None)
    keep = len(full) - 1
    while keep > 0 and math.prod(full[keep:]) % ratio:
        keep -= 1
    if math.prod(full[keep:]) % ratio or math.prod(local[keep:]) % ratio:
        raise ConfigError(f"{info.name} {full} does not hold whole {what} of {ratio}")
    shape = (*local[:keep], math.prod(local[keep:]) // ratio)
    full_shape = (*full[:keep], math.prod(full[keep:]) // ratio)
    tp = None
    if spec is not None:
        dim, start, stop = spec
        inner = math.prod(full[dim + 1:]) if dim <= keep else 0  # values per index of dim
        if dim < keep:
            tp = spec
        elif dim == keep and (start * inner) % ratio == 0 and (stop * inner) % ratio == 0:
            tp = (dim, start * inner // ratio, stop * inner // ratio)
        else:
            raise ConfigError(
                f"parallel.tp cuts {info.name} {full} along dim {dim}, across its {what} of "
                f"{ratio} values; use a tp that keeps them whole, or train.optimizer = adamw")
    if info.lo % ratio or (info.hi % ratio and info.hi != info.param.numel()):
        raise ConfigError(f"{info.name}: a ZeRO shard cuts a {what} of {ratio} values "
                          f"(internal: the flat layout was not aligned)")
    out = Derived(shape, full_shape, tp, ratio)
    if getattr(info.param, "_ep_slice", None) is not None:  # one logical tensor per expert
        out._ep_slice = info.param._ep_slice
    return out


def piece_view(d: Derived, info: PieceInfo, flat: torch.Tensor) -> tuple:
    """A checkpoint view entry: (descriptor, lo, hi, flat) of the derived tensor."""
    hi = -(-info.hi // d.ratio)
    return d, info.lo // d.ratio, hi, flat


def made(value) -> torch.Tensor:
    """A value handed to `Assembler.each`: a tensor, or a function making it (a piece's fp32
    gradient or Muon's update, made only when its whole tensor is assembled)."""
    return value() if callable(value) else value


class Assembler:
    """Whole logical tensors from pieces and back. One replica without tensor parallelism:
    a piece is its parameter, nothing moves (a value is made when it is read).

    `each` hands the whole tensors out one at a time, so that an assembler that gathers
    (`zero_rules.ZeroAssembler`, `train/optim.py`'s tensor-parallel one) holds one gathered
    tensor at a time, not a copy of the model: a caller drops each (`del`) before asking
    for the next. `live` is what the assembler holds gathered now (the peak tracker counts
    it under comm_buffers, plan/optimizer.py `gathered_bytes` plans it)."""

    live: tuple = ()

    def each(self, values: dict, infos: list[PieceInfo],
             wanted: Callable[[str, torch.Tensor], bool] | None = None
             ) -> Iterator[tuple[int, torch.Tensor]]:
        """(index, whole logical tensor) for each piece of `values` (index -> a tensor or a
        function making it, made once). Every rank of a gathering group calls it (each tensor
        is a collective) with the same `wanted` (name, param) -> bool: the parameters whose
        pieces the rule passes on any rank (None: all)."""
        for i, v in values.items():
            yield i, made(v).view(infos[i].logical_shape)

    def own(self, info: PieceInfo, full: torch.Tensor) -> torch.Tensor:
        return full.reshape(-1)[info.lo:info.hi]


class PieceOptimizer(torch.optim.Optimizer):
    """The base of fivefold's own optimizers: torch's Optimizer for the param groups (the
    owners set `lr` per group each step), a step counter, and the state protocol.
    A rule reads a piece's gradient with `grad(master)`, one piece at a time."""

    grads = None  # the owner's step_grads.StepGrads, during a step (update.clipped_step)
    # A rule that can leave its step undone on the device sets SKIPS_ON_DEVICE; the owner
    # then hands it the step's overflow flag (a 0-d float, 1.0: skip) as `found_inf` for the
    # step (update.clipped_step), and the rule keeps every old value where the flag says so
    # (`kept`): no host decision, no wait for the device.
    SKIPS_ON_DEVICE = False
    found_inf = None

    def __init__(self, masters: list[torch.Tensor], infos: list[PieceInfo], tr,
                 assembler: Assembler | None = None, lr_ratio: float = 1.0):
        self.infos, self.tr = infos, tr
        self.assembler = assembler or Assembler()
        self.info_of = {id(m): info for m, info in zip(masters, infos)}
        self.masters = list(masters)
        decay = [m for m, i in zip(masters, infos) if i.decay]
        plain = [m for m, i in zip(masters, infos) if not i.decay]
        groups = [{"params": decay, "weight_decay": tr.weight_decay},
                  {"params": plain, "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]] or [{"params": []}],
                         {"lr": tr.lr, "lr_ratio": lr_ratio})
        self.steps = 0  # steps begun (`begin_step`); those skipped on the device: `skipped`
        self.skipped: torch.Tensor | None = None
        self.skip: torch.Tensor | None = None  # during a step: found_inf > 0, or None
        self.converting: dict[int, dict[str, torch.Tensor]] = {}

    def skips_on_device(self) -> bool:
        """Whether this rule takes `found_inf` (update.skips_on_device)."""
        return self.SKIPS_ON_DEVICE

    def begin_step(self) -> float | torch.Tensor:
        """Count a step; returns its number t as the update uses it: a float, or, once a
        step could have been skipped on the device, a 0-d fp32 tensor there (the steps
        begun less those skipped: whole numbers, exact in fp32 up to 2^24)."""
        self.steps += 1
        flag = self.found_inf
        self.skip = None if flag is None else flag > 0
        if flag is not None:
            self.skipped = flag.float() if self.skipped is None else self.skipped + flag
        if self.skipped is None:
            return float(self.steps)
        return float(self.steps) - self.skipped

    def steps_taken(self) -> int:
        """Steps taken, skipped ones not counted (a read of the device's count, if any:
        for checkpoints, not for the step)."""
        return self.steps - (0 if self.skipped is None else int(self.skipped))

    def kept(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """`new`, or `old` where this step is skipped on the device (bit for bit `new`
        otherwise: a select, no arithmetic)."""
        return new if self.skip is None else torch.where(self.skip, old, new)

    # --- the protocol the owners use ----------------------------------------------------
    def checkpoint_views(self, master: torch.Tensor, load: bool,
                         convert_from: str | None = None) -> dict:
        """key -> a flat view of [lo, hi) of the parameter, or (Derived, lo, hi, flat)."""
        raise NotImplementedError

    def shaped_states(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """The states shaped like the local parameter (fp32), for comparisons in tests."""
        raise NotImplementedError

    def state_tensors(self) -> list[torch.Tensor]:
        """Every state tensor held, for byte counts."""
        return [t for st in self.state.values() for t in st.values()
                if isinstance(t, torch.Tensor)]

    def loaded(self, step: int) -> None:
        """The views of `checkpoint_views(load=True)` are filled (or, at step 0, unused)."""
        self.steps, self.skipped = step, None
        if step == 0:
            for m in self.masters:
                self.reset_state(m)
        self.converting = {}

    def reset_state(self, master: torch.Tensor) -> None:
        raise NotImplementedError

    def grad(self, master: torch.Tensor) -> torch.Tensor | None:
        """A piece's fp32 gradient for this step: made now from the owner's `StepGrads`
        (step_grads.py: one piece's copy, dropped by the caller after use), or its `.grad`
        when the owner bound the gradients themselves (fp32 parameters, or a direct step)."""
        grads = self.grads
        if grads is not None and grads.copy and id(master) in grads.index_of:
            return grads.make([grads.index_of[id(master)]])[0]
        return master.grad

    def group_lr(self, group) -> float:
        return group["lr"] * group.get("lr_ratio", 1.0)
