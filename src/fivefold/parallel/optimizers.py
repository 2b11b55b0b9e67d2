"""`train.optimizer` to an optimizer over the owner's pieces (see optim_base.py).

AdamW is torch's own (update.adamw: fused or foreach), its states the flat buffers the
owners already keep; the others are fivefold's (adamw_lowbit.py, adafactor.py, muon.py),
each keeping its states per piece. Every one is stepped by `update.clipped_step`.
"""

from __future__ import annotations

import torch

from fivefold.errors import ConfigError
from fivefold.numerics.optim_states import block_size
from fivefold.parallel.optim_base import Assembler, PieceInfo, PieceOptimizer


def layout_alignment(optimizer: str) -> int:
    """Flat-layout alignment, in values, that keeps every ZeRO shard boundary on a
    quantisation block boundary (1: none needed)."""
    return {"adamw8bit": block_size(8), "adamw4bit": block_size(4)}.get(optimizer, 1)


def check_muon_matrices(named_params, oc) -> None:
    from fivefold.parallel.muon import takes

    if not any(takes(n, p, oc.muon_exclude) for n, p in named_params):
        raise ConfigError(f"train.optimizer = muon finds no matrix it can take (2-D weights "
                          f"whose names hold none of optim.muon_exclude = "
                          f"'{oc.muon_exclude}'); narrow muon_exclude or use adamw")


def build_piece_optimizer(name: str, masters: list[torch.Tensor], infos: list[PieceInfo],
                          tr, oc, assembler: Assembler | None = None) -> PieceOptimizer:
    if name in ("adamw8bit", "adamw4bit"):
        from fivefold.parallel.adamw_lowbit import AdamWLowBit

        return AdamWLowBit(masters, infos, tr, 8 if name == "adamw8bit" else 4, assembler)
    if name == "adafactor":
        from fivefold.parallel.adafactor import Adafactor

        return Adafactor(masters, infos, tr, oc, assembler)
    if name == "muon":
        from fivefold.parallel.muon import Muon

        return Muon(masters, infos, tr, oc, assembler)
    raise ConfigError(f"train.optimizer = '{name}' has no update rule here")
