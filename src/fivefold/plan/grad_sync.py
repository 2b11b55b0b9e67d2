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

`parallel.grad_sync = "auto"` (the default) decides with the planner's own models. Once
per step when ZeRO < 2 or one rank holds the shards, with one micro-batch, or under a
pipeline (the engine reduces per micro-batch only at pp = 1). Otherwise:

    1. microbatch when its predicted step time is at most `NEAR_EQUAL` above step's (it
       then holds P·grad bytes less for about the same time);
    2. step when it is slower than that and step fits the GPU;
    3. microbatch when step does not fit and microbatch does, or neither fits and
       microbatch needs less (the whole gradient is what breaks the fit);
    4. step otherwise (neither fits, and microbatch needs no less).

"Fits" is the planner's own memory verdict for the layout (plan/evaluate.py `plan_layout`,
`LayoutPlan.fits`): the most-loaded rank's device bytes, offloaded states placed by their
tier (plan/nvme.py), within `usable_memory(hw, assume)`, and the host bytes within the
host's share. The engine asks this module with the catalog entry of its GPU (the default
catalog GPU on a CPU run, whose ranks share one machine like one node), and `fivefold plan`
and its search with the GPU they plan, so both decide the same way for the same hardware.
"""

from __future__ import annotations

import dataclasses

from fivefold.plan.hardware import GIB, Assumptions, Hardware, usable_memory
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import placed_peak
from fivefold.plan.nvme import host_fits
from fivefold.plan.timing import step_time

GRAD_SYNCS = ("auto", "step", "microbatch")
NEAR_EQUAL = 0.02  # a step at most 2% slower is "near-equal" for the memory it saves


def memory_verdict(work: Workload, layout: Layout, hw: Hardware,
                   assume: Assumptions) -> tuple[float, bool]:
    """(device bytes of the most-loaded rank, fits) as `plan_layout` judges the layout: its
    `memory_total` and `fits`."""
    _, placed = placed_peak(work, layout, hw, assume)
    total = sum(placed.items.values())
    return total, total <= usable_memory(hw, assume) and host_fits(placed.host, hw)


def _only_step(work: Workload, layout: Layout) -> str:
    """Why the layout leaves auto nothing to choose but "step" ("" when it has a choice)."""
    if layout.zero < 2 or layout.dp * layout.cp == 1:
        return "no ZeRO-2/3 gradient shards"
    if work.num_microbatches(layout) == 1:
        return "one micro-batch: both are the same"
    if layout.pp > 1:
        return "under a pipeline the engine reduces once per step"
    return ""


def fit_grad_sync(work: Workload, layout: Layout) -> Workload:
    """`work` with the grad_sync whose memory decides whether auto's choice fits, without
    the time model (what the search asks of every layout): "step" where the layout forces
    it, else "microbatch" (auto's choice fits exactly when microbatch does: it takes step
    only where step fits or neither does). Set syncs are kept."""
    if work.grad_sync != "auto":
        return work
    return dataclasses.replace(work, grad_sync="step" if _only_step(work, layout)
                               else "microbatch")


def choose_grad_sync(work: Workload, layout: Layout, hw: Hardware,
                     assume: Assumptions) -> tuple[str, str]:
    """("step" | "microbatch", the reason in a few words) for `work.grad_sync = "auto"`."""
    forced = _only_step(work, layout)
    if forced:
        return "step", forced
    runs = {sync: dataclasses.replace(work, grad_sync=sync) for sync in ("step", "microbatch")}
    times = {sync: step_time(run, layout, hw, assume).total for sync, run in runs.items()}
    slower = times["microbatch"] / times["step"] - 1
    if slower <= NEAR_EQUAL:
        return "microbatch", (f"no whole gradient held, step time {slower:+.1%}, within "
                              f"{NEAR_EQUAL:.0%}")
    step_bytes, step_fits = memory_verdict(runs["step"], layout, hw, assume)
    if step_fits:
        return "step", f"per micro-batch would be {slower:+.1%} slower on {hw.name}"
    micro_bytes, micro_fits = memory_verdict(runs["microbatch"], layout, hw, assume)
    limit = usable_memory(hw, assume) / GIB
    need = (f"{step_bytes / GIB:.1f} → {micro_bytes / GIB:.1f} of {limit:.0f} GiB, step "
            f"time {slower:+.1%}")
    if micro_fits:
        return "microbatch", (f"once per step does not fit on {hw.name}, per micro-batch "
                              f"does: {need}")
    if micro_bytes < step_bytes:
        return "microbatch", f"neither fits on {hw.name}; per micro-batch needs less: {need}"
    return "step", (f"neither fits on {hw.name} and per micro-batch needs no less; it would "
                    f"be {slower:+.1%} slower")


def resolve_grad_sync(work: Workload, layout: Layout, hw: Hardware,
                      assume: Assumptions) -> Workload:
    """`work` with grad_sync made concrete (unchanged unless it is "auto")."""
    if work.grad_sync != "auto":
        return work
    choice, _ = choose_grad_sync(work, layout, hw, assume)
    return dataclasses.replace(work, grad_sync=choice)
