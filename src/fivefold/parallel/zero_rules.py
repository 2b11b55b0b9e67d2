"""fivefold's own optimizers (optim_base.py) on the data-parallel optimizer's flat shards.

`zero.DataParallelOptimizer` keeps AdamW's moments in two flat buffers; the other rules keep
their states per piece, so for them it delegates here: building the rule over its master
pieces, the assembler that gathers whole logical tensors (one all-gather over the ZeRO
group of the flat shard, then tensor-parallel slices), and the checkpoint and accounting
views. With quantised states the flat layout is aligned to the quantisation block
(`FlatLayout(align=…)`), so every piece holds whole blocks.
"""

from __future__ import annotations

import torch

from fivefold.parallel.optim_base import PieceInfo, made
from fivefold.parallel.shards import full_tensor, local_piece
from fivefold.parallel.update import decays


class ZeroAssembler:
    """Whole logical tensors from this rank's pieces: the flat shard all-gathered over the
    group (every rank calls it: it is a collective), then gathered over tp."""

    def __init__(self, owner):
        self.owner = owner

    def full(self, values: dict[int, torch.Tensor], infos) -> dict[int, torch.Tensor]:
        owner = self.owner
        layout = owner.layout
        shard = torch.zeros(layout.total // layout.shards, dtype=torch.float32,
                            device=owner.state_device)
        for i, v in values.items():
            pc = owner.pieces[i]
            shard[pc.shard:pc.shard + pc.hi - pc.lo] = made(v)  # a made one dropped now
        flat = owner._full_flat(shard)
        out = {}
        for i in values:  # the same pieces on every tp peer: the tp gathers pair up
            slot = layout.params[owner.pieces[i].slot]
            out[i] = full_tensor(slot.param, layout.view(flat, owner.pieces[i].slot),
                                 owner.dims)
        return out

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
