"""The update every optimizer of fivefold shares, whatever the layout.

Which weights decay, how much of a gradient's squared norm this rank contributes, the
AdamW constructor (fused on CUDA, foreach elsewhere) and `clipped_step`: unscale, exact
global norm, skip on overflow, clip, step. `train/optim.py` (one replica) and `zero.py`
(DP and ZeRO) build on it, so a layout changes where states live, never the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.parallel import comm
from fivefold.parallel.step_grads import StepGrads, run_update


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices, not to norm weights or biases."""
    return param.ndim >= 2 and "norm" not in name


def norm_share(param: torch.Tensor, tp_size: int) -> float:
    """The share of this parameter's squared gradient norm that this rank contributes.

    Tensor-parallel shards (`_tp_sharded`) are disjoint pieces: each counts fully. A tensor
    replicated on r ranks (norm weights on every tp rank, a key/value head shared by
    `_tp_replicas` ranks, an embedding tied across pipeline stages) counts 1/r on each, so the
    sum over ranks counts it once. Dividing by a power of two is exact in floating point.
    """
    replicas = getattr(param, "_tp_replicas", None)
    if replicas is None:
        replicas = 1 if getattr(param, "_tp_sharded", False) else tp_size
    return 1.0 / (replicas * getattr(param, "_pp_replicas", 1))


@dataclass
class StepStats:
    grad_norm: float
    skipped: bool
    loss_scale: float


def clipped_step(updates: list[tuple], lr: float, tr, scaler, world: comm.Group,
                 global_norm, loss: torch.Tensor | None = None) -> StepStats:
    """The update every optimizer here shares, on the gradients its owner holds (full or
    sharded): unscale (fp16), the exact global norm (`global_norm(grads, loss)`), skip the
    step when a rank saw inf/nan, clip, set the rate, step. `updates` pairs each optimizer
    with its `StepGrads` (one pair; two under expert parallelism, one clipping norm): the
    fp32 gradients are made a piece at a time where they are used (step_grads.py).

    A non-finite loss or gradient on any rank is found without a collective of its own:
    `global_norm` sums this rank's squares plus `0 · loss` (NaN when the loss is not finite)
    in the reduction it already does, so every rank sees the same non-finite norm and skips
    the same step (under fp16 the loss scale also halves)."""
    grads = [g for _, g in updates]
    if scaler.enabled:
        for g in grads:
            g.scale_(1.0 / scaler.scale)
    norm = global_norm(grads, loss)
    found_inf = not bool(torch.isfinite(norm))
    if scaler.enabled:  # every rank skips together, or none does
        flag = torch.tensor([float(found_inf)], device=norm.device)
        comm.all_reduce(flag, world, op="max")
        found_inf = bool(flag.item())
    scale = scaler.scale
    scaler.update(found_inf)
    if found_inf:
        return StepStats(float("nan"), True, scale)
    if tr.grad_clip > 0 and any(len(g) for g in grads):
        coef = torch.clamp(tr.grad_clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.scale_(coef)
    for optimizer, g in updates:
        for group in optimizer.param_groups:
            group["lr"] = lr
        run_update(optimizer, g)
    return StepStats(float(norm), False, scale)


def probe_term(loss: torch.Tensor | None, device: torch.device) -> torch.Tensor | float:
    """0 for a finite loss, NaN otherwise: added to the squared norm before its reduction."""
    return 0.0 if loss is None else (loss.detach().float() * 0.0).to(device)


def adamw(groups, tr, device: torch.device) -> torch.optim.AdamW:
    """Fused AdamW (one kernel over all tensors) on CUDA and on CPU, where torch >= 2.4 has
    it (6x faster than foreach on a 21M-parameter CPU step here); foreach elsewhere."""
    fused = device.type == "cuda" or (device.type == "cpu" and FUSED_ADAMW_ON_CPU)
    kwargs = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps, **kwargs)


FUSED_ADAMW_ON_CPU = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4)


NORM_PIECE = 1 << 18  # values per float64 cast in `squared_grad_norm` on a CPU (2 MiB)


def squared_grad_norm(grads: StepGrads | list[torch.Tensor],
                      shares: torch.Tensor | list[float], device: torch.device) -> torch.Tensor:
    """Σ share·‖g‖² over this rank's fp32 gradients (`StepGrads`, or a list of them), as a
    0-d tensor on `device`.

    On a CPU every square is accumulated in float64 (torch's fp32 norm kernels there sum in
    fp32: over a 25M-element model the norm came out about 5e-6 relative off, which moves the
    clipping coefficient by as much) and the total is rounded once to fp32 (3e-8 relative on
    the norm), the dtype the reductions over ranks carry and the planner's ledger counts.
    The float64 copy is made a piece of `NORM_PIECE` values at a time: a whole 16M-value
    embedding gradient cast at once is a fresh 128 MiB buffer (page faults included, 4× the
    time of the norm itself on one core), a piece stays in cache; a gradient kept in the
    compute dtype is cast to fp32 a piece at a time too.
    On CUDA one fused fp32 `_foreach_norm` (tree reductions) per chunk of pieces keeps the
    step fast; it reduces each tensor on its own, so the chunks change no bit.
    """
    if isinstance(grads, list):
        grads = StepGrads(grads, grads[0].device if grads else device, copy=False)
    if not len(grads):
        return torch.zeros((), dtype=torch.float32, device=device)
    shares = torch.as_tensor(shares, dtype=torch.float64)
    if grads.device.type == "cpu":
        squares = []
        for i in range(len(grads)):
            total = torch.zeros((), dtype=torch.float64)
            numel = grads.numel(i)
            for lo in range(0, numel, NORM_PIECE):
                piece = grads.make([i], lo, min(lo + NORM_PIECE, numel), sample=False)[0]
                total = total + torch.linalg.vector_norm(piece, dtype=torch.float64).square()
                del piece  # before the next range is made
            squares.append(total)
        return (torch.stack(squares) * shares).sum().float().to(device)
    norms = []
    for chunk in grads.chunks():
        norms += torch._foreach_norm(grads.make(chunk))
    norms = torch.stack(norms).float()
    return (norms.pow(2) * shares.to(norms)).sum().to(device)
