"""Delayed scaling for the tensorwise recipe: each cast's scale from an amax history.

Dynamic tensorwise scaling needs x's amax before x's first code: a reduction pass over x
before the cast pass (lowp/fused.py: two kernels per operand). Delayed scaling takes the
scale from the amaxes of earlier steps instead, and records this step's amax in the same
pass as the cast (Transformer Engine's default recipe, `DelayedScaling`:
`amax_history_len`, `amax_compute_algo = "max"`; transformer_engine/common/recipe/
__init__.py). Per FP8 linear and operand (x, W, ∂y) one history row of H float32 amaxes,
newest first:

    m    = fmt.max / max(history)           (numerics.scaling.amax_to_scale, float64)
    q    = fp8(clamp(float32(x) · m, ±fmt.max))   x may now exceed the history's amax:
                                                  the clamp saturates it
    fold = pending <- max(pending, amax(x))    (NaN recorded as inf), every cast
    push = history[1:] <- history[:-1]; history[0] <- pending   once per optimizer step

Byte for byte `numerics.fp8.quantize_with_amax(x, max(history), fmt)` on either path: the
GPU's (numerics/fp8_cast.py `fp8_cast_delayed` writes the codes, their transpose and each
64x64 tile's amax in one pass, `fp8_amax_fold` folds them into the pending record) and the
CPU's (an aminmax pass for the record, then multiply, clamp and cast).

When each operand casts and records:
  - Within one optimizer step every cast of an operand takes the same scale: from the
    history as the step began (or, with no record yet, from the tensor's own amax). The
    step's casts fold their amaxes into a pending record (`fp8_amax_step`, (3,) float32:
    the maximum over the step's micro-batches, forward and backward), and `end_step`, once
    per optimizer step, pushes it into the history: the history moves one place a step,
    whatever the micro-batch split. (torchao's delayed Float8Linear kept the scale for the
    whole step too, updating it in `sync_float8_amax_and_scale_history` once per step.)
  - Under data and context parallelism each rank sees other tokens of the same tensors,
    under tensor parallelism other slices of them (a weight's shard, a row-parallel input's
    channels, a column-parallel output gradient's): `end_step` takes the maximum of every
    linear's pending record over all those ranks in ONE all_reduce(max) (Transformer
    Engine's amax reduction group: `fp8_group` of `fp8_autocast`, reduced in
    `FP8GlobalStateManager.reduce_and_update_fp8_tensors`, transformer_engine/pytorch/
    fp8.py), so every rank pushes the same record and casts with the same scale, the single
    device's for the same global batch.
  - Under pipeline parallelism a stage's ranks hold its layers' linears and no other rank
    does: the reduction runs over the stage's dp x cp x tp ranks (the mesh's `stage` group)
    with the records of this rank's chunks only, not over every rank with each stage
    filling its own rows of a whole-model tensor (pp times the bytes, and a call across
    stages that finish their last backward at different times, for maxima with zeros).
    Every schedule only reorders the micro-batches' forwards and backwards between two
    `end_step`s, so each cast still takes the history as the step began. Zero-bubble's
    split backward runs the linear's backward for the input gradient (B) and again for
    the weight gradient (W) from the same kept ∂y: the same scale, the same amax folded
    twice, max(a, a) = a, as under recomputation.
  - x and W in the forward, ∂y in the backward; W's transposed copy for the input gradient
    is cast again in the backward (the weight is not saved in FP8, lowp/linear.py) with the
    forward's scale (W has not changed since), so its codes are the forward's, moved.
  - Under ZeRO-3's FP8 all-gather (parallel.fp8_allgather, parallel/zero3_fp8.py) W
    comes cast already, by the gather, with this history's scale; the linear folds the
    amax of its rank's piece of W (`record_gathered`), and `end_step`'s reduction makes it
    the whole weight's. Wᵀ is the gathered codes transposed.
  - A recomputed forward (train.recompute) casts with the same scale as the first one and
    folds the same amax again: max(a, a) = a, so recomputation changes no bit.
  - Records happen only under autograd (training); an evaluation forward under no_grad
    casts with the history and leaves it as it is, so evaluation does not move training.
  - The first step of a row with no record yet (a fresh model) casts with each tensor's
    own amax, as the dynamic recipe does: the first step is dynamic tensorwise, bit for
    bit. Transformer Engine starts instead from scale = 1 with a zero history (its `scale`
    buffers start at ones, transformer_engine/pytorch/module/base.py, and the update kernel
    of transformer_engine/common/recipe/delayed_scaling.cu keeps the previous scale unless
    max(history) is finite and > 0), which on its first step flushes gradients below
    E5M2's smallest subnormal (2^-16) to zero. Which rows hold a record (`filled`) is
    known for a new history (none) and read from a loaded one (one host sync,
    `forget_filled`), then kept here.
  - Compiled (train.compile), the same code is traced per block: `filled` is a constant of
    the graph (dynamo guards on it), so a block compiles twice, for the first step and for
    every later one; the records fold in place into the pending buffer (`fp8_amax_fold`, a
    custom op declaring the mutation, on the fused path; an in-place maximum on the CPU's),
    which the compiled forward and backward keep; which rows a call records is marked by
    the traced forward, outside the autograd function (`note_forward`), ∂y's row too,
    since a compiled backward cannot touch host state (tests/test_fp8_delayed_compile.py).
  - A NaN or inf amax makes max(history) non-finite and the multiplier NaN (as dynamic
    scaling does for that one step) for the next H steps, until it leaves the history;
    Transformer Engine keeps the previous scale instead (the same kernel).

The histories are buffers of the module (`fp8_amax_history`, not persistent: a model's
state_dict, its HF export and inference loads do not see them) and training state in the
checkpoint (train/checkpoint_parts.py, `fp8/NAME.amax_history`), so a resumed run casts as
the uninterrupted one did (tests/test_fp8_delayed.py). The pending record is empty between
steps, where checkpoints are taken.

The histories keep the unsplit model's module names under pp (parallel/pipeline/stages.py),
so a checkpoint of any pp layout loads into any other (each rank reads its chunks' rows).
Routed experts (lowp/experts.py, the tensorwise loop) keep one history per expert and
projection (`add_expert_history`, (E, 3, 3, H)): an expert that meets no token in a
micro-batch casts nothing there, and in a step where it met none its history does not move
(no 0 record pushed). Which experts met tokens differs between ranks (dp: other tokens; ep:
other experts), so with their records each rank sends a flag per row in the same reduction,
and the push happens where any rank recorded, on the device (`_push_experts`): every rank
pushes what one device would. Under ep each rank fills its own experts' rows of every
expert's block (zeros elsewhere, the maximum's identity), so the one all_reduce(max) over
the stage also reduces the experts over their edp x tp holders. Under ZeRO-3's FP8
all-gather an expert's W record is its rank's piece's amax (`record_gathered`), folded on
every rank, with tokens or not; only the former raise its flag. On a first step under
tensor parallelism a shard's own amax is its slice's (as dynamic tensorwise under tp); the
whole tensor's from the second step on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivefold.lowp import fused
from fivefold.lowp.quantize import group_amax, multiplier
from fivefold.numerics import fp8_cast
from fivefold.numerics.formats import E4M3, FloatFormat
from fivefold.numerics.fp8 import FP8Tensor
from fivefold.numerics.kernel_support import compiling

SCALINGS = ("dynamic", "delayed")
DEFAULT_HISTORY_LEN = 16  # torchao float8 DelayedScalingConfig.history_len (removed); TE: 1024
BUFFER = "fp8_amax_history"
PENDING = "fp8_amax_step"
ROW = {"input": 0, "weight": 1, "grad": 2}


@dataclass
class DelayedState:
    """What one call of the FP8 linear needs: the module's history buffer, which of its
    rows hold a record (the module's own list, updated by `end_step`), whether to record,
    and the step's pending record with which of its rows this step has folded into."""

    history: torch.Tensor
    filled: list
    record: bool
    pending: torch.Tensor | None = None
    recorded: list | None = None

    def __post_init__(self):
        if self.pending is None:  # a state made by hand (a trace): its own pending record
            self.pending = torch.zeros(3, dtype=torch.float32, device=self.history.device)
        if self.recorded is None:
            self.recorded = [False] * 3


def add_history(module: nn.Module, history_len: int) -> None:
    """Give an FP8 linear its amax histories: (3, history_len) float32 zeros (no record),
    and the step's pending record, (3,) zeros."""
    device = module.weight.device
    module.register_buffer(BUFFER, torch.zeros(3, history_len, dtype=torch.float32,
                                               device=device), persistent=False)
    module.register_buffer(PENDING, torch.zeros(3, dtype=torch.float32, device=device),
                           persistent=False)
    module._fp8_filled = None if device.type == "meta" else [False] * 3  # (zeros: known)
    module._fp8_recorded = [False] * 3


def add_expert_history(module: nn.Module, history_len: int) -> None:
    """Give routed experts (a stacked GroupedExperts, lowp/experts.py) their histories: per
    local expert and projection (w_gate, w_up, w_down) the three rows of a linear,
    (E, 3, 3, history_len) float32 zeros, and the pending records, (E, 3, 3)."""
    experts, device = module.w_gate.shape[0], module.w_gate.device
    module.register_buffer(BUFFER, torch.zeros(experts, 3, 3, history_len,
                                               dtype=torch.float32, device=device),
                           persistent=False)
    module.register_buffer(PENDING, torch.zeros(experts, 3, 3, dtype=torch.float32,
                                                device=device), persistent=False)
    module._fp8_filled = (None if device.type == "meta"
                          else [[False] * 3 for _ in range(3 * experts)])
    module._fp8_recorded = [[False] * 3 for _ in range(3 * experts)]


def is_experts(module: nn.Module) -> bool:
    return getattr(module, BUFFER).dim() == 4


def expert_state(module: nn.Module, expert: int, projection: int) -> DelayedState:
    """The state of one local expert's projection (0 gate, 1 up, 2 down): its rows of the
    module's history and pending record (views), and its host lists."""
    history = getattr(module, BUFFER)
    if module._fp8_filled is None:  # one host sync (`_push_experts` says when)
        module._fp8_filled = ([[True] * 3] * (3 * history.shape[0])
                              if history.device.type == "meta"
                              else (history.amax(dim=-1) > 0).reshape(-1, 3).tolist())
    i = 3 * expert + projection
    return DelayedState(history[expert, projection], module._fp8_filled[i],
                        torch.is_grad_enabled(), getattr(module, PENDING)[expert, projection],
                        module._fp8_recorded[i])


def expert_range(module: nn.Module) -> tuple[int, int, int]:
    """(first, stop, all): this rank's experts among all of them (parallel/expert.py)."""
    local = getattr(module, BUFFER).shape[0]
    return getattr(module, "_ep_range", (0, local, local))


def history_parts(model: nn.Module) -> dict[str, tuple[tuple, tuple, torch.Tensor]]:
    """Every amax history of a model by its module's name, as (the logical shape, this
    rank's offset in it, the local tensor): under expert parallelism a rank holds its
    experts' rows of the experts' history."""
    out = {}
    for name, history in histories(model).items():
        module = model.get_submodule(name)
        if history.dim() == 4:
            first, _, every = expert_range(module)
            out[name] = ((every, *history.shape[1:]), (first, 0, 0, 0), history)
        else:
            out[name] = (tuple(history.shape), (0,) * history.dim(), history)
    return out


def state_of(module: nn.Module) -> DelayedState | None:
    history = getattr(module, BUFFER, None)
    if history is None:
        return None
    if getattr(module, "_fp8_filled", None) is None:  # once per process: one host sync
        # (a trace on meta has no values: it shows the steady state, every row recorded)
        module._fp8_filled = ([True] * 3 if history.device.type == "meta"
                              else (history.amax(dim=1) > 0).tolist())
    return DelayedState(history, module._fp8_filled, torch.is_grad_enabled(),
                        getattr(module, PENDING), module._fp8_recorded)


def delayed_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of a model that keep an amax history, in module order."""
    return [m for m in model.modules() if getattr(m, BUFFER, None) is not None]


def histories(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every amax history of a model by its module's name."""
    return {name: getattr(m, BUFFER) for name, m in model.named_modules()
            if getattr(m, BUFFER, None) is not None}


def forget_filled(model: nn.Module) -> None:
    """After a checkpoint load wrote the histories: read which rows hold a record again, now
    (one host sync per module, at the load, not inside the first step's compiled blocks)."""
    for m in delayed_modules(model):
        history = getattr(m, BUFFER)
        m._fp8_filled = None
        if history.device.type != "meta":
            m._fp8_filled = (history.amax(dim=-1) > 0).reshape(-1, 3).tolist()
            if not is_experts(m):
                m._fp8_filled = m._fp8_filled[0]


def end_step(modules: list[nn.Module], reduce_max=None) -> None:
    """Once per optimizer step: every module's pending record, reduced to its maximum over
    the ranks that saw other tokens of the same tensors by `reduce_max` (an in-place
    all_reduce(max) of one (L, 3) float32 tensor: the trainer's, over the pipeline stage's
    dp x cp x tp ranks), pushed into
    its history; the pending records emptied.
    Which rows recorded is host state that every rank of the group shares (they ran the
    same code), so no rank waits on a value to decide what to push; routed experts' rows
    carry their flags in the reduction instead (`_expert_block`)."""
    modules = [m for m in modules if getattr(m, BUFFER, None) is not None]
    experts = [m for m in modules if is_experts(m)]
    modules = [m for m in modules if not is_experts(m)]
    if not modules and not experts:
        return
    parts = [torch.stack([getattr(m, PENDING) for m in modules]).reshape(-1)] if modules else []
    parts += [_expert_block(m) for m in experts]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]  # one copy
    if reduce_max is not None:
        reduce_max(flat)
    pending = flat[:3 * len(modules)].reshape(-1, 3)
    start = 3 * len(modules)
    for m in experts:
        start = _push_experts(m, flat, start)
    for m, record in zip(modules, pending):
        history, rows = getattr(m, BUFFER), m._fp8_recorded
        if all(rows):
            history.copy_(torch.cat([record.unsqueeze(1), history[:, :-1]], dim=1))
        else:
            for row in (r for r in range(3) if rows[r]):
                history[row].copy_(torch.cat([record[row:row + 1], history[row, :-1]]))
        if any(rows):
            filled = m._fp8_filled if m._fp8_filled is not None else [False] * 3
            m._fp8_filled = [f or r for f, r in zip(filled, rows)]
        getattr(m, PENDING).zero_()
        m._fp8_recorded = [False] * 3


