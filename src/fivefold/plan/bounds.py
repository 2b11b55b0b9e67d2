"""What the search asks of a layout before it plans it whole (plan/evaluate.py's
`plan_layout`): each answer costs a fraction of a plan, and none can drop a layout that
belongs among the fastest that fit.

    step_time_bound  seconds a step takes at least: the slowest pipeline rank's compute and
                     the bubble at the quickest stage's pace, no communication
                     (plan/timing.py `step_lower_bound`: step_time only adds to it)
    memory_check     fits or not, and pipeline rank 0's device bytes: rank 0 alone over the
                     limit settles it, else the most-loaded rank (peak = max over ranks);
                     offloaded states count where their tier puts them (plan/nvme.py)
    peak_bytes       the most-loaded rank's device bytes as plan/memory.py itemises them,
                     before the offload tiers

The search (plan/search.py, plan/auto_layout.py) reads these and plan_layout's LayoutPlan,
never a term's module: memory, timing, comm and the rest stay behind this line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.plan.grad_sync import fit_grad_sync
from fivefold.plan.hardware import Assumptions, Hardware, usable_memory
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import memory_items, peak_memory
from fivefold.plan.nvme import host_fits, tier_memory
from fivefold.plan.timing import step_lower_bound


@dataclass(frozen=True)
class MemoryCheck:
    fits: bool  # on the device (every pipeline rank) and, offloaded, on the host
    first_rank_bytes: float  # pipeline rank 0's device bytes, its states placed by tier


def step_time_bound(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                    cache: dict | None = None) -> float:
    """A lower bound on the layout's step time. `cache` keeps each rank's compute between
    calls of one search."""
    # auto's recomputation costs >= 0 s, so none's compute bounds it from below without
    # solving its per-layer plan, which follows the whole layout (its budget is what the
    # states leave) and is solved only for the layouts the search reaches.
    if layout.recompute == "auto":
        layout = dataclasses.replace(layout, recompute="none")
    return step_lower_bound(work, layout, hw, assume, cache)


def memory_check(work: Workload, layout: Layout, hw: Hardware,
                 assume: Assumptions) -> MemoryCheck:
    """Whether the layout fits `usable_memory(hw, assume)` per GPU (and its offloaded states
    the host's share), asking the most-loaded rank only when rank 0 fits. grad_sync = auto
    counts the sync whose memory decides its fit (plan/grad_sync.py `fit_grad_sync`)."""
    work = fit_grad_sync(work, layout)
    limit = usable_memory(hw, assume)
    first = tier_memory(*memory_items(work, layout, assume, 0, limit=limit), layout.offload, hw)
    first_total = sum(first.items.values())
    fits = not (first_total > limit or not host_fits(first.host, hw) or sum(
        tier_memory(*peak_memory(work, layout, assume, limit)[1:], layout.offload, hw)
        .items.values()) > limit)
    return MemoryCheck(fits, first_total)


def peak_bytes(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions) -> float:
    """The most-loaded pipeline rank's device bytes under `usable_memory(hw, assume)`, with
    offloaded states off the device (no tier placement, no host limit); grad_sync = auto as
    memory_check counts it."""
    work = fit_grad_sync(work, layout)
    _, items, _ = peak_memory(work, layout, assume, usable_memory(hw, assume))
    return sum(items.values())
