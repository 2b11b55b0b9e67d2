"""Where the sends and receives go in each rank's list.

A send waits for its receiver (the strict reading of the execution contract), so where a
transfer sits decides whether it costs time. The computes are replayed with free transfers,
and each transfer is put where its sender and receiver are both idle anyway. No torch here.
"""

from __future__ import annotations

from collections import defaultdict

from fivefold.parallel.pipeline.actions import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WEIGHT,
    Action,
    Group,
    Schedule,
)


def with_communication(
    name: str,
    pp: int,
    num_microbatches: int,
    virtual: int,
    compute: list[list[Group]],
    split_backward: bool = False,
    layout: str = "loop",
) -> Schedule:
    """Insert the sends and receives that `compute` implies, following the contract above.

    `compute` holds each rank's computes, single or grouped in tuples; communication goes
    only in the *gaps* between groups (gap k comes before group k). Under the contract a
    send waits until its receiver posts the receive, so a transfer costs no time only if
    both sides post it while idle anyway. We therefore replay the compute in unit time with
    free transfers (`_ideal_gaps`) and put each transfer in the earliest sender gap (after
    the producer) and receiver gap (before the consumer) whose idle windows overlap: the
    two ranks meet there. Where no window overlaps, the send goes right after its producer
    and the receive in the first gap that ends after the tensor exists. Pair traffic matches
    in posting order, so a receive then moves up where needed to keep the sender's order.
    Grouping an F with the next B (Megatron's interleaved steady state) puts both sends
    and both receives in one batch, as Megatron's send_forward_backward_recv_forward_backward.
    """
    groups = [[g if isinstance(g, tuple) else (g,) for g in order] for order in compute]
    schedule = Schedule(name, pp, num_microbatches, virtual, [], split_backward, layout)
    windows = _ideal_gaps(schedule, groups)
    last_stage = schedule.num_stages - 1
    produced: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, mb, stage) -> rank, group
    for rank, order in enumerate(groups):
        for position, group in enumerate(order):
            for action in group:
                produced[
                    (action.kind, action.microbatch, schedule.stage_of(rank, action.chunk))
                ] = (rank, position)
    by_pair: dict[tuple[int, int], list[tuple[int, int, Action, Action, int]]] = defaultdict(list)
    for rank, order in enumerate(groups):
        for position, action in [(pos, a) for pos, group in enumerate(order) for a in group]:
            stage = schedule.stage_of(rank, action.chunk)
            source_stage = stage - 1 if action.kind == FORWARD else stage + 1
            if action.kind == WEIGHT or not 0 <= source_stage <= last_stage:
                continue
            source, made_in = produced[(action.kind, action.microbatch, source_stage)]
            if source == rank:
                continue  # same rank: handed over in memory
            send_gap, recv_gap = _meeting_gaps(
                windows[source], made_in + 1, windows[rank], position
            )
            kind = (SEND_F, RECV_F) if action.kind == FORWARD else (SEND_B, RECV_B)
            send = Action(kind[0], action.microbatch, schedule.chunk_of(source_stage), rank)
            recv = Action(kind[1], action.microbatch, action.chunk, source)
            by_pair[(source, rank)].append((send_gap, made_in, send, recv, recv_gap))
    sends: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(pp)]
    recvs: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(pp)]
    for (source, destination), transfers in by_pair.items():
        transfers.sort(key=lambda t: (t[0], t[1]))  # the order the sender posts them
        recv_gap = len(groups[destination])
        for _send_gap, _, _send, recv, wanted_gap in reversed(transfers):
            recv_gap = min(recv_gap, wanted_gap)
            recvs[destination][recv_gap].insert(0, recv)
        for send_gap, _, send, _, _ in transfers:
            sends[source][send_gap].append(send)
    for rank, order in enumerate(groups):
        actions: list[Action] = []
        for gap in range(len(order) + 1):
            actions += sends[rank].get(gap, []) + recvs[rank].get(gap, [])
            actions += order[gap] if gap < len(order) else ()
        schedule.actions.append(actions)
    return schedule


def _ideal_gaps(schedule: Schedule, groups: list[list[tuple[Action, ...]]]) -> list[list[tuple]]:
    """Per rank, per gap, the idle window (arrive, leave) when transfers are free and every
    F, B (input part) and W costs 1; an unsplit B costs 2. The last gap never closes."""
    ends: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * schedule.pp, [0] * schedule.pp
    windows: list[list[tuple]] = [[] for _ in range(schedule.pp)]
    last_stage, progress = schedule.num_stages - 1, True
    while progress:
        progress = False
        for rank, order in enumerate(groups):
            while position[rank] < len(order):
                needed = []
                for action in order[position[rank]]:
                    stage = schedule.stage_of(rank, action.chunk)
                    if action.kind == FORWARD and stage > 0:
                        needed.append((FORWARD, action.microbatch, stage - 1))
                    elif action.kind == BACKWARD and stage < last_stage:
                        needed.append((BACKWARD, action.microbatch, stage + 1))
                local = {
                    (a.kind, a.microbatch, schedule.stage_of(rank, a.chunk))
                    for a in order[position[rank]]
                }
                needed = [key for key in needed if key not in local]
                if any(key not in ends for key in needed):
                    break
                start = max([clock[rank]] + [ends[key] for key in needed])
                windows[rank].append((clock[rank], start))
                for action in order[position[rank]]:
                    unit = 2.0 if action.kind == BACKWARD and not schedule.split_backward else 1.0
                    start += unit
                    ends[
                        (action.kind, action.microbatch, schedule.stage_of(rank, action.chunk))
                    ] = start
                clock[rank], position[rank], progress = start, position[rank] + 1, True
    for rank, order in enumerate(groups):
        if position[rank] < len(order):
            raise ValueError(
                f"{schedule.name}: rank {rank} waits forever at {order[position[rank]]}"
            )
        windows[rank].append((clock[rank], float("inf")))
    return windows


def _meeting_gaps(
    sender: list[tuple], first_send_gap: int, receiver: list[tuple], last_recv_gap: int
) -> tuple[int, int]:
    best = None
    for send_gap in range(first_send_gap, len(sender)):
        send_arrive, send_leave = sender[send_gap]
        for recv_gap in range(last_recv_gap + 1):
            recv_arrive, recv_leave = receiver[recv_gap]
            if send_arrive <= recv_leave and recv_arrive <= send_leave:
                meet = max(send_arrive, recv_arrive)
                if best is None or meet < best[0]:
                    best = (meet, send_gap, recv_gap)
        if best is not None and send_arrive > best[0]:
            break
    if best is not None:
        return best[1], best[2]
    made_at = sender[first_send_gap][0]
    recv_gap = next(
        (k for k in range(last_recv_gap + 1) if receiver[k][1] >= made_at), last_recv_gap
    )
    return first_send_gap, recv_gap

