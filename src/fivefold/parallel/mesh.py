"""The topology: one object that owns the rank grid and every process group.

Global ranks are laid out as `arange(world).view(pp, dp, cp, tp)`: tp varies fastest so a
tensor-parallel group sits inside one node, then cp, then dp, and pp outermost (the order
Megatron-LM uses, with pipeline stages across nodes). Every group is a slice of this grid:

    tp     ranks differing only in their tp coordinate
    cp     ... only in cp;     dp ... only in dp;     pp ... only in pp
    dp_cp  ranks differing in dp or cp: they hold the same weights, so gradients are
           reduced (and ZeRO shards) over this group
    ep     within dp_cp, consecutive blocks of ep ranks that split the experts
    edp    within dp_cp, ranks holding the same experts (stride ep)
    stage  ranks differing in dp, cp or tp: one pipeline stage's ranks, which hold the same
           layers (delayed FP8 scaling reduces its amax records over it, lowp/delayed.py);
           without pp the world, whose process group it shares

It is built once, from the `[parallel]` config, and passed explicitly; there is no global.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fivefold.parallel.comm import Group, Ledger

AXES = ("pp", "dp", "cp", "tp")


@dataclass
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    rank: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    groups: dict[str, Group] = field(default_factory=dict)
    # Collectives of every sub-group time out with the world's (parallel.timeout_s); left
    # None, torch's default for new groups applies (30 minutes for gloo).
    timeout_s: float | None = None

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(self.pp, self.dp, self.cp, self.tp)

    def coords(self, rank: int | None = None) -> dict[str, int]:
        r = self.rank if rank is None else rank
        idx = (self.grid() == r).nonzero()[0].tolist()
        return dict(zip(AXES, idx))

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coords()["cp"]

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def _slices(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, as lists of global ranks (the same on every rank)."""
        g = self.grid()
        out: dict[str, list[list[int]]] = {}
        for axis_index, axis in enumerate(AXES):
            moved = g.movedim(axis_index, -1).reshape(-1, g.shape[axis_index])
            out[axis] = [row.tolist() for row in moved]
        dp_cp = g.permute(0, 3, 1, 2).reshape(-1, self.dp * self.cp)
        out["dp_cp"] = [row.tolist() for row in dp_cp]
        ep_rows, edp_rows = [], []
        for row in dp_cp.tolist():
            blocks = torch.tensor(row).view(-1, self.ep)
            ep_rows += [b.tolist() for b in blocks]
            edp_rows += [b.tolist() for b in blocks.t()]
        out["ep"], out["edp"] = ep_rows, edp_rows
        out["stage"] = [row.tolist() for row in g.reshape(self.pp, -1)]
        return out

    def build_groups(self) -> None:
        """Create every process group. All ranks must call this, in the same order."""
        distributed = dist.is_available() and dist.is_initialized()
        for name, rows in self._slices().items():
            if name == "stage" and self.pp == 1:
                continue  # the world's ranks: its group, below
            for ranks in rows:
                timeout = timedelta(seconds=self.timeout_s) if self.timeout_s else None
                pg = (dist.new_group(ranks, timeout=timeout)
                      if distributed and len(ranks) > 1 else None)
                if self.rank in ranks:
                    self.groups[name] = Group(name, ranks, pg, self.ledger)
        self.groups["world"] = Group(
            "world", list(range(self.world_size)),
            dist.group.WORLD if distributed and self.world_size > 1 else None, self.ledger)
        if self.pp == 1:  # no second communicator over the same ranks
            world = self.groups["world"]
            self.groups["stage"] = Group("stage", world.ranks, world.pg, self.ledger)

    @classmethod
    def single(cls) -> ParallelDims:
        """The one-process topology: every group has one member and moves nothing."""
        dims = cls()
        dims.build_groups()
        return dims

    @classmethod
    def from_config(cls, par, rank: int | None = None) -> ParallelDims:
        """Build from a `[parallel]` section inside an initialised process group."""
        if dist.is_initialized():
            if dist.get_world_size() != par.world_size:
                raise RuntimeError(
                    f"launched {dist.get_world_size()} processes but parallel.dp·tp·pp·cp = "
                    f"{par.world_size}; launch that many or change the layout")
            rank = dist.get_rank()
        dims = cls(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, rank=rank or 0,
                   timeout_s=par.timeout_s)
        if (dims.dp * dims.cp) % dims.ep:
            raise ValueError(f"parallel.ep = {dims.ep} must divide dp·cp = {dims.dp * dims.cp}")
        dims.build_groups()
        return dims


def init_distributed(backend: str = "auto", timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group described by torchrun's environment (env:// rendezvous).

    Returns (rank, world_size); (0, 1) without a launcher. gloo on CPU, NCCL on CUDA.
    """
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
