"""train.recompute = "auto": per-layer, per-operator recomputation chosen under a memory
budget (plan/recompute_plan.py), applied by selective activation checkpointing
(parallel/recompute.py).

Through the trainer, on the agreement tests' model: for budgets between full recomputation's
peak and no recomputation's, the tracker's peak (the second step, when Adam's moments exist)
stays under the budget, the planner's activations item for the chosen plan agrees with the
tracker within 2% (measured within 1.7%), and losses and weights are bit-identical to no
recomputation (recomputation changes no arithmetic). The dynamic program is checked against
brute force, and a budget below the minimum is refused in one line naming it.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib

import pytest
import torch
from common import small_config
from test_plan_agreement import MODEL

from fivefold.config import ConfigError, validate
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.peak import PeakTracker
from fivefold.plan.hardware import GIB, Assumptions
from fivefold.plan.inputs import training_plan_inputs
from fivefold.plan.memory import auto_plan, memory_items, minimum_budget
from fivefold.plan.recompute_auto import config_plan
from fivefold.plan.recompute_plan import LayerChoice, _knapsack, choose
from fivefold.train.trainer import Trainer

FRACTIONS = (0.25, 0.5, 0.75)  # of the way from full recomputation's peak to none's
ACTIVATIONS_TOLERANCE = 0.02


def planned_allocated(tmp, args) -> tuple[float, dict]:
    """The planner's peak allocated bytes (items without the overhead) and its items."""
    cfg = small_config(tmp, *MODEL, *args)
    work, layout = training_plan_inputs(cfg)
    items, _ = memory_items(dataclasses.replace(work, precision="fp32"), layout, Assumptions())
    return sum(v for k, v in items.items() if k != "overhead"), items