def _expert_block(module: nn.Module) -> torch.Tensor:
    """The experts' part of the reduced tensor: for every expert of the layer (not only
    this rank's: under ep each rank fills its own experts' rows, zeros elsewhere, so one
    all_reduce(max) over the stage serves the experts and the rest), 3 projections x 3
    records, then as many flags (1 where this rank recorded). An expert that met no token
    on a rank records nothing there; the flags' maximum says whether any rank did."""
    pending = getattr(module, PENDING)
    first, stop, every = expert_range(module)
    rows = pending.shape[0] * 9
    flags = torch.tensor(module._fp8_recorded, dtype=torch.float32).reshape(-1)
    local = torch.cat([pending.reshape(-1), flags.to(pending.device, non_blocking=True)])
    if (first, stop) == (0, every):
        return local
    block = pending.new_zeros(2, every * 9)
    block[:, first * 9:stop * 9] = local.view(2, rows)
    return block.reshape(-1)


def _push_experts(module: nn.Module, flat: torch.Tensor, start: int) -> int:
    """Push each local expert projection's reduced record where any rank recorded it (on
    the device: no rank waits on the flags); rows no rank recorded keep their history, as
    on one device, where an expert that met no token in the step casts nothing."""
    history, pending = getattr(module, BUFFER), getattr(module, PENDING)
    first, stop, every = expert_range(module)
    block = flat[start:start + 2 * every * 9].view(2, every, 3, 3)[:, first:stop]
    record, flag = block[0], block[1] > 0
    pushed = torch.cat([record.unsqueeze(-1), history[..., :-1]], dim=-1)
    history.copy_(torch.where(flag.unsqueeze(-1), pushed, history))
    if module._fp8_filled is not None:
        # A projection that recorded here recorded the rows every rank's would (which rows
        # a projection records is the code's, not the tokens': up's x is gate's cast), so
        # its rows are known on the host. One that met no token here may have been
        # recorded on another rank: its rows are read again (one host sync, at the next
        # cast), only then and only until it holds every record.
        filled, stale = [], False
        for fs, rs in zip(module._fp8_filled, module._fp8_recorded):
            filled.append([f or r for f, r in zip(fs, rs)] if any(rs) else fs)
            stale = stale or not (any(rs) or all(fs))
        module._fp8_filled = None if stale else filled
    pending.zero_()
    module._fp8_recorded = [[False] * 3 for _ in module._fp8_recorded]
    return start + 2 * every * 9


