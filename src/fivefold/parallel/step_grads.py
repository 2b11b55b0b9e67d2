"""The fp32 gradients an optimizer step works on, made where they are used, a piece at a time.

With fp32 master weights beside bf16/fp16 parameters (or masters offloaded to the CPU) the
update needs each piece's reduced gradient in fp32, on the states' device. Copied all at
once that is 4 bytes per parameter of the rank's shard alive together on top of everything
the step holds: on an H100 the allocator's peak stood 5.6 GiB above the peak tracker's for
an 8B-shaped model (docs/benchmarks.md). `StepGrads` makes a copy when a consumer asks and
keeps none: the gradient norm casts one `NORM_PIECE` range (on a CPU) or one chunk of pieces
(on a GPU) at a time, the update one chunk of pieces at a time, each dropped after use. A
chunk is consecutive pieces of at most `STEP_CHUNK` values together, or one larger piece:
what the step adds is at most 4 bytes a value of the larger of the two.

The numbers are bit for bit those of the copy made all at once: the same cast, then the same
multiplications by the same fp32 factors in the same order (1/loss scale, then the clipping
coefficient), each elementwise, so a piece made alone equals its part of the whole. The cast
and the first factor are one pass: a bf16 gradient times a one-element fp32 tensor is an fp32
tensor (a dimensioned operand takes part in type promotion, a 0-d one would not), each value
widened exactly and multiplied once in fp32, as a cast followed by a multiplication in place
gives it, without the fp32 copy written, read and written again (8 bytes a value). The norm
reduces each piece as before (a CPU the same float64 `NORM_PIECE` ranges, a GPU's
`_foreach_norm` each tensor on its own, whatever list it is in); torch's AdamW updates each
tensor on its own whether it is stepped alone or with others (per-tensor kernels and step
counters). The price: the norm and the update each cast the gradient, two casts for one.

Without a separate master (fp32 parameters on the device) the reduced gradients *are* the
fp32 gradients: they are scaled in place, once, as before, and nothing is copied.
"""

from __future__ import annotations

import weakref

import torch

from fivefold.parallel import peak

STEP_CHUNK = 1 << 20  # values of small pieces updated together (4 MiB of fp32 gradients)


