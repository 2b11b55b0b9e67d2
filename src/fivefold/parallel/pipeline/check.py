"""Check and simulate a pipeline schedule: dependencies, matching, deadlock, bubble, memory.

`validate(schedule)` walks every rank's list once and proves, without timing:
  - each stage does F, B (and W when the backward is split) for every micro-batch exactly once;
  - F of stage s comes after its input is here (F of stage s-1 on this rank, or its RECV_F);
    B of stage s after its own F and after the gradient of stage s+1 (B there, or RECV_B);
    W after its own B; a SEND after the compute that made its tensor;
  - every SEND has exactly one RECV: between each ordered pair of ranks the k-th send and the
    k-th receive agree on direction, micro-batch and stage (the contract in `schedules`).
`simulate(schedule, costs)` then replays the lists in time under the contract's batch rule
(a batch completes only once every op in it has its counterpart posted, plus `latency`),
reports a deadlock as the cycle of ranks that wait on each other, and measures:
  - makespan; bubble per rank = idle / makespan; overall bubble = total idle / (pp*makespan);
  - peak in-flight micro-batches per rank: the most (micro-batch, chunk) pairs whose F has
    run and whose activations are not yet freed. Activations are freed by the full B, or,
    when the backward is split, by W: B frees the input-gradient half, but W still needs
    the layer inputs, so a ZB micro-batch counts as stored until its W ("stored until W").
    The unit is one chunk's activations for one micro-batch: divide by virtual_stages for
    whole-rank micro-batches.
No torch here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fivefold.parallel.pipeline.schedules import (
    BACKWARD,
    COMM_KINDS,
    COMPUTE_KINDS,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WEIGHT,
    Action,
    Schedule,
)


class ScheduleError(ValueError):
    """A schedule breaks a dependency, a matching rule or deadlocks."""


@dataclass(frozen=True)
class Costs:
    """Time of one micro-batch through *all* of a rank's layers; a chunk costs 1/v of it.

    With an unsplit backward, B costs backward_input + backward_weight, so schedules with
    and without the B/W split are compared on the same total work.
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0  # per batch of point-to-point ops, after both sides have posted

    def of(self, schedule: Schedule, action: Action) -> float:
        if action.kind == FORWARD:
            cost = self.forward
        elif action.kind == WEIGHT:
            cost = self.backward_weight
        elif schedule.split_backward:
            cost = self.backward_input
        else:
            cost = self.backward_input + self.backward_weight
        return cost / schedule.virtual_stages


@dataclass(frozen=True)
class TimedAction:
    action: Action | None  # None for a communication batch
    rank: int
    start: float
    end: float
    batch: tuple[Action, ...] = ()


@dataclass
class Simulation:
    schedule: Schedule
    costs: Costs
    timeline: list[list[TimedAction]]  # per rank, in order: compute and comm batches
    makespan: float
    busy: list[float]
    bubble_per_rank: list[float]
    bubble: float
    peak_inflight: list[int]  # stored until W (split) or B (unsplit)
    peak_inflight_until_b: list[int]  # input activations only: freed by B


def _peer_stage(schedule: Schedule, rank: int, action: Action) -> int:
    """The stage on the other end of a communication action."""
    stage = schedule.stage_of(rank, action.chunk)
    return stage + 1 if action.kind in (SEND_F, RECV_B) else stage - 1