def _fused(t: torch.Tensor) -> bool:
    return fused.fused(t)


def _cpu_cast(x: torch.Tensor, amax: torch.Tensor, fmt: FloatFormat) -> FP8Tensor:
    """quantize_with_amax's bytes in small passes: multiply into float32, clamp, cast."""
    m = multiplier(amax, fmt)
    scaled = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    torch.mul(x.detach(), m.reshape(1, 1), out=scaled)
    scaled.clamp_(-fmt.max, fmt.max)
    return FP8Tensor(scaled.to(fmt.dtype), m.reciprocal(), "tensorwise", fmt)


def cast(x: torch.Tensor, state: DelayedState, row: str, fmt: FloatFormat, want: bool = True,
         want_t: bool = False, record: bool = True) -> tuple[FP8Tensor | None,
                                                             FP8Tensor | None]:
    """(x's codes if `want`, xᵀ's codes if `want_t`), one scale, from the history row (or,
    with no record yet, from x's own amax); folds x's amax into the step's pending record
    when `record` and the state records. On the CPU path xᵀ is the codes transposed (the
    same bytes)."""
    i = ROW[row]
    hist = state.history[i]
    first = not state.filled[i]
    # Wᵀ on a first step: W's own amax is what the forward folded into the pending record
    # (W is the same in every micro-batch of the step), so no second amax pass over W
    pending = first and not record and state.recorded[i]
    record = record and state.record
    if _fused(x):
        source = (state.pending[i:i + 1] if pending else
                  fp8_cast.fp8_amax_partials(x) if first else hist)
        codes, codes_t, scale, amax = fp8_cast.fp8_cast_delayed(x, source, fmt.name, want,
                                                                want_t)
        if record:
            fp8_cast.fp8_amax_fold(state.pending[i:i + 1], amax)
        q = FP8Tensor(codes, scale, "tensorwise", fmt) if want else None
        qt = FP8Tensor(codes_t, scale, "tensorwise", fmt) if want_t else None
    else:
        own = (state.pending[i] if pending else
               group_amax(x, "tensorwise").float().nan_to_num(nan=float("inf")))
        q = _cpu_cast(x, own if first else hist.max(), fmt)
        if record:
            torch.maximum(state.pending[i], own.reshape(()), out=state.pending[i])
        qt = q.t() if want_t else None
        q = q if want else None
    return q, qt


