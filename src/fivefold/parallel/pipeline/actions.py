"""The vocabulary of pipeline schedules: actions, the Schedule that holds every rank's
list of them, and where each stage lives. See schedules.py for the meaning of each kind and the
execution contract. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_KINDS = (FORWARD, BACKWARD, WEIGHT)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        text = f"{self.kind}{self.microbatch}.{self.chunk}"
        return text if self.peer is None else f"{text}@{self.peer}"


# Computes run back to back with no communication between them (see `_with_communication`).
Group = Action | tuple[Action, ...]


@dataclass
class Schedule:
    name: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    actions: list[list[Action]]
    split_backward: bool = False
    layout: str = "loop"

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stage_of(self, rank: int, chunk: int) -> int:
        return _stage_of(self.layout, self.pp, rank, chunk)

    def rank_of(self, stage: int) -> int:
        return _rank_and_chunk(self.layout, self.pp, stage)[0]

    def chunk_of(self, stage: int) -> int:
        return _rank_and_chunk(self.layout, self.pp, stage)[1]

    def compute_actions(self, rank: int) -> list[Action]:
        return [action for action in self.actions[rank] if not action.is_comm]

    def steps(self, rank: int) -> list[Action | tuple[Action, ...]]:
        """The rank's list as the executor runs it: a compute Action or a batch (tuple)."""
        steps: list[Action | tuple[Action, ...]] = []
        batch: list[Action] = []
        for action in self.actions[rank]:
            if action.is_comm:
                batch.append(action)
                continue
            if batch:
                steps.append(tuple(batch))
                batch = []
            steps.append(action)
        if batch:
            steps.append(tuple(batch))
        return steps


def _stage_of(layout: str, pp: int, rank: int, chunk: int) -> int:
    if layout == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def _rank_and_chunk(layout: str, pp: int, stage: int) -> tuple[int, int]:
    if layout == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp

