"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it runs.

No torch here. The same lists drive the executor, give the planner its bubble and in-flight
activation counts (`check.py`) and draw the timeline (`draw.py`).

Vocabulary
----------
A model of S = pp * virtual_stages *stages* is cut over pp ranks; each rank holds
`virtual_stages` of them, its *chunks* 0..v-1 (`Schedule.stage_of(rank, chunk)`):
  - layout "loop" (AFAB, 1F1B, interleaved, ZB-H1): stage = chunk * pp + rank, so stage s
    lives on rank s % pp (Megatron's interleaving);
  - layout "v" (DualPipeV): rank r holds stage r (chunk 0) and stage 2*pp-1-r (chunk 1),
    so the data goes down the ranks and comes back up, and the loss is on rank 0.

Actions (`Action(kind, microbatch, chunk, peer)`; chunk is always the *acting* rank's chunk):
  F       forward of `microbatch` through `chunk`; keeps what backward needs.
  B       backward through `chunk`. In a schedule with `split_backward=False` this is the
          full backward (input and weight gradients). With `split_backward=True` it computes
          only the gradient of the chunk's input and keeps what W needs.
  W       weight gradients of `chunk` for `microbatch` (split schedules only); frees the rest.
  SEND_F  send the output activation of (microbatch, chunk) to rank `peer` (next stage).
  RECV_F  receive the input activation of (microbatch, chunk) from rank `peer` (previous stage).
  SEND_B  send the gradient of the input of (microbatch, chunk) to `peer` (previous stage).
  RECV_B  receive the gradient of the output of (microbatch, chunk) from `peer` (next stage).
When two consecutive stages live on the same rank (pp == 1, or the bottom of DualPipeV's V)
the tensor is handed over in memory and no communication action appears.

The execution contract (what the executor must do; `check.py` proves a schedule safe under it)
------------------------------------------------------------------------------------------
1. Run each rank's list strictly in order.
2. A maximal run of adjacent communication actions is one *batch*: pass all its ops to one
   `torch.distributed.batch_isend_irecv` call, in list order, and wait for all of them before
   going on. A batch never contains compute; compute never runs while a batch is open.
3. Between any ordered pair of ranks (a -> b), the k-th SEND on a with peer b is matched by
   the k-th RECV on b with peer a (p2p ops on a pair match in posting order; NCCL ignores
   tags). The schedules guarantee that the two agree on kind, micro-batch and stage, and
   that both tensors have the same shape, so the executor needs no tags.
4. A RECV is always in a batch *before* the compute that consumes it, so once a batch is
   waited the tensors it received are ready. A SEND is always after the compute that
   produced its tensor.
5. Deadlock freedom assumes the worst case: a batch completes only when every op in it has
   its counterpart posted by the peer (no eager buffering of sends). `check.simulate`
   replays the lists under exactly that rule.

Sources: GPipe (Huang et al. 2019) for AFAB; PipeDream-Flush / 1F1B (Narayanan et al. 2021,
"Memory-Efficient Pipeline-Parallel DNN Training"); interleaved 1F1B (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters using Megatron-LM");
ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"); DualPipeV (DeepSeek-V3 report
and the deepseek-ai/DualPipe repository, the "V" cut-in-half variant).
"""

from __future__ import annotations

from collections import deque

from fivefold.parallel.pipeline.actions import (  # noqa: F401  (re-exported)
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
    Group,
    Schedule,
)
from fivefold.parallel.pipeline.transfers import with_communication

# ---------------------------------------------------------------------------- validation


def _check_common(pp: int, num_microbatches: int) -> None:
    if pp < 1:
        raise ValueError(f"pp must be at least 1, got {pp}: set pp to 1 or more")
    if num_microbatches < 1:
        raise ValueError(
            f"num_microbatches must be at least 1, got {num_microbatches}: "
            "raise the global batch or lower the micro-batch size"
        )


# ---------------------------------------------------------------------------- compute orders


def _afab_order(pp: int, num_microbatches: int, rank: int) -> list[Action]:
    # GPipe: every forward, then every backward; all m micro-batches are stored at the peak.
    forwards = [Action(FORWARD, mb) for mb in range(num_microbatches)]
    return forwards + [Action(BACKWARD, mb) for mb in range(num_microbatches)]


def _one_f_one_b_order(pp: int, num_microbatches: int, rank: int) -> list[Action]:
    # PipeDream-Flush: rank r runs pp-r-1 warm-up forwards, then alternates one forward and
    # one backward, then drains; at most min(m, pp-r) micro-batches are stored at once.
    warmup = min(pp - rank - 1, num_microbatches)
    order = [Action(FORWARD, mb) for mb in range(warmup)]
    for steady in range(num_microbatches - warmup):
        order += [Action(FORWARD, warmup + steady), Action(BACKWARD, steady)]
    order += [Action(BACKWARD, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_chunk(kind: str, k: int, pp: int, virtual: int) -> int:
    """The chunk of a rank's k-th forward (kind F) or k-th backward (B) in interleaved 1F1B:
    groups of pp micro-batches go through chunk 0, then 1, ..., v-1; backwards walk the
    chunks in reverse. The planner counts each chunk's activations in flight with it."""
    chunk = (k % (pp * virtual)) // pp
    return virtual - 1 - chunk if kind == BACKWARD else chunk


def interleaved_warmup(pp: int, num_microbatches: int, virtual: int, rank: int) -> int:
    """Chunk-forwards rank `rank` runs before its first backward: 2(pp-r-1) + (v-1)pp
    (Narayanan et al. 2021, sec. 2.2; Megatron `forward_backward_pipelining_with_interleaving`);
    after them each forward is followed by a backward."""
    return min(num_microbatches * virtual, 2 * (pp - rank - 1) + (virtual - 1) * pp)


def _interleaved_order(pp: int, num_microbatches: int, virtual: int, rank: int) -> list[Group]:
    # Megatron-LM's interleaved 1F1B: the k-th forward on a rank takes groups of pp
    # micro-batches through chunk 0, then the same group through chunk 1, ...; backwards walk
    # the chunks in reverse.
    total = num_microbatches * virtual
    group = pp * virtual

    def action(kind: str, k: int) -> Action:
        return Action(kind, (k // group) * pp + k % pp, interleaved_chunk(kind, k, pp, virtual))

    warmup = interleaved_warmup(pp, num_microbatches, virtual, rank)
    order: list[Group] = [action(FORWARD, k) for k in range(warmup)]
    # Each steady F is paired with the next B so that one batch carries both sends and both
    # receives (Megatron's send_forward_backward_recv_forward_backward).
    order += [(action(FORWARD, warmup + k), action(BACKWARD, k)) for k in range(total - warmup)]
    order += [action(BACKWARD, k) for k in range(total - warmup, total)]
    return order


def _zero_bubble_h1_orders(pp: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of F and B, with each W placed by list scheduling in unit time.

    Qi et al. 2023 (sec. 2.1) keep 1F1B's warm-up and order and only move W: it is off the
    critical path (no other stage waits for it), so it can fill what would be idle time.
    In unit time (the paper's T_F = T_B = T_W) each rank, whenever free, runs the next F or B
    of its 1F1B order if that is ready, else its oldest pending W, else waits. An F must also
    wait (doing a W instead) while pp micro-batches are stored until their W: rank 0's 1F1B
    peak, so the peak memory over all ranks stays 1F1B's.
    """
    finished: set[tuple[str, int, int]] = set()  # (kind, microbatch, rank), done by `time`
    one_f_one_b_orders = [deque(_one_f_one_b_order(pp, num_microbatches, r)) for r in range(pp)]
    orders: list[list[Action]] = [[] for _ in range(pp)]
    pending_weights: list[deque[int]] = [deque() for _ in range(pp)]
    stored_until_weight = [0] * pp
    while any(one_f_one_b_orders) or any(pending_weights):
        ran_now = []
        for rank in range(pp):
            upcoming = one_f_one_b_orders[rank][0] if one_f_one_b_orders[rank] else None
            if upcoming is not None and upcoming.kind == FORWARD:
                ready = rank == 0 or (FORWARD, upcoming.microbatch, rank - 1) in finished
                ready = ready and stored_until_weight[rank] < pp
            elif upcoming is not None:
                ready = rank == pp - 1 or (BACKWARD, upcoming.microbatch, rank + 1) in finished
            if upcoming is not None and ready:
                chosen = one_f_one_b_orders[rank].popleft()
                if chosen.kind == FORWARD:
                    stored_until_weight[rank] += 1
                else:
                    pending_weights[rank].append(chosen.microbatch)
            elif pending_weights[rank]:
                chosen = Action(WEIGHT, pending_weights[rank].popleft())
                stored_until_weight[rank] -= 1
            else:
                continue
            orders[rank].append(chosen)
            ran_now.append((chosen.kind, chosen.microbatch, rank))
        finished.update(ran_now)  # visible from the next time step on
    return orders


def _dualpipe_v_order(pp: int, num_microbatches: int, rank: int) -> list[Action]:
    # The eight phases of DualPipeV (deepseek-ai/DualPipe, dualpipev.py), written as a
    # sequence. Chunk 0 runs down the V, chunk 1 back up. Where DualPipeV overlaps the forward
    # of one micro-batch with the backward of another we list F then B. Backwards marked
    # `deferred` keep their W in a FIFO that later "W" phases pop (zero-bubble style);
    # the others are a full backward, written as B immediately followed by its W.
    order: list[Action] = []
    next_forward, next_backward = [0, 0], [0, 0]
    deferred: deque[Action] = deque()

    def forward(chunk: int) -> None:
        order.append(Action(FORWARD, next_forward[chunk], chunk))
        next_forward[chunk] += 1

    def backward(chunk: int, defer_weight: bool = False) -> None:
        mb = next_backward[chunk]
        next_backward[chunk] += 1
        order.append(Action(BACKWARD, mb, chunk))
        (deferred.append if defer_weight else order.append)(Action(WEIGHT, mb, chunk))

    def weight() -> None:
        order.append(deferred.popleft())

    below = pp - rank - 1  # ranks below this one in the V
    for _ in range(2 * below):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(below):
        backward(1, defer_weight=True)
        weight()
        forward(1)
    for _ in range(num_microbatches - 2 * pp + rank + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(below):
        backward(1)
        forward(1)
        backward(0)
    # Drain: the second half of these backwards defer their W to fill the tail.
    defer = False
    for step in range(rank + 1):
        if step == (rank + 1) // 2 and rank % 2 == 1:
            defer = True
        backward(1, defer_weight=defer)
        if step == (rank + 1) // 2 and rank % 2 == 0:
            defer = True
        backward(0, defer_weight=defer)
    for _ in range(below):
        weight()
        backward(0, defer_weight=True)
    while deferred:
        weight()
    return order


# ---------------------------------------------------------------------------- schedules


def afab(pp: int, num_microbatches: int) -> Schedule:
    """All-forward-all-backward (GPipe): bubble (pp-1)/(m+pp-1), stores all m micro-batches."""
    _check_common(pp, num_microbatches)
    compute = [_afab_order(pp, num_microbatches, rank) for rank in range(pp)]
    return with_communication("afab", pp, num_microbatches, 1, compute)


def one_f_one_b(pp: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): AFAB's bubble, but rank r stores only min(m, pp-r)."""
    _check_common(pp, num_microbatches)
    compute = [_one_f_one_b_order(pp, num_microbatches, rank) for rank in range(pp)]
    return with_communication("1f1b", pp, num_microbatches, 1, compute)


def interleaved_1f1b(pp: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: v chunks per rank, bubble (pp-1)/(v*m+pp-1)."""
    _check_common(pp, num_microbatches)
    if virtual_stages < 2:
        raise ValueError(
            f"interleaved 1F1B needs virtual_stages >= 2, got {virtual_stages}: "
            "use --virtual 2 or more, or the plain 1f1b schedule"
        )
    if num_microbatches < pp or num_microbatches % pp:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches to be a multiple of pp={pp} (and at "
            f"least pp), got {num_microbatches}: use {max(pp, -(-num_microbatches // pp) * pp)}"
        )
    compute = [_interleaved_order(pp, num_microbatches, virtual_stages, rank) for rank in range(pp)]
    return with_communication("interleaved", pp, num_microbatches, virtual_stages, compute)


def zero_bubble_h1(pp: int, num_microbatches: int) -> Schedule:
    """ZB-H1: backward split into B and W; W fills the bubbles, peak memory stays 1F1B's."""
    _check_common(pp, num_microbatches)
    compute = _zero_bubble_h1_orders(pp, num_microbatches)
    return with_communication("zb-h1", pp, num_microbatches, 1, compute, split_backward=True)


def dualpipe_v(pp: int, num_microbatches: int) -> Schedule:
    """DualPipeV: two chunks per rank laid out as a V; needs m >= 2*pp."""
    _check_common(pp, num_microbatches)
    if num_microbatches < 2 * pp:
        raise ValueError(
            f"DualPipeV needs num_microbatches >= 2*pp = {2 * pp}, got {num_microbatches}: "
            f"use at least {2 * pp} micro-batches"
        )
    compute = [_dualpipe_v_order(pp, num_microbatches, rank) for rank in range(pp)]
    return with_communication(
        "dualpipev", pp, num_microbatches, 2, compute, split_backward=True, layout="v"
    )


SCHEDULE_NAMES = ("afab", "1f1b", "interleaved", "zb-h1", "dualpipev")


def build_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """One door for the CLI, planner and executor: a schedule by name."""
    key = name.lower().replace("_", "-")
    key = {
        "gpipe": "afab",
        "zbh1": "zb-h1",
        "zb": "zb-h1",
        "interleaved-1f1b": "interleaved",
        "dualpipe-v": "dualpipev",
    }.get(key, key)
    if key not in SCHEDULE_NAMES:
        raise ValueError(
            f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULE_NAMES)}"
        )
    if key == "interleaved":
        return interleaved_1f1b(pp, num_microbatches, virtual_stages)
    expected_virtual = 2 if key == "dualpipev" else 1
    if virtual_stages not in (1, expected_virtual):
        raise ValueError(
            f"schedule {key!r} has {expected_virtual} chunk(s) per rank, got virtual_stages="
            f"{virtual_stages}: drop --virtual or use the interleaved schedule"
        )
    builders = {"afab": afab, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1, "dualpipev": dualpipe_v}
    return builders[key](pp, num_microbatches)