def _where(rank: int, action: Action) -> str:
    return f"rank {rank}: {action}"


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first broken rule; see the module docstring."""
    pp, m, v = schedule.pp, schedule.num_microbatches, schedule.virtual_stages
    last_stage = schedule.num_stages - 1
    if len(schedule.actions) != pp:
        raise ScheduleError(f"{len(schedule.actions)} action lists for pp={pp}")
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, stage) on the owning rank
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            where = _where(rank, action)
            if action.kind not in COMPUTE_KINDS + COMM_KINDS:
                raise ScheduleError(f"{where}: unknown kind {action.kind!r}")
            if not (0 <= action.microbatch < m and 0 <= action.chunk < v):
                raise ScheduleError(f"{where}: micro-batch or chunk out of range (m={m}, v={v})")
            stage = schedule.stage_of(rank, action.chunk)
            key = (action.kind, action.microbatch, stage)
            if key in done:
                raise ScheduleError(f"{where}: done twice")

            def need(kind: str, need_stage: int, what: str, action=action, rank=rank) -> None:
                if (kind, action.microbatch, need_stage) not in done:
                    raise ScheduleError(f"{_where(rank, action)}: runs before {what}")

            if action.kind in COMM_KINDS:
                peer_stage = _peer_stage(schedule, rank, action)
                if not 0 <= peer_stage <= last_stage:
                    raise ScheduleError(f"{where}: no stage {peer_stage} to talk to")
                peer = schedule.rank_of(peer_stage)
                if action.peer != peer or peer == rank:
                    raise ScheduleError(f"{where}: stage {peer_stage} is on rank {peer}")
                if action.kind == SEND_F:
                    need(FORWARD, stage, "the forward that makes what it sends")
                elif action.kind == SEND_B:
                    need(BACKWARD, stage, "the backward that makes what it sends")
            elif action.peer is not None:
                raise ScheduleError(f"{where}: a compute action has no peer")
            elif action.kind == FORWARD and stage > 0:
                local = schedule.rank_of(stage - 1) == rank
                need(
                    FORWARD if local else RECV_F,
                    stage - 1 if local else stage,
                    f"its input arrives (F of stage {stage - 1})",
                )
            elif action.kind == BACKWARD:
                need(FORWARD, stage, "its own forward")
                if stage < last_stage:
                    local = schedule.rank_of(stage + 1) == rank
                    need(
                        BACKWARD if local else RECV_B,
                        stage + 1 if local else stage,
                        f"its output gradient arrives (B of stage {stage + 1})",
                    )
            elif action.kind == WEIGHT:
                if not schedule.split_backward:
                    raise ScheduleError(f"{where}: W in a schedule whose backward is not split")
                need(BACKWARD, stage, "its own B")
            done.add(key)
    kinds = [FORWARD, BACKWARD] + ([WEIGHT] if schedule.split_backward else [])
    for stage in range(schedule.num_stages):
        for kind in kinds:
            missing = [mb for mb in range(m) if (kind, mb, stage) not in done]
            if missing:
                raise ScheduleError(
                    f"rank {schedule.rank_of(stage)}: stage {stage} never runs {kind} for "
                    f"micro-batches {missing}"
                )
    _check_matching(schedule)


def _check_matching(schedule: Schedule) -> None:
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            direction = "F" if action.kind in (SEND_F, RECV_F) else "B"
            if action.kind in (SEND_F, SEND_B):
                # Name the receiving stage so both sides describe the same tensor.
                stage = _peer_stage(schedule, rank, action)
                sends[(rank, action.peer)].append((direction, action.microbatch, stage))
            elif action.kind in (RECV_F, RECV_B):
                stage = schedule.stage_of(rank, action.chunk)
                recvs[(action.peer, rank)].append((direction, action.microbatch, stage))
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        for index in range(max(len(sent), len(received))):
            one = sent[index] if index < len(sent) else None
            other = received[index] if index < len(received) else None
            if one != other:
                raise ScheduleError(
                    f"rank {pair[0]} -> rank {pair[1]}: send #{index} is {one} "
                    f"(direction, micro-batch, receiving stage) but receive #{index} is {other}"
                )


def _counterparts(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, index of a comm action) -> (peer, index of the op it pairs with)."""
    queues: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            if action.kind in (SEND_F, SEND_B):
                queues[("send", rank, action.peer)].append(index)
            elif action.kind in (RECV_F, RECV_B):
                queues[("recv", action.peer, rank)].append(index)
    pairs: dict[tuple[int, int], tuple[int, int]] = {}
    for (side, source, destination), indices in queues.items():
        if side != "send":
            continue
        for send_index, recv_index in zip(indices, queues[("recv", source, destination)]):
            pairs[(source, send_index)] = (destination, recv_index)
            pairs[(destination, recv_index)] = (source, send_index)
    return pairs


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Validate, then replay every rank's list in time; raise ScheduleError on deadlock."""
    costs = costs or Costs()
    validate(schedule)
    pp = schedule.pp
    counterpart = _counterparts(schedule)
    position, clock = [0] * pp, [0.0] * pp
    posted_at: dict[tuple[int, int], float] = {}  # (rank, index) of a posted comm op -> time
    open_batch: list[tuple[int, int] | None] = [None] * pp  # [start, end) indices
    timeline: list[list[TimedAction]] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule.actions):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if not action.is_comm:
                    end = clock[rank] + costs.of(schedule, action)
                    timeline[rank].append(TimedAction(action, rank, clock[rank], end))
                    clock[rank], position[rank], progress = end, position[rank] + 1, True
                    continue
                if open_batch[rank] is None:
                    start = end = position[rank]
                    while end < len(actions) and actions[end].is_comm:
                        posted_at[(rank, end)] = clock[rank]
                        end += 1
                    open_batch[rank], progress = (start, end), True
                start, end = open_batch[rank]
                others = [counterpart[(rank, index)] for index in range(start, end)]
                if not all(other in posted_at for other in others):
                    break  # wait: some peer has not reached the matching op yet
                done_at = max(
                    max(posted_at[(rank, index)], posted_at[other]) + costs.latency
                    for index, other in zip(range(start, end), others)
                )
                batch = tuple(actions[start:end])
                timeline[rank].append(TimedAction(None, rank, clock[rank], done_at, batch))
                clock[rank], position[rank], open_batch[rank] = done_at, end, None
                progress = True
    stuck = [rank for rank in range(pp) if position[rank] < len(schedule.actions[rank])]
    if stuck:
        raise ScheduleError(_describe_deadlock(schedule, stuck, open_batch, posted_at, counterpart))
    return _measure(schedule, costs, timeline)