def run(tmp, args, steps=2):
    cfg = small_config(tmp, *MODEL, *args)
    trainer = Trainer(cfg, ParallelDims.single(), quiet=True)
    losses = [trainer.train_step()["loss"]]
    with PeakTracker(trainer.peak_sources()) as tracker:
        losses += [trainer.train_step()["loss"] for _ in range(steps - 1)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.close()
    return {"losses": losses, "params": params, "peak": tracker.peak,
            "activations": tracker.item_peaks.get("activations", 0),
            "policies": [c.label() for c in trainer.recompute_policies or []]}


def test_auto_fits_the_budget_agrees_with_the_planner_and_changes_no_math(tmp_path):
    none_peak, _ = planned_allocated(tmp_path, [])
    cfg = small_config(tmp_path, *MODEL)
    work, layout = training_plan_inputs(cfg)
    work = dataclasses.replace(work, precision="fp32")
    low = minimum_budget(work, layout) * GIB
    assert low < none_peak
    ref = run(tmp_path, [])
    seen = set()
    for frac in FRACTIONS:
        budget = (low + frac * (none_peak - low)) / GIB
        args = ["--train.recompute", "auto", "--train.memory_budget_gib", repr(budget)]
        got = run(tmp_path, args)
        planned, items = planned_allocated(tmp_path, args)
        assert planned <= budget * GIB
        assert got["peak"] <= budget * GIB, (frac, got["peak"], budget * GIB)
        # The item the choice moves, measured +0.16%, +0.13% and -1.7% (the last plan mixes
        # kinds, and the planner adds the largest working set on top of every layer kept, as
        # for selective in tests/test_plan_agreement.py's PEAK_GAPS, there -3.3%).
        assert abs(got["activations"] - items["activations"]) <= ACTIVATIONS_TOLERANCE * items[
            "activations"], (frac, got["activations"], items["activations"])
        assert got["losses"] == ref["losses"], (frac, got["losses"], ref["losses"])
        for name, value in ref["params"].items():
            assert torch.equal(got["params"][name], value), (frac, name)
        seen.add(tuple(got["policies"]))
    assert len(seen) == len(FRACTIONS)  # each budget chose another plan


def test_auto_beats_full_and_selective_at_their_memory(tmp_path):
    """At the memory full or selective recomputation needs, auto's predicted recompute time
    is at most theirs (they are among its choices) and below full's where there is room."""
    cfg = small_config(tmp_path, *MODEL)
    work, layout = training_plan_inputs(cfg)
    work = dataclasses.replace(work, precision="fp32")
    auto = dataclasses.replace(layout, recompute="auto")
    layers = work.model.num_layers
    for mode in ("full", "selective"):
        peak, _ = planned_allocated(tmp_path, ["--train.recompute", mode])
        budget = dataclasses.replace(work, memory_budget_gib=peak / GIB)
        plan = auto_plan(budget, auto, 0)
        assert plan is auto_plan(budget, auto, 0)  # memoised: memory and time read one plan
        kind = {"full": ("keep", frozenset()), "selective": ("selective", frozenset())}[mode]
        assert plan.seconds <= _mode_seconds(work, auto, *kind) * layers + 1e-15, (
            mode, plan.summary())
    full_peak, _ = planned_allocated(tmp_path, ["--train.recompute", "full"])
    roomy = auto_plan(dataclasses.replace(work, memory_budget_gib=1.2 * full_peak / GIB), auto, 0)
    assert roomy.seconds < _mode_seconds(work, auto, "keep", frozenset()) * layers


def _mode_seconds(work, layout, kind, kept) -> float:
    from fivefold.plan.recompute_plan import _ranking_hardware, layer_choices

    hw, assume = _ranking_hardware()
    choices = layer_choices(work, layout, hw, assume)
    match = [c for c in choices if c.kind == kind and c.kept == kept]
    return match[0].seconds


def test_the_dynamic_program_is_exact_against_brute_force():
    """Random choice sets over 4 layers of two in-flight weights: the program's cost equals
    the best assignment found by trying them all (bytes are whole units of the budget here,
    so rounding cannot hide one), and nothing is returned when nothing fits."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = 3 + trial % 3
        stored = torch.randint(100, 2000, (n,), generator=gen).tolist()
        seconds = torch.rand(n, generator=gen).tolist()
        choices = tuple(LayerChoice("keep", frozenset({str(i)}), float(b), 0.0, s)
                        for i, (b, s) in enumerate(zip(stored, seconds)))
        weights = (2.0, 2.0, 1.0, 1.0)
        budget = 4096.0  # one byte per unit: no rounding
        best = None
        for pick in itertools.product(choices, repeat=len(weights)):
            used = sum(w * c.stored for w, c in zip(weights, pick))
            cost = sum(c.seconds for c in pick)
            if used <= budget and (best is None or cost < best):
                best = cost
        got = _knapsack(choices, weights, budget)
        if best is None:
            assert got is None
        else:
            assert got is not None and abs(sum(c.seconds for c in got) - best) < 1e-12
            assert sum(w * c.stored for w, c in zip(weights, got)) <= budget
    # The working-set cap: the cheapest choice's large working set is paid once.
    cheap = LayerChoice("keep", frozenset({"a"}), 10.0, 100.0, 0.0)
    dear = LayerChoice("keep", frozenset({"b"}), 10.0, 0.0, 1.0)
    assert choose([cheap, dear], [1.0, 1.0], 50.0) == (dear, dear)
    assert choose([cheap, dear], [1.0, 1.0], 150.0) == (cheap, cheap)


@pytest.mark.parametrize("args, words", [
    (["--train.memory_budget_gib", "0.0001"], ["train.memory_budget_gib", "at least",
                                               "GiB"]),
    ([], ["train.memory_budget_gib > 0"]),
    (["--train.memory_budget_gib", "1", "--parallel.tp", "2"], ["parallel.tp = 2"]),
])
def test_a_bad_budget_or_layout_is_refused_in_one_line(args, words, tmp_path):
    with pytest.raises(ConfigError) as e:  # the keys' rules (loading validates), then the
        cfg = small_config(pathlib.Path(tmp_path), *MODEL, "--train.recompute", "auto", *args)
        validate(cfg)  # planner's minimum: both before `fivefold train` writes (cli.py)
        config_plan(cfg)
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text
    if "at least" in text:  # the minimum it names is full recomputation's planned peak
        work, layout = training_plan_inputs(small_config(pathlib.Path(tmp_path), *MODEL))
        work = dataclasses.replace(work, precision="fp32")
        assert f"{minimum_budget(work, layout):.4g} GiB" in text


def test_the_attention_core_is_timed_at_bf16s_rate_under_fp8():
    """FP8 runs the projections' GEMMs in FP8 but attention's core in bf16 (plan/timing.py
    `high_peak`): recompute = auto's per-operator times must say the same, the core's
    forward seconds equal under fp8 and bf16, the projections' shorter under fp8."""
    from fivefold.models.presets import preset
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.recompute_plan import op_table

    hw, assume = get_hardware("h100")
    layout = Layout(dp=8, mbs=1)
    tables = {p: op_table(Workload(model=preset("llama-3.1-8b"), seq_len=4096, gbs=64,
                                   precision=p), layout, hw, assume)
              for p in ("bf16", "fp8")}
    assert tables["fp8"]["core"][2] == tables["bf16"]["core"][2]
    assert tables["fp8"]["q"][2] < tables["bf16"]["q"][2]


def test_two_kinds_of_layer_are_planned_exactly():
    """Layers of two kinds (their own choices each, as train.fp8_keep_out makes them) over
    two in-flight weights: `choose` finds the brute-force optimum, with the working-set cap
    applying to every layer."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        sets = []
        for kind in range(2):
            n = 2 + (trial + kind) % 3
            stored = torch.randint(100, 2000, (n,), generator=gen).tolist()
            working = torch.randint(0, 3, (n,), generator=gen).tolist()
            seconds = torch.rand(n, generator=gen).tolist()
            sets.append([LayerChoice("keep", frozenset({f"{kind}{i}"}), float(b), 100.0 * w,
                                     s) for i, (b, w, s) in enumerate(zip(stored, working,
                                                                          seconds))])
        weights, kinds = (2.0, 1.0, 2.0, 1.0), (0, 1, 1, 0)
        budget = 4096.0
        best = None
        for pick in itertools.product(*(sets[k] for k in kinds)):
            used = (sum(w * c.stored for w, c in zip(weights, pick))
                    + max(c.working for c in pick))
            cost = sum(c.seconds for c in pick)
            if used <= budget and (best is None or cost < best):
                best = cost
        got = choose(sets, weights, budget, kinds)
        if best is None:
            assert got is None, trial
            continue
        assert got is not None and abs(sum(c.seconds for c in got) - best) < 1e-12, trial
        assert all(c in sets[k] for c, k in zip(got, kinds)), trial


def test_kept_out_layers_recompute_their_projections_at_bf16s_rate():
    """train.fp8_keep_out leaves layers 0 and 1 in bf16: their per-operator table is bf16's
    (the projections at bf16's GEMM rate), the other 30 layers' FP8's; full recomputation
    costs 2 of the one and 30 of the other, whose re-run forward casts again. recompute =
    auto plans the two kinds with their own costs: a plan whose seconds are those of its
    layers at their own rates, cheaper than the plan the FP8 table alone chose for every
    layer, costed at the true rates."""
    from fivefold.models.presets import preset
    from fivefold.plan.fp8 import rank_dense_cast_bytes
    from fivefold.plan.fp8_linears import layer_fp8_linears
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.recompute_plan import (
        _ranking_hardware,
        elementwise_seconds,
        layer_fp8_ops,
        op_table,
        recompute_seconds,
    )

    hw, assume = get_hardware("h100")
    layout = Layout(dp=8, mbs=1, recompute="auto")
    base = {"model": preset("llama-3.1-8b"), "seq_len": 4096, "gbs": 64}
    work = Workload(**base, precision="fp8", fp8_keep_out="layers.0,layers.1")
    every = Workload(**base, precision="fp8")
    bf16 = op_table(Workload(**base, precision="bf16"), layout, hw, assume)
    fp8 = op_table(every, layout, hw, assume)
    assert layer_fp8_ops(work, 0) == layer_fp8_ops(work, 1) == frozenset()
    assert layer_fp8_ops(work, 2) == layer_fp8_ops(every, 0) == frozenset(fp8) - {"core"}
    assert op_table(work, layout, hw, assume, layer_fp8_ops(work, 0)) == bf16
    assert op_table(work, layout, hw, assume, layer_fp8_ops(work, 2)) == fp8
    assert bf16["q"][2] > fp8["q"][2] and bf16["core"] == fp8["core"]
    elem = elementwise_seconds(work, layout, hw, assume)
    # an FP8 layer's re-run forward casts again (the kept-out layers cast nothing)
    casts = rank_dense_cast_bytes(every, layout, 4096, layer_fp8_linears(every, 2))[0] / (
        hw.hbm_tbps * 1e12 * assume.hbm_efficiency)
    full = {name: elem + sum(t[2] for t in table.values()) + extra
            for name, table, extra in (("bf16", bf16, 0.0), ("fp8", fp8, casts))}
    assert recompute_seconds(work, layout, 0, hw, assume, None) == pytest.approx(
        2 * full["bf16"] + 30 * full["fp8"], rel=1e-12)
    budget = 1.05 * minimum_budget(every, layout)  # some layers recompute some operators
    plans = {name: auto_plan(dataclasses.replace(w, memory_budget_gib=budget), layout, 0)
             for name, w in (("keep-out", work), ("every", every))}
    rank_hw, rank_assume = _ranking_hardware()
    kept = plans["keep-out"]
    assert kept.seconds > 0 and kept.seconds == pytest.approx(
        recompute_seconds(work, layout, 0, rank_hw, rank_assume, kept), rel=1e-12)
    uniform = recompute_seconds(work, layout, 0, rank_hw, rank_assume, plans["every"])
    assert kept.seconds < uniform, (kept.summary(), plans["every"].summary())