def record_gathered(state: DelayedState, wq: FP8Tensor) -> None:
    """W's record when ZeRO-3 gathered W in FP8 (parallel/zero3_fp8.py), cast with this
    history's scale before the gather: the amax of this rank's piece of W (`wq.record`, NaN
    recorded as inf) folds into the pending record; `end_step`'s all_reduce(max) over every
    rank makes it the whole weight's, the record the linear folds from the gathered W.
    The row is marked recorded by the linear's call (`note_forward`), not here: a routed
    expert without tokens on this rank (lowp/experts.py `_fold_gathered`) folds its amax
    with no mark."""
    record = getattr(wq, "record", None)
    if record is None:
        raise ValueError("a delayed FP8 linear got a gathered FP8 weight without its amax "
                         "record (parallel/zero3_fp8.py)")
    if state.record:
        i = ROW["weight"]
        torch.maximum(state.pending[i], record.reshape(()), out=state.pending[i])


def input_pair(x2: torch.Tensor, state: DelayedState) -> tuple[FP8Tensor, FP8Tensor]:
    """(x for the forward, the copy saved for the weight gradient): on the GPU path xᵀ's
    codes written by the same pass, on the CPU path x's codes (transposed in backward)."""
    xq, xt = cast(x2, state, "input", E4M3, True, _fused(x2))
    return xq, (xt if xt is not None else xq)


