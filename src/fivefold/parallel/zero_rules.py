"""fivefold's own optimizers (optim_base.py) on the data-parallel optimizer's flat shards.

`zero.DataParallelOptimizer` keeps AdamW's moments in two flat buffers; the other rules keep
their states per piece, so for them it delegates here: building the rule over its master
pieces, the assembler that gathers whole logical tensors one at a time (over the ZeRO
group, then tensor-parallel slices), and the checkpoint and accounting views. With
quantised states the flat layout is aligned to the quantisation block (`FlatLayout(align=…)`),
so every piece holds whole blocks.
"""

from __future__ import annotations

import math

import torch

from fivefold.parallel import comm, peak
from fivefold.parallel.optim_base import Assembler, PieceInfo, made
from fivefold.parallel.shards import full_tensor, local_piece
from fivefold.parallel.update import decays

# Gather the whole flat shard at once, as before matrix-at-a-time gathering (a full fp32 copy
# of the model on every rank): kept for bench/train/optimizer_gather.py's "before" and the
# bit-equality test, not a setting.
WHOLE_MODEL_GATHER = False


class ZeroAssembler(Assembler):
    """Whole logical tensors from this rank's pieces, one parameter at a time: every rank of
    the ZeRO group walks the layout's wanted parameters in layout order (each is a
    collective), gathers one into a buffer of its local size (each owner of a part
    broadcasts it: the parts are uneven, so not one all-gather), then over tp, hands it to
    the rule and frees it before the next: Moonlight's distributed Muon (Liu et al. 2025,
    arXiv 2502.16982, §2.3) does the same per matrix. A rank holds one gathered parameter at
    a time (`live`, sampled by the peak tracker), not a copy of the model, and the next one's
    broadcasts, when both fit in the largest one's bytes: they are in flight while the rule
    works on this one, and the most held at once stays the largest wanted tensor
    (plan/optimizer.py `gathered_bytes`)."""

    def __init__(self, owner):
        self.owner = owner
        self.live: list[torch.Tensor] = []

    def each(self, values, infos, wanted=None):
        owner = self.owner
        layout = owner.layout
        if WHOLE_MODEL_GATHER:
            yield from self._whole_model(values)
            return
        if layout.shards == 1:  # each piece is the whole local tensor: nothing moves
            for i, v in values.items():
                slot = layout.params[owner.pieces[i].slot]
                # the same pieces on every tp peer: the tp gathers pair up
                whole = full_tensor(slot.param, made(v).view(slot.shape), owner.dims)
                if whole.shape != slot.shape:  # gathered over tp
                    self.live = [whole]
                    peak.sample("optimizer gather")
                yield i, whole
                del whole
                self.live = []
            return
        by_slot = {owner.pieces[i].slot: i for i in values}
        slots = [s for s, slot in enumerate(layout.params)
                 if wanted is None or wanted(slot.name, slot.param)]
        budget = max((self._bytes(s) for s in slots), default=0)  # the same on every rank
        ahead = None
        for k, s in enumerate(slots):
            slot = layout.params[s]
            local, handles = ahead or self._launch(s, values, by_slot)
            for h in handles:
                owner.watchdog.wait(h, "optimizer parameter gather")
            i = by_slot.get(s)
            # a rank holding no part of it drops it here; the tp peers hold the same pieces
            whole = full_tensor(slot.param, local.view(slot.shape), owner.dims) if (
                i is not None) else local
            del local
            ahead = None
            if k + 1 < len(slots) and self._bytes(s) + self._bytes(slots[k + 1]) <= budget:
                ahead = self._launch(slots[k + 1], values, by_slot)  # in flight meanwhile
            self.live = [whole, *(ahead[:1] if ahead else [])]
            peak.sample("optimizer gather")
            if i is not None:
                yield i, whole
            del whole
            self.live = []

    def _bytes(self, s: int) -> int:
        """What parameter `s` gathered whole takes (fp32; its logical size if tp slices it)."""
        param = self.owner.layout.params[s].param
        return 4 * math.prod(getattr(param, "_full_shape", param.shape)) if getattr(
            param, "_tp_slice", None) is not None else 4 * param.numel()

    def _launch(self, s: int, values: dict, by_slot: dict) -> tuple[torch.Tensor, list]:
        """Parameter `s` (its local tensor, flat fp32) from the parts its owners hold: the
        buffer and the broadcasts filling it, in flight."""
        owner, layout = self.owner, self.owner.layout
        slot = layout.params[s]
        seg = layout.segments[slot.segment]
        i = by_slot.get(s)
        full = torch.empty(slot.numel, dtype=torch.float32, device=owner.device)
        handles = []
        for r in range(layout.shards):
            lo, hi = seg.owned(r, layout.shards)
            a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if a >= b:
                continue
            part = full[a - slot.start:b - slot.start]
            if r == owner.rank:
                if i is None:  # `wanted` and the rule's pieces must agree on every rank
                    raise RuntimeError(f"internal: {slot.name} is gathered but its piece on "
                                       f"this rank was not passed")
                part.copy_(made(values[i]))  # a made one dropped now
            handles.append(comm.broadcast(part, r, owner.group, async_op=True))
        return full, handles

    def _whole_model(self, values):
        owner = self.owner
        layout = owner.layout
        shard = torch.zeros(layout.total // layout.shards, dtype=torch.float32,
                            device=owner.state_device)
        for i, v in values.items():
            pc = owner.pieces[i]
            shard[pc.shard:pc.shard + pc.hi - pc.lo] = made(v)
        flat = owner._full_flat(shard)
        self.live = [flat]
        peak.sample("optimizer gather")
        for i in values:
            slot = layout.params[owner.pieces[i].slot]
            yield i, full_tensor(slot.param, layout.view(flat, owner.pieces[i].slot),
                                 owner.dims)
        self.live = []

    def own(self, info: PieceInfo, full: torch.Tensor) -> torch.Tensor:
        return local_piece(info.param, full).reshape(-1)[info.lo:info.hi]


