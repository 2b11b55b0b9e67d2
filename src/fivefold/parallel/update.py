"""The update every optimizer of fivefold shares, whatever the layout.

Which weights decay, how much of a gradient's squared norm this rank contributes, the
AdamW constructor (fused on CUDA, foreach elsewhere) and `clipped_step`: unscale, exact
global norm, skip on overflow, clip, step. `train/optim.py` (one replica) and `zero.py`
(DP and ZeRO) build on it, so a layout changes where states live, never the update.
"""

from __future__ import annotations

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


class StepStats:
    """What a step reports. The step keeps its values where it made them (0-d tensors on
    the device, or numbers where the host decided): `grad_norm` (NaN for a skipped step),
    `skipped` and `loss_scale` read them as numbers, a wait for the device when they are
    tensors; `values()` hands them over unread (train/step_metrics.py reads them later)."""

    def __init__(self, grad_norm, skipped, loss_scale):
        self.norm, self.found, self.scale = grad_norm, skipped, loss_scale

    @property
    def skipped(self) -> bool:
        return bool(self.found)

    @property
    def grad_norm(self) -> float:
        return float("nan") if self.skipped else float(self.norm)

    @property
    def loss_scale(self) -> float:
        return float(self.scale)

    def values(self) -> tuple:
        """(norm, skipped, loss scale) as the step made them: tensors or numbers."""
        return self.norm, self.found, self.scale