def weight(w: torch.Tensor, state: DelayedState, transposed: bool = False) -> FP8Tensor:
    """W (forward: cast and recorded) or Wᵀ (backward: the forward's scale, not recorded
    again)."""
    q, qt = cast(w, state, "weight", E4M3, not transposed, transposed,
                 record=not transposed)
    return qt if transposed else q


def grad_pair(g2: torch.Tensor, state: DelayedState, fmt: FloatFormat
              ) -> tuple[FP8Tensor, FP8Tensor]:
    """(∂y for the input gradient, ∂yᵀ for the weight gradient), one cast and record."""
    gq, gt = cast(g2, state, "grad", fmt, True, True)
    if state.record and not compiling():  # (compiled: `note_forward` marked it)
        state.recorded[ROW["grad"]] = True
    return gq, gt


def note_forward(state: DelayedState, own_input: bool) -> None:
    """Which rows a recording call of the FP8 linear (lowp/linear.py `fp8_linear`) folds
    into, marked on the host before its autograd function runs: x's unless the call shares
    another linear's cast of the same x, and W's (cast here, or gathered: `record_gathered`).
    ∂y's is marked by its backward when that runs eagerly; under torch.compile the backward
    is one compiled graph that cannot touch host state, so the forward marks it (the
    trainer runs every forward's backward before `end_step`)."""
    rows = [ROW["input"]] if own_input else []
    rows.append(ROW["weight"])
    if compiling():
        rows.append(ROW["grad"])
    for row in rows:
        state.recorded[row] = True