def _describe_deadlock(schedule, stuck, open_batch, posted_at, counterpart) -> str:
    waits_on: dict[int, tuple[int, Action, Action]] = {}
    for rank in stuck:
        start, end = open_batch[rank]
        for index in range(start, end):
            peer, peer_index = counterpart[(rank, index)]
            if (peer, peer_index) not in posted_at:
                waits_on[rank] = (
                    peer,
                    schedule.actions[rank][index],
                    schedule.actions[peer][peer_index],
                )
                break
    rank, seen = stuck[0], []
    while rank not in seen:  # every stuck rank waits on another stuck rank: follow to a cycle
        seen.append(rank)
        rank = waits_on[rank][0]
    cycle = seen[seen.index(rank) :]
    links = [
        f"rank {r} is blocked on {waits_on[r][1]} until rank {waits_on[r][0]} posts "
        f"{waits_on[r][2]}"
        for r in cycle
    ]
    return f"deadlock in {schedule.name}: " + "; ".join(links)


def _inflight_peak(schedule: Schedule, rank: int, freed_by: str) -> int:
    stored = peak = 0
    for action in schedule.compute_actions(rank):
        if action.kind == FORWARD:
            stored += 1
        elif action.kind == freed_by:
            stored -= 1
        peak = max(peak, stored)
    return peak


def _measure(schedule: Schedule, costs: Costs, timeline: list[list[TimedAction]]) -> Simulation:
    makespan = max((row[-1].end for row in timeline if row), default=0.0)
    busy = [sum(t.end - t.start for t in row if t.action is not None) for row in timeline]
    bubble_per_rank = [(makespan - b) / makespan if makespan else 0.0 for b in busy]
    total = schedule.pp * makespan
    bubble = (total - sum(busy)) / total if total else 0.0
    release = WEIGHT if schedule.split_backward else BACKWARD
    return Simulation(
        schedule=schedule,
        costs=costs,
        timeline=timeline,
        makespan=makespan,
        busy=busy,
        bubble_per_rank=bubble_per_rank,
        bubble=bubble,
        peak_inflight=[_inflight_peak(schedule, r, release) for r in range(schedule.pp)],
        peak_inflight_until_b=[_inflight_peak(schedule, r, BACKWARD) for r in range(schedule.pp)],
    )


def bubble_fraction(schedule: Schedule, costs: Costs | None = None) -> float:
    """Idle share of pp x makespan when the schedule runs with `costs` (default F=B=W=1)."""
    return simulate(schedule, costs).bubble


def peak_inflight(schedule: Schedule, freed_by_weight: bool = True) -> list[int]:
    """Per rank, the most (micro-batch, chunk) activation sets held at once.

    Counts a micro-batch as stored from its F to its W in split schedules (the default,
    what W's inputs cost), or to its B when `freed_by_weight` is False. Needs no timing:
    a rank's order alone fixes it. Validates the schedule first.
    """
    validate(schedule)
    release = WEIGHT if schedule.split_backward and freed_by_weight else BACKWARD
    return [_inflight_peak(schedule, rank, release) for rank in range(schedule.pp)]


def fused_backwards(compute: list[Action]) -> set[tuple[int, int]]:
    """(micro-batch, chunk) pairs whose W directly follows their B in a rank's compute
    order: nothing runs in between, so the executor runs one full backward for both and
    keeps nothing for W (the schedules write a DualPipeV full backward, and ZB's drain, as
    B then W)."""
    return {
        (b.microbatch, b.chunk)
        for b, w in zip(compute, compute[1:])
        if b.kind == BACKWARD and w.kind == WEIGHT
        and (b.microbatch, b.chunk) == (w.microbatch, w.chunk)
    }


def peak_pending_weights(schedule: Schedule) -> list[tuple[int, ...]]:
    """Per rank, per chunk: the (micro-batch, chunk) pairs whose B has run and whose W has
    not, at the rank's peak of such pairs: each keeps its output gradients until its W.
    Zero for schedules without a split backward."""
    out = []
    for rank in range(schedule.pp):
        chunks = schedule.num_stages // schedule.pp
        compute = schedule.compute_actions(rank)
        fused = fused_backwards(compute) if schedule.split_backward else set()
        pending: set[tuple[int, int]] = set()
        best: tuple[int, ...] = (0,) * chunks
        for action in compute:
            key = (action.microbatch, action.chunk)
            if schedule.split_backward and action.kind == BACKWARD and key not in fused:
                pending.add(key)
            elif action.kind == WEIGHT:
                pending.discard(key)
            if len(pending) > sum(best):
                best = tuple(sum(1 for _, c in pending if c == k) for k in range(chunks))
        out.append(best)
    return out