def skips_on_device(optimizer, device: torch.device) -> bool:
    """torch's fused AdamW takes the overflow flag itself (`found_inf`, as torch's
    GradScaler hands it): with 1.0 its kernel leaves weights, moments and step counts as
    they were, so the step needs no host decision. Only where its states live on the
    flag's `device` (offloaded states on the host would read a flag still in flight).
    fivefold's own rules that select their new values against the old by the flag
    (optim_base.PieceOptimizer.skips_on_device: AdamW 8-bit and 4-bit, Muon over a fused
    AdamW) take it too. Others (Adafactor, foreach AdamW, NVMe) are skipped by the host."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return False
    on_device = all(p.device == device for g in optimizer.param_groups for p in g["params"])
    if hasattr(optimizer, "grads"):
        check = getattr(optimizer, "skips_on_device", None)
        return on_device and check is not None and check()
    return on_device and all(g.get("fused") for g in optimizer.param_groups)


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
    the same step (under fp16 the loss scale also halves).

    Nothing here waits for the device when every optimizer `skips_on_device`: the overflow
    flag, the loss scale's update and the clipping coefficient stay 0-d tensors, and the
    fused AdamW kernel reads the flag. Otherwise the flag is read once, here, to skip."""
    grads = [g for _, g in updates]
    if scaler.enabled:
        for g in grads:
            g.scale_(scaler.inverse())
    norm = global_norm(grads, loss)
    found_inf = (~torch.isfinite(norm)).float()
    if scaler.enabled:  # every rank skips together, or none does
        found_inf = found_inf.reshape(1)
        comm.all_reduce(found_inf, world, op="max")
        found_inf = found_inf.reshape(())
    scale = scaler.scale_value()
    on_device = all(skips_on_device(opt, found_inf.device) for opt, _ in updates)
    if not on_device:
        found_inf = bool(found_inf)  # the host decides: one wait for the device
    scaler.update(found_inf)
    if found_inf is True:
        return StepStats(float("nan"), True, scale)
    if tr.grad_clip > 0 and any(len(g) for g in grads):
        coef = torch.clamp(tr.grad_clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.scale_(coef)
    for optimizer, g in updates:
        for group in optimizer.param_groups:
            group["lr"] = lr
        if on_device:
            optimizer.found_inf = found_inf
        try:
            run_update(optimizer, g)
        finally:
            if on_device:
                del optimizer.found_inf
    return StepStats(norm, found_inf, scale)


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
                      shares: torch.Tensor | list[float], device: torch.device,
                      offsets: list[int] | None = None) -> torch.Tensor:
    """Σ share·‖g‖² over this rank's fp32 gradients (`StepGrads`, or a list of them), as a
    0-d float64 tensor on `device`: the owners reduce it over ranks in float64 and round it
    to fp32 once, after the last reduction (`finish_norm`).

    Why float64 throughout: the layout must not move the norm. A rank's partial sum rounded
    to fp32 before its all-reduce (as before) gave dp2 ZeRO-0 and ZeRO-3 different norms at
    step 1 (1.6340306997 against 1.6340308189 with adamw8bit) and, clipping being on by
    default, different weights. In float64 the partial sums of two layouts differ only by
    the order of their additions (relative error below n·2^-53 for n terms added, against
    fp32's rounding step of 2^-24), so the fp32 norm they round to is the same unless the
    exact value lies within ~1e-15 of an fp32 rounding boundary.

    `offsets[i]`: where piece i starts in its flattened parameter (a ZeRO shard's `lo`;
    default 0, a whole tensor). On a CPU every square is accumulated in float64 (torch's
    fp32 norm kernels there sum in fp32: over a 25M-element model the norm came out about
    5e-6 relative off) over ranges of `NORM_PIECE` values cut at multiples of NORM_PIECE of
    the *parameter*, not of the piece: wherever a shard boundary falls, every range but the
    one it cuts is summed as in any other layout. A range is cast to float64 alone (a whole
    16M-value embedding gradient cast at once is a fresh 128 MiB buffer, page faults
    included, 4× the time of the norm itself on one core; a range stays in cache); a
    gradient kept in the compute dtype is cast to fp32 a range at a time too.
    On a GPU one fused `_foreach_norm` in float64 (each tensor reduced on its own) per chunk
    of pieces keeps the step fast; the chunks change no bit. It reads the compute-dtype
    gradients themselves when no factor is pending (bf16; `StepGrads.exact_sources`).
    Nothing here waits for the device: `shares` on the device stay there (the owners put
    them there once).
    """
    if isinstance(grads, list):
        grads = StepGrads(grads, grads[0].device if grads else device, copy=False)
    if not len(grads):
        return torch.zeros((), dtype=torch.float64, device=device)
    shares = torch.as_tensor(shares, dtype=torch.float64)
    offsets = offsets or [0] * len(grads)
    if grads.device.type == "cpu":
        squares = []
        for i in range(len(grads)):
            total = torch.zeros((), dtype=torch.float64)
            numel, start = grads.numel(i), offsets[i]
            lo = 0
            while lo < numel:  # ranges end at multiples of NORM_PIECE of the parameter
                hi = min(numel, (start + lo) // NORM_PIECE * NORM_PIECE + NORM_PIECE - start)
                piece = grads.make([i], lo, hi, sample=False)[0]
                total = total + torch.linalg.vector_norm(piece, dtype=torch.float64).square()
                del piece  # before the next range is made
                lo = hi
            squares.append(total)
        return (torch.stack(squares) * shares.to(torch.device("cpu"))).sum().to(device)
    return foreach_squares(grads, shares).to(device)


def foreach_squares(grads: StepGrads, shares: torch.Tensor) -> torch.Tensor:
    """Σ share·‖g‖² by fused float64 `_foreach_norm`s, a chunk of pieces at a time (a GPU's
    way): over the compute-dtype gradients themselves where no factor is pending (the same
    values, widened exactly, without an fp32 copy to write and read back), else their
    fp32 copies."""
    norms = []
    for chunk in grads.chunks():
        pieces = grads.exact_sources(chunk) or grads.make(chunk)
        norms += torch._foreach_norm(pieces, 2, dtype=torch.float64)
    norms = torch.stack(norms)
    return (norms.pow(2) * shares.to(norms.device)).sum()


def finish_norm(sq: torch.Tensor) -> torch.Tensor:
    """The global norm from the reduced float64 sum of squares: rounded to fp32 once, then
    its square root (fp32, as the clipping coefficient and the logs take it)."""
    return sq.float().sqrt()
