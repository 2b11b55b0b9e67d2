"""A search that takes a while says so, and recompute = auto's search stays exact while it
prunes: the per-layer plan solves the working-set caps in the order of a Lagrangian lower
bound and skips those that cannot win (plan/recompute_plan.py `choose`), and the layout
search bounds an auto layout by no recomputation's compute (plan/search.py)."""

from __future__ import annotations

import dataclasses
import importlib
import random

import pytest

from fivefold.models.presets import preset
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.hardware import get_hardware
from fivefold.plan.layout import Workload
from fivefold.plan.recompute_plan import LayerChoice, _knapsack, choose
from fivefold.plan.search import SearchSpace, enumerate_layouts, search

# the module, not the function that fivefold.plan exports under the same name
search_module = importlib.import_module("fivefold.plan.search")


def every_cap(choices, weights, budget):
    """The plain method: every cap in ascending order, the first strictly cheaper kept."""
    best = None
    for cap in sorted({c.working for c in choices}):
        allowed = []
        for c in sorted((c for c in choices if c.working <= cap),
                        key=lambda c: (c.seconds, c.stored)):
            if not allowed or c.stored < allowed[-1].stored:
                allowed.append(c)
        picked = _knapsack(tuple(allowed), tuple(weights), budget - cap)
        if picked is not None:
            cost = sum(c.seconds for c in picked)
            if best is None or cost < best[0] - 1e-15:
                best = (cost, picked)
    return None if best is None else best[1]


def test_pruned_choice_equals_solving_every_cap():
    rng = random.Random(0)
    for trial in range(60):
        choices = [LayerChoice("keep", frozenset({str(i)}), rng.uniform(10, 100),
                               rng.choice([0.0, 20.0, 50.0, 80.0]), rng.uniform(0, 1))
                   for i in range(rng.randint(3, 8))]
        weights = [rng.choice([1.0, 2.0, 3.0]) for _ in range(rng.randint(2, 6))]
        budget = rng.uniform(50, 60 * len(weights) * 3)
        assert choose(choices, weights, budget) == every_cap(choices, weights, budget), trial


def test_auto_search_equals_planning_every_layout():
    """recompute = auto over a small space: the same top 3 as planning every layout."""
    hw, assume = get_hardware("h100", {"memory_gib": 24})
    work = dataclasses.replace(Workload(preset("llama-3.2-1b"), seq_len=4096, gbs=16),
                               memory_budget_gib=16.0)
    space = SearchSpace(zero=(1, 3), max_mbs=2, recompute=("auto",), schedule=("1f1b",))
    result = search(work, 4, hw, assume, space, top=3)
    plans = [plan_layout(work, lay, hw, assume) for lay in enumerate_layouts(work, 4, hw, space)]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.time.total)
    assert len(fitting) >= 3
    assert [p.time.total for p in result.top] == pytest.approx(
        [p.time.total for p in fitting[:3]], rel=1e-12)


def test_a_long_search_reports_progress(monkeypatch):
    monkeypatch.setattr(search_module, "PROGRESS_EVERY_S", 0.0)
    hw, assume = get_hardware("h100")
    lines = []
    search(Workload(preset("llama-3.2-1b"), seq_len=4096, gbs=64), 8, hw, assume,
           SearchSpace(zero=(1,), max_mbs=2), top=3, progress=lines.append)
    assert any(line.startswith("searching: bounded") for line in lines), lines[:3]
    assert any("in bound order" in line and "planned" in line for line in lines), lines[-3:]
    quiet = []  # the default: a search under 2 s says nothing
    monkeypatch.setattr(search_module, "PROGRESS_EVERY_S", 2.0)
    search(Workload(preset("llama-3.2-1b"), seq_len=4096, gbs=64), 8, hw, assume,
           SearchSpace(zero=(1,), max_mbs=1, pp=(1,), tp=(1,)), top=1, progress=quiet.append)
    assert quiet == []
