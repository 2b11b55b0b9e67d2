"""parallel.layout = auto: the planner's pick runs, reproduces the same layout set by hand and
the single-process run, is printed with its runner-up, and is kept by a resume."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from common import small_config
from harness import run_ranks

from fivefold import config
from fivefold.cli import main

STEPS = 2
# Fixed so every rank (and every machine) plans for the same memory; the free-memory path
# is the CLI test's.
BUDGET = ["--train.memory_budget_gib", "1.0", "--train.gbs", "8", "--train.steps", str(STEPS)]


def _hand_overrides(record: dict, grad_sync: str) -> list[str]:
    """The chosen layout written out as the keys a person would set."""
    f = record["fields"]
    out = []
    for key in ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "schedule", "virtual_stages",
                "sp", "cp_comm"):
        out += [f"--parallel.{key}", str(f[key]).lower()]
    return out + ["--parallel.sp_saved_input", f["sp_saved"], "--parallel.grad_sync",
                  grad_sync, "--train.recompute", f["recompute"]]


def _auto_and_hand(rank, world, root):
    """Train with auto, then with the chosen layout set by hand; the losses of both."""
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train import auto_layout
    from fivefold.train.loop import run

    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), RANK=str(rank))
    out = {}
    cfg = small_config(Path(root) / f"auto{world}", "--parallel.layout", "auto", *BUDGET)
    cfg = auto_layout.resolve(cfg, None, first_rank=False)
    auto_layout.check_agreement(cfg)
    out["auto"] = [r["loss"] for r in run(cfg, ParallelDims.from_config(cfg.parallel))]
    # The budget bounds a hand layout's recompute = auto only (a bound nothing would hold
    # to is refused otherwise).
    budget = BUDGET if cfg.train.recompute == "auto" else BUDGET[2:]
    hand = small_config(Path(root) / f"hand{world}", *budget,
                        *_hand_overrides(cfg.auto_layout, cfg.parallel.grad_sync))
    out["hand"] = [r["loss"] for r in run(hand, ParallelDims.from_config(hand.parallel))]
    out["record"] = cfg.auto_layout
    return out if rank == 0 else None


def test_auto_on_1_2_4_ranks_trains_like_the_same_layout_by_hand(tmp_path, monkeypatch):
    from fivefold.train import auto_layout
    from fivefold.train.loop import run

    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = auto_layout.resolve(small_config(tmp_path / "one", "--parallel.layout", "auto",
                                           *BUDGET), None, first_rank=False)
    single = [r["loss"] for r in run(cfg)]
    monkeypatch.delenv("WORLD_SIZE")
    assert len(single) == STEPS
    chosen = {}
    for world in (2, 4):
        result = run_ranks(_auto_and_hand, world, str(tmp_path))[0]
        chosen[world] = result["record"]["chosen"]["layout"]
        assert result["record"]["world"] == world
        # the same layout, seed and batch run the same arithmetic: identical losses
        assert result["auto"] == result["hand"], (world, chosen[world])
        # and any layout reproduces one process (fp32: reduction order over <= 4 ranks moves
        # a loss by a few ulps, far inside 1e-6 relative)
        assert result["auto"] == pytest.approx(single, rel=1e-6), chosen[world]
    assert len(set(chosen.values())) == 2  # not the one trivial layout everywhere


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_choice_is_printed_recorded_and_kept_on_resume(tmp_path, capsys):
    from safety_cases import SMALL, dirs

    run = tmp_path / "run"
    args = ["train", *SMALL, *dirs(run), "--parallel.layout", "auto", "--checkpoint.every", "1"]
    code, out, err = _cli(capsys, *args, "--train.steps", "1")
    assert code == 0, err
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("auto layout for 1 rank"))
    assert "GiB per rank (available memory / 1 local rank(s))" in lines[head]
    assert "no --hw-profile" in out  # a CPU without a profile says so
    chosen, runner = lines[head + 1].split(), lines[head + 2].split()
    assert chosen[0] == "chosen" and runner[0] == "runner-up"
    meta = json.loads((run / "ck" / "step_00000001" / "meta.json").read_text())
    record = meta["auto_layout"]
    assert record["chosen"]["layout"] == " ".join(chosen[1:7]).rstrip(":")
    assert f"step {record['chosen']['step_time_s']:.4g} s" in lines[head + 1]
    assert meta["config"]["parallel"]["mbs"] == record["fields"]["mbs"] == 1  # kept: SMALL's
    # the layout for a resume is the checkpoint's, printed as such
    code, out, err = _cli(capsys, *args, "--train.steps", "2")
    assert code == 0, err
    assert f"resuming with the layout the run started with, {record['chosen']['layout']}" in out
    # a new constraint it does not meet: one line says why it changes, and it chooses again
    code, out, err = _cli(capsys, *args, "--train.steps", "3", "--parallel.zero", "1")
    assert code == 0, err
    assert "chooses again: parallel.zero = 1 is set now and it has 0" in out
    meta = json.loads((run / "ck" / "step_00000003" / "meta.json").read_text())
    assert meta["auto_layout"]["fields"]["zero"] == 1


def test_every_pick_is_one_the_engine_runs_on_its_own_check(tmp_path):
    """The pick and runner-up of several runs, put to the engine's refusal key by key (the
    safety test's independent check, not the planner's filter)."""
    from test_safety import DENSE_TOML, MOE_TOML, _independent_refusal

    from fivefold.plan import auto_layout as planner
    from fivefold.plan.layout import Layout

    for name, toml, world, budget in (("moe", MOE_TOML, 4, 80.0),
                                      ("dense", DENSE_TOML, 4, 0.05)):
        (tmp_path / f"{name}.toml").write_text(toml.replace("[parallel]\n",
                                                            "[parallel]\nlayout = \"auto\"\n"))
        cfg = config.read(tmp_path / f"{name}.toml")
        for key in ("parallel.dp",):  # the example's own dp is a hand layout, not a constraint
            config.given_keys(cfg).discard(key)
        hw, assume = planner.auto_hardware(None, world, budget, None, on_cpu=False)
        pick = planner.choose(cfg, world, hw, assume, "bf16", "train.memory_budget_gib",
                              "test", on_cpu=False)
        assert pick.runner_up is not None
        for plan in (pick.best, pick.runner_up):
            fields = planner.record(dataclasses.replace(pick, best=plan))["fields"]
            lay = Layout(**dict(fields, pp_layers=tuple(fields["pp_layers"])))
            trial = planner.apply(cfg, plan, budget)
            assert _independent_refusal(trial, lay) is None, (name, lay.short())
            assert lay.world_size == world and plan.fits


def _pipeline_recompute(rank, world, root):
    """pp = 2 with per-layer recompute = auto against pp = 2 without recomputation."""
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.parallel.peak import PeakTracker
    from fivefold.train.trainer import Trainer

    out = {}
    for mode, extra in (("none", []), ("auto", ["--train.memory_budget_gib", BUDGET_PP])):
        cfg = small_config(Path(root) / mode, "--parallel.pp", "2", "--train.gbs", "4",
                           "--model.num_layers", "4", "--train.recompute", mode, *extra)
        with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
            losses = [trainer.train_step()["loss"]]
            with PeakTracker(trainer.peak_sources()) as tracker:
                losses.append(trainer.train_step()["loss"])
            policies = [c.label() for c in trainer.recompute_policies or []]
        out[mode] = (losses, tracker.peak, policies)
    return out


# GiB: between full recomputation's planned peak (0.00054) and none's (0.00064)
BUDGET_PP = "0.0006"


def test_recompute_auto_runs_under_a_pipeline(tmp_path):
    """The engine's recompute = auto under pp = 2 (what the auto search may now pick): each
    stage applies the plan of its pipeline rank, which changes no arithmetic (losses
    bit-identical to no recomputation), mixes choices under this budget, and keeps each
    rank's tracked peak under the budget (at this size a rank's peak is set by its weights
    and head more than by the layers' activations, so it is no lower than none's here)."""
    from fivefold.plan.inputs import training_plan_inputs
    from fivefold.plan.memory import minimum_budget

    cfg = small_config(tmp_path / "plan", "--parallel.pp", "2", "--train.gbs", "4",
                       "--model.num_layers", "4")
    work, layout = training_plan_inputs(cfg)
    work = dataclasses.replace(work, precision="fp32")
    assert minimum_budget(work, layout) < float(BUDGET_PP)
    ranks = run_ranks(_pipeline_recompute, 2, str(tmp_path))
    for rank in ranks:
        (none_losses, none_peak, _), (auto_losses, auto_peak, policies) = rank["none"], \
            rank["auto"]
        assert auto_losses == none_losses
        assert auto_peak <= min(float(BUDGET_PP) * 2**30, none_peak), (auto_peak, none_peak)
        assert len(policies) == 4 and len(set(policies)) > 1, policies
