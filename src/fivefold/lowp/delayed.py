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
    push = history[1:] <- history[:-1]; history[0] <- amax(x)  (NaN recorded as inf)

Byte for byte `numerics.fp8.quantize_with_amax(x, max(history), fmt)` on either path: the
GPU's (numerics/fp8_cast.py `fp8_cast_delayed` writes the codes, their transpose and each
64x64 tile's amax in one pass, `fp8_history_push` folds them into the row) and the CPU's
(an aminmax pass for the record, then multiply, clamp and cast).

When each operand casts and records:
  - x and W in the forward, ∂y in the backward, each with the history as it was before its
    own record; W's transposed copy for the input gradient is cast again in the backward
    (the weight is not saved in FP8, lowp/linear.py) from W's row after the forward's
    record, which holds W's own amax (W has not changed since): it never saturates.
  - Each micro-batch's forward and backward record (gradient accumulation over 4
    micro-batches moves the history 4 places a step), as Transformer Engine records per
    forward; the run is deterministic for a given micro-batch split, not across splits.
  - Records happen only under autograd (training); an evaluation forward under no_grad
    casts with the history and leaves it as it is, so evaluation does not move training.
  - The first cast of a row with no record yet (a fresh model) takes its own amax, as the
    dynamic recipe does: the first step is dynamic tensorwise, bit for bit. Transformer
    Engine starts instead from scale = 1 with a zero history (its `scale` buffers start at
    ones, transformer_engine/pytorch/module/base.py, and the update kernel of
    transformer_engine/common/recipe/delayed_scaling.cu keeps the previous scale unless
    max(history) is finite and > 0), which on its first step flushes gradients below
    E5M2's smallest subnormal (2^-16) to zero. Which rows hold a record is
    read from the history once per process (one host sync, `filled`), then kept here.
  - A NaN or inf amax makes max(history) non-finite and the multiplier NaN (as dynamic
    scaling does for that one step) for the next H casts, until it leaves the history;
    Transformer Engine keeps the previous scale instead (the same kernel).

The histories are buffers of the module (`fp8_amax_history`, not persistent: a model's
state_dict, its HF export and inference loads do not see them) and training state in the
checkpoint (train/checkpoint_parts.py, `fp8/NAME.amax_history`), so a resumed run casts as
the uninterrupted one did (tests/test_fp8_delayed.py).

Not here: an amax reduction over data-parallel or tensor-parallel ranks (Transformer
Engine's `reduce_amax`), so config/fp8.py refuses delayed scaling under any parallelism,
with recomputation (a recomputed forward would record twice and cast with another scale)
and with routed experts.
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

SCALINGS = ("dynamic", "delayed")
DEFAULT_HISTORY_LEN = 16  # torchao float8 DelayedScalingConfig.history_len (removed); TE: 1024
BUFFER = "fp8_amax_history"
ROW = {"input": 0, "weight": 1, "grad": 2}


@dataclass
class DelayedState:
    """What one call of the FP8 linear needs: the module's history buffer, which of its
    rows hold a record (the module's own list, updated here) and whether to record."""

    history: torch.Tensor
    filled: list
    record: bool


def add_history(module: nn.Module, history_len: int) -> None:
    """Give an FP8 linear its amax histories: (3, history_len) float32 zeros (no record)."""
    device = module.weight.device
    module.register_buffer(BUFFER, torch.zeros(3, history_len, dtype=torch.float32,
                                               device=device), persistent=False)
    module._fp8_filled = None


def state_of(module: nn.Module) -> DelayedState | None:
    history = getattr(module, BUFFER, None)
    if history is None:
        return None
    if getattr(module, "_fp8_filled", None) is None:  # once per process: one host sync
        # (a trace on meta has no values: it shows the steady state, every row recorded)
        module._fp8_filled = ([True] * 3 if history.device.type == "meta"
                              else (history.amax(dim=1) > 0).tolist())
    return DelayedState(history, module._fp8_filled, torch.is_grad_enabled())


def histories(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every amax history of a model by its module's name."""
    return {name: getattr(m, BUFFER) for name, m in model.named_modules()
            if getattr(m, BUFFER, None) is not None}


def forget_filled(model: nn.Module) -> None:
    """After a checkpoint load wrote the histories: read which rows hold a record again."""
    for m in model.modules():
        if getattr(m, BUFFER, None) is not None:
            m._fp8_filled = None


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
    with no record yet, from x's own amax); records x's amax when `record` and the state
    records. On the CPU path xᵀ is the codes transposed (the same bytes)."""
    hist = state.history[ROW[row]]
    first = not state.filled[ROW[row]]
    record = record and state.record
    if _fused(x):
        source = fp8_cast.fp8_amax_partials(x) if first else hist
        codes, codes_t, scale, amax = fp8_cast.fp8_cast_delayed(x, source, fmt.name, want,
                                                                want_t)
        if record:
            fp8_cast.fp8_history_push(hist, amax)
        q = FP8Tensor(codes, scale, "tensorwise", fmt) if want else None
        qt = FP8Tensor(codes_t, scale, "tensorwise", fmt) if want_t else None
    else:
        own = group_amax(x, "tensorwise").float().nan_to_num(nan=float("inf"))
        q = _cpu_cast(x, own if first else hist.max(), fmt)
        if record:
            hist.copy_(torch.cat([own.reshape(1), hist[:-1]]))
        qt = q.t() if want_t else None
        q = q if want else None
    if record:
        state.filled[ROW[row]] = True
    return q, qt


def input_pair(x2: torch.Tensor, state: DelayedState) -> tuple[FP8Tensor, FP8Tensor]:
    """(x for the forward, the copy saved for the weight gradient): on the GPU path xᵀ's
    codes written by the same pass, on the CPU path x's codes (transposed in backward)."""
    xq, xt = cast(x2, state, "input", E4M3, True, _fused(x2))
    return xq, (xt if xt is not None else xq)


def weight(w: torch.Tensor, state: DelayedState, transposed: bool = False) -> FP8Tensor:
    """W (forward: cast and recorded) or Wᵀ (backward: from the row after that record)."""
    q, qt = cast(w, state, "weight", E4M3, not transposed, transposed,
                 record=not transposed)
    return qt if transposed else q


def grad_pair(g2: torch.Tensor, state: DelayedState, fmt: FloatFormat
              ) -> tuple[FP8Tensor, FP8Tensor]:
    """(∂y for the input gradient, ∂yᵀ for the weight gradient), one cast and record."""
    gq, gt = cast(g2, state, "grad", fmt, True, True)
    return gq, gt
