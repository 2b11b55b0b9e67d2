"""When ZeRO-2/3 gradients are reduce-scattered: once per step, or every micro-batch.

    step        the gradients of micro-batches 1..m-1 accumulate whole in `.grad` (P·grad
                bytes on every rank: 15 GiB for Llama-3.1-8B in bf16), one reduce-scatter
                of P per step after the last backward
    microbatch  every micro-batch reduce-scatters into the shard (parallel/data.py): no
                whole gradient is ever held, m reduce-scatters of P per step, each hidden
                behind its own micro-batch's backward as far as the link allows

DeepSpeed ZeRO-2 and FSDP2 reduce every micro-batch by default (W3 notes, memory wall);
Megatron's distributed optimizer and DDP's `no_sync` reduce once. Which one is cheaper
depends on the link: inside a node the extra reduce-scatters hide behind backward (the
planner predicts the same step time for Llama-3.1-8B on 8 H100s, ZeRO-2 or -3), across
nodes they do not (+33% for Llama-3.1-70B at dp 8 × tp 8 on 64 H100s).

`parallel.grad_sync = "auto"` (the default) decides with the planner's own time model:
microbatch when ZeRO ≥ 2 shards over more than one rank, there is more than one
micro-batch, there is no pipeline (the engine reduces per micro-batch only at pp = 1), and
the predicted step time is at most `NEAR_EQUAL` above step's; step otherwise. The memory
side needs no test: with m > 1 microbatch always holds P·grad bytes less. The engine asks
this module with the catalog entry of its GPU (the default catalog GPU on a CPU run, whose
ranks share one machine like one node), and `fivefold plan` and its search with the GPU they
plan, so both decide the same way for the same hardware.
"""

from __future__ import annotations

import dataclasses

from fivefold.plan.hardware import Assumptions, Hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.timing import step_time

GRAD_SYNCS = ("auto", "step", "microbatch")
NEAR_EQUAL = 0.02  # a step at most 2% slower is "near-equal" for the memory it saves


def choose_grad_sync(work: Workload, layout: Layout, hw: Hardware,
                     assume: Assumptions) -> tuple[str, str]:
    """("step" | "microbatch", the reason in a few words) for `work.grad_sync = "auto"`."""
    if layout.zero < 2 or layout.dp * layout.cp == 1:
        return "step", "no ZeRO-2/3 gradient shards"
    if work.num_microbatches(layout) == 1:
        return "step", "one micro-batch: both are the same"
    if layout.pp > 1:
        return "step", "under a pipeline the engine reduces once per step"
    times = {sync: step_time(dataclasses.replace(work, grad_sync=sync), layout, hw,
                             assume).total for sync in ("step", "microbatch")}
    slower = times["microbatch"] / times["step"] - 1
    if slower <= NEAR_EQUAL:
        return "microbatch", (f"no whole gradient held, step time {slower:+.1%} "
                              f"(within {NEAR_EQUAL:.0%})")
    return "step", f"per micro-batch would be {slower:+.1%} slower on {hw.name}"


def resolve_grad_sync(work: Workload, layout: Layout, hw: Hardware,
                      assume: Assumptions) -> Workload:
    """`work` with grad_sync made concrete (unchanged unless it is "auto")."""
    if work.grad_sync != "auto":
        return work
    choice, _ = choose_grad_sync(work, layout, hw, assume)
    return dataclasses.replace(work, grad_sync=choice)
