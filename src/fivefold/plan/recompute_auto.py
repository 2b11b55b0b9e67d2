"""recompute = auto for a whole run: the per-layer plan of every pipeline rank (the layer
choices of plan/recompute_plan.py under the budget that plan/memory.py leaves them), as the
engine applies it and `fivefold plan` prints it. A budget below full recomputation's peak is
refused naming the minimum."""

from __future__ import annotations

import dataclasses

from fivefold.errors import ConfigError
from fivefold.plan.inputs import training_plan_inputs
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import auto_plan, minimum_budget
from fivefold.plan.placement import chunk_layer_counts, rank_chunks
from fivefold.plan.recompute_plan import BudgetTooSmall, LayerChoice


def layer_policies(work: Workload, layout: Layout) -> list[LayerChoice]:
    """The choice for every layer of the model, in forward order (each chunk's layers from
    the plan of the rank that holds it)."""
    plans = [auto_plan(work, layout, rank) for rank in range(layout.pp)]
    if any(p is None for p in plans):
        raise BudgetTooSmall(f"a budget of {work.memory_budget_gib:g} GiB is below full "
                             f"recomputation's peak of {minimum_budget(work, layout):.4g} GiB")
    taken = [0] * layout.pp
    counts = chunk_layer_counts(work.model, layout)
    out = []
    for chunk, n in enumerate(counts):
        rank = next(r for r in range(layout.pp) if chunk in rank_chunks(layout, r))
        out += plans[rank].choices[taken[rank]:taken[rank] + n]
        taken[rank] += n
    return out


def config_plan(cfg, precision: str | None = None) -> list[LayerChoice]:
    """The per-layer choices of a training config with recompute = auto (`precision`: the
    one the engine resolved; by default fp32 on a CPU device, else bf16). A budget below
    full recomputation's peak is a ConfigError naming the minimum."""
    work, layout = training_plan_inputs(cfg)
    tr = cfg.train
    if precision is None and tr.precision == "auto":
        precision = "fp32" if tr.device == "cpu" else "bf16"
    work = dataclasses.replace(work, precision=precision or work.precision)
    try:
        return layer_policies(work, layout)
    except BudgetTooSmall:
        low = minimum_budget(work, layout)
        raise ConfigError(f"train.memory_budget_gib = {tr.memory_budget_gib:g} is below what "
                          f"full recomputation needs at its peak with this layout, "
                          f"{low:.4g} GiB; raise the budget to at least that") from None


def describe(work: Workload, layout: Layout) -> list[str]:
    """Lines for `fivefold plan`: the chosen set per pipeline rank and its cost."""
    lines = [f"recompute auto under {work.memory_budget_gib:g} GiB (minimum, full "
             f"recomputation: {minimum_budget(work, layout):.4g} GiB):"]
    for rank in range(layout.pp):
        plan = auto_plan(work, layout, rank)
        if plan is None:
            lines.append(f"  pp rank {rank}: nothing fits; full recomputation's bytes stand")
            continue
        lines.append(f"  pp rank {rank}: {plan.summary()}; recompute "
                     f"{plan.seconds * 1e3:.3g} ms per micro-batch (ranking GPU)")
    return lines