def build_rule(owner, optim):
    """The rule `owner.tr.optimizer` over `owner.master_pieces`."""
    from fivefold.config.optim import OptimSection
    from fivefold.parallel.optimizers import build_piece_optimizer, check_muon_matrices

    optim = optim or OptimSection()
    slots = owner.layout.params
    if owner.tr.optimizer == "muon":
        check_muon_matrices([(s.name, s.param) for s in slots], optim)
    infos = [PieceInfo(k, slots[pc.slot].name, slots[pc.slot].param, pc.lo, pc.hi,
                       decays(slots[pc.slot].name, slots[pc.slot].param))
             for k, pc in enumerate(owner.pieces)]
    return build_piece_optimizer(owner.tr.optimizer, owner.master_pieces, infos, owner.tr,
                                 optim, ZeroAssembler(owner))


def shard_views(owner, load: bool, convert_from: str | None) -> list[tuple]:
    """`DataParallelOptimizer.shard_states` for a rule of its own."""
    params = owner.gatherer.shard if owner.gatherer is not None else owner.param_flat
    out = []
    for pc, master in zip(owner.pieces, owner.master_pieces):
        n = pc.hi - pc.lo
        at = pc.shard if owner.gatherer is not None else pc.flat
        views = {"param": params[at:at + n], "master": master.view(-1)}
        if load and not owner.separate_master:
            del views["param"]
        views.update(owner.optimizer.checkpoint_views(master, load, convert_from))
        slot = owner.layout.params[pc.slot]
        out.append((slot.name, slot.param, pc.lo, pc.hi, views))
    return out


def gathered_states(owner) -> dict[str, torch.Tensor]:
    """Each elementwise state (as fp32, dequantised) in a full flat buffer of the layout,
    gathered onto every rank (tests and comparisons only)."""
    out = {}
    for key in owner.optimizer.SHAPED_KEYS:  # the same on every rank: collectives pair up
        shard = torch.zeros(owner.layout.total // owner.layout.shards,
                            device=owner.state_device)
        for pc, m in zip(owner.pieces, owner.master_pieces):
            value = owner.optimizer.shaped_states(m).get(key)
            if value is not None:
                shard[pc.shard:pc.shard + pc.hi - pc.lo] = value.reshape(-1)
        out[key] = owner._full_flat(shard)
    return out