class StepGrads:
    """The fp32 gradients of an owner's pieces for one optimizer step.

    `sources[i]` is piece i's reduced gradient (a view, compute dtype, compute device) and
    `masters[i]` the fp32 tensor it updates. With `copy` the fp32 gradient is made on
    `device` when asked (`make`); without, the sources are it."""

    def __init__(self, sources: list[torch.Tensor], device: torch.device, copy: bool,
                 masters: list[torch.Tensor] | None = None,
                 params: list[torch.Tensor] | None = None):
        self.sources, self.device, self.copy = list(sources), torch.device(device), copy
        self.masters = list(masters) if masters is not None else []
        # the compute-dtype parameters the masters are copied into after the step, when the
        # owner hands them: a one-pass update may write them itself (`written`: their indices)
        self.params = list(params) if params is not None else None
        self.written: set[int] = set()
        self.index_of = {id(m): i for i, m in enumerate(self.masters)}
        self.factors: list[float | torch.Tensor] = []  # applied to each copy, in order
        self.live: list[weakref.ref] = []  # the copies made last, while they are alive

    def __len__(self) -> int:
        return len(self.sources)

    def numel(self, i: int) -> int:
        return self.sources[i].numel()

    def scale_(self, factor: float | torch.Tensor) -> None:
        """Multiply every gradient by `factor` (a float, or a 0-d tensor): in place without
        a copy, else on each copy as it is made."""
        if not self.sources:
            return
        if isinstance(factor, torch.Tensor):  # the dtype and device of the fp32 gradients
            target = self.sources[0] if not self.copy else None
            factor = factor.to(device=self.device if target is None else target.device,
                               dtype=torch.float32 if target is None else target.dtype)
        if self.copy:
            if not self.factors and not isinstance(factor, torch.Tensor):
                # the first factor goes into the cast (`make`): an fp32 tensor, the value a
                # multiplication by the Python float rounds it to
                factor = torch.full((), factor, dtype=torch.float32, device=self.device)
            self.factors.append(factor)
        else:
            torch._foreach_mul_(self.sources, factor)

    def make(self, indices: list[int], lo: int | None = None, hi: int | None = None,
             sample: bool = True) -> list[torch.Tensor]:
        """The fp32 gradients of pieces `indices` (of values [lo, hi) of each flattened one,
        when given): fresh copies, scaled, unless the sources are the gradients themselves.
        `sample`: let an active peak tracker count the copies (`optimizer step`)."""
        def source(i):
            s = self.sources[i]
            return s if lo is None else s.reshape(-1)[lo:hi]

        if not self.copy:
            return [source(i) for i in indices]
        fused = bool(self.factors) and all(self.sources[i].device == self.device
                                           for i in indices)
        out = [self._cast(source(i), fused) for i in indices]
        for factor in self.factors[1:] if fused else self.factors:
            torch._foreach_mul_(out, factor)
        if sample:
            self.live = [weakref.ref(t) for t in out]
            peak.sample("optimizer step")
        return out

    def _cast(self, s: torch.Tensor, fused: bool) -> torch.Tensor:
        """One source as a fresh fp32 tensor on `device`; with `fused` (a factor pending, the
        sources on `device`) times the first factor in the same pass (bf16: read 2, write 4
        bytes a value)."""
        if not fused:
            return s.to(device=self.device, dtype=torch.float32, copy=True)
        return torch.mul(s, self.factors[0].reshape(1)).view(s.shape)

    def exact_sources(self, indices: list[int]) -> list[torch.Tensor] | None:
        """The sources of pieces `indices` when their values are the fp32 gradients exactly
        (no factor pending: a bf16 or fp16 value widens to fp32 without rounding), for a
        reader that only reads them (the gradient norm on a GPU: 2 bytes a value read
        instead of a cast's 2 + 4 and the norm's 4); else None (`make` them)."""
        if self.copy and self.factors:
            return None
        return [self.sources[i] for i in indices]

    def live_tensors(self) -> list[torch.Tensor]:
        """The copies of the last `make` still alive (for a peak tracker's `grads`)."""
        return [t for t in (r() for r in self.live) if t is not None]

    def chunks(self, indices: list[int] | None = None) -> list[list[int]]:
        """`indices` (default: every piece) in runs of consecutive pieces of at most
        `STEP_CHUNK` values, a larger piece alone; without a copy, one run of all."""
        indices = list(range(len(self))) if indices is None else indices
        if not self.copy:
            return [indices] if indices else []
        out, run, size = [], [], 0
        for i in indices:
            if run and size + self.numel(i) > STEP_CHUNK:
                out.append(run)
                run, size = [], 0
            run.append(i)
            size += self.numel(i)
        return out + [run] if run else out

    def bind(self) -> None:
        """Set every master's `.grad` to its source (only without a copy: nothing is made)."""
        assert not self.copy
        for m, g in zip(self.masters, self.sources):
            m.grad = g


def step_torch(optimizer: torch.optim.Optimizer, grads: StepGrads) -> None:
    """Step a torch optimizer over its masters in `grads`: bound all at once without a copy,
    else one chunk at a time (a master without `.grad` is left alone by torch's step, and
    its step counter with it), each chunk's copies dropped before the next is made. On a
    GPU, fused AdamW's step over copies is instead one pass over the compute-dtype gradients
    (parallel/adamw_kernel.py: no copies made at all)."""
    if not grads.copy:
        optimizer.step()
        return
    from fivefold.parallel import adamw_kernel

    if adamw_kernel.applies(optimizer, grads):
        grads.written |= adamw_kernel.step_mixed(optimizer, grads,
                                                 getattr(optimizer, "found_inf", None))
        return
    mine = sorted(grads.index_of[id(p)] for g in optimizer.param_groups for p in g["params"]
                  if id(p) in grads.index_of)
    for chunk in grads.chunks(mine):
        _bind_chunk(grads, chunk)
        optimizer.step()
        for i in chunk:  # the chunk's copies go now, before the next chunk is made
            grads.masters[i].grad = None


def _bind_chunk(grads: StepGrads, chunk: list[int]) -> None:
    """The chunk's copies as its masters' `.grad` (no other reference to them outlives it)."""
    for i, g in zip(chunk, grads.make(chunk)):
        grads.masters[i].grad = g


def run_update(optimizer, grads: StepGrads) -> None:
    """The update of `optimizer` on `grads`: torch's optimizers a chunk at a time; fivefold's
    own (optim_base.PieceOptimizer) and the NVMe AdamW ask `grads` for each piece."""
    if hasattr(optimizer, "grads"):
        optimizer.grads = grads
        try:
            optimizer.step()
        finally:
            optimizer.grads = None
    else:
        step_torch(optimizer, grads)
