"""A user's work is safe: run directories, checkpoints and outputs survive every mistake.

Each test drives the command line (in-process through `fivefold.cli.main`, which is what the
`fivefold` script calls) the way a user meets the problem. One completed tiny run is made
once and copied by the tests that change it.
"""

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from safety_cases import SMALL, cases, dirs, make_world

from fivefold.cli import main


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A completed 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("finished") / "run"
    code = main(["train", *SMALL, "--train.steps", "4", "--checkpoint.every", "2", *dirs(run)])
    assert code == 0
    assert (run / "ck" / "latest").read_text() == "step_00000004"
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file()}


# --- 3. checkpoint integrity -------------------------------------------------------------
def test_damaged_checkpoints_are_one_line_naming_the_newest_good_one(run_copy, capsys):
    ck = run_copy / "ck"
    shutil.copytree(ck / "step_00000004", run_copy / "spare")  # a good copy, for later
    shard = next((ck / "step_00000004").glob("*.distcp"))
    with open(shard, "r+b") as f:  # 4 KB of random bytes inside the shard, size unchanged
        f.seek(100)
        f.write(os.urandom(4096))
    code, _, err = cli(capsys, "generate", "--checkpoint", ck / "step_00000004", "--prompt", "x")
    line = one_line(err)
    assert code == 2 and "step_00000004 is damaged" in line and "checksum" in line, line
    assert f"newest good one before it is {ck / 'step_00000002'}" in line, line

    os.truncate(next((ck / "step_00000002").glob("*.distcp")), 5000)
    code, _, err = cli(capsys, "generate", "--checkpoint", ck / "step_00000002", "--prompt", "x")
    line = one_line(err)
    assert code == 2 and "is 5000 bytes but" in line and "no good checkpoint" in line, line

    (run_copy / "spare").rename(ck / "step_00000003")
    shutil.rmtree(ck / "step_00000004")
    shutil.copytree(ck / "step_00000003", ck / "step_00000004")
    (ck / "step_00000004" / ".metadata").unlink()
    code, _, err = cli(capsys, "convert", "--checkpoint", ck / "step_00000004", "--to-hf",
                       run_copy / "hf")
    line = one_line(err)
    assert code == 2 and ".metadata is missing" in line and "step_00000003" in line, line
    assert not (run_copy / "hf").exists()


# --- the sweep: every command, one line each, the completed run untouched ----------------
@pytest.fixture(scope="module")
def world(finished_run, tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("world"), finished_run)


def test_bad_input_sweep(world, capsys):
    """Every case: the expected exit code, one line on stderr holding the expected words, no
    traceback, and the completed run's checkpoints and metrics byte-identical afterwards."""
    all_cases = cases(world)
    assert len(all_cases) >= 60
    before = snapshot(world["run"])
    failures = []
    for name, argv, want_code, want_text in all_cases:
        code, _, err = cli(capsys, *argv)
        lines = err.strip().splitlines()
        if code != want_code or len(lines) != 1 or want_text not in lines[0] or (
                "Traceback" in err):
            failures.append((name, code, err.strip()[:300]))
        if snapshot(world["run"]) != before:
            failures.append((name, "changed the completed run", ""))
            before = snapshot(world["run"])
    assert not failures, failures
    assert not (world["root"] / "fresh").exists()  # no bad input made its run directory


def train(capsys, run: Path, *args) -> tuple[int, str, str]:
    return cli(capsys, "train", *SMALL, *dirs(run), *args)


def steps_in(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "ck").iterdir())


# --- 1. a run directory holding a run ------------------------------------------------------
def test_rerun_is_refused_retention_keeps_this_runs_steps_and_overwrite_replaces(
        run_copy, capsys):
    before = snapshot(run_copy)
    code, _, err = train(capsys, run_copy, "--train.steps", "50", "--checkpoint.resume", "never")
    assert code == 2 and "--overwrite" in one_line(err) and snapshot(run_copy) == before
    # Resumed from the older step 2: what this run writes is kept, the later step 4 alone.
    code, out, err = train(capsys, run_copy, "--train.steps", "3", "--checkpoint.every", "1",
                           "--checkpoint.resume", str(run_copy / "ck" / "step_00000002"))
    assert code == 0, err
    assert steps_in(run_copy) == ["latest", "step_00000002", "step_00000003", "step_00000004"]
    assert (run_copy / "ck" / "latest").read_text() == "step_00000003"
    code, out, err = cli(capsys, "generate", "--checkpoint", run_copy / "ck", "--prompt", "hi",
                         "--max-new-tokens", "3")
    assert code == 0 and out.startswith("hi"), err
    code, out, err = train(capsys, run_copy, "--train.steps", "1", "--overwrite")
    assert code == 0, err
    assert "--overwrite: removed 3 checkpoints" in out and "done: 1 step in" in out
    assert steps_in(run_copy) == ["latest", "step_00000001"]
    records = [json.loads(line) for line in (run_copy / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1]


# --- 2. non-finite training ----------------------------------------------------------------
def test_nonfinite_weights_are_never_saved(run_copy, capsys):
    """Whatever makes the weights non-finite, a save refuses them and keeps the good steps."""
    import torch
    from common import small_config

    from fivefold.train.trainer import NonFiniteError, Trainer

    cfg = small_config(run_copy, "--checkpoint.dir", str(run_copy / "ck"), "--checkpoint.resume",
                       "latest")
    trainer = Trainer(cfg, quiet=True)
    with torch.no_grad():
        next(iter(trainer.model.named_parameters()))[1].fill_(float("nan"))
    trainer.step += 1
    before = snapshot(run_copy)
    with pytest.raises(NonFiniteError, match="hold NaN or inf"):
        trainer.save_checkpoint()
    assert snapshot(run_copy) == before


# --- 4, 7, 10: a resume after a crash: stale temporary, cut-off metrics line, new schedule -
def test_resume_after_a_crash_cleans_up_and_says_what_changed(run_copy, capsys):
    (run_copy / "ck" / "step_00000006.tmp").mkdir()
    (run_copy / "ck" / "step_00000006.tmp" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # the write a crash cut short
    code, out, err = train(capsys, run_copy, "--train.steps", "5", "--checkpoint.resume",
                           "latest")
    assert code == 0, err
    assert "removed" in out and "step_00000006.tmp, left by an interrupted save" in out
    assert not (run_copy / "ck" / "step_00000006.tmp").exists()
    assert "train.steps is 5 but the checkpoint's run planned 4" in out
    assert "dropped 1 unreadable line" in err
    records = [json.loads(line) for line in (run_copy / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]


# --- 7. one trainer per run directory ------------------------------------------------------
def test_a_second_trainer_on_a_run_directory_is_refused(run_copy, capsys):
    from fivefold.train.rundir import _DirLock

    held = _DirLock(run_copy)  # as a running trainer holds it (another open file: a conflict)
    try:
        before = snapshot(run_copy)
        code, _, err = train(capsys, run_copy, "--train.steps", "6", "--checkpoint.resume",
                             "latest")
        assert code == 2 and "in use by another running `fivefold train`" in one_line(err)
        assert snapshot(run_copy) == before
    finally:
        held.close()


# --- 8. anything unforeseen is one line; --debug shows the traceback; a lost rank is named -
def test_unforeseen_errors_are_one_line_with_a_debug_hint(tmp_path, capsys, monkeypatch):
    from fivefold.train.trainer import Trainer

    def broken_step(self):
        raise RuntimeError("something nobody planned for\nsecond line")

    monkeypatch.setattr(Trainer, "train_step", broken_step)
    code, _, err = train(capsys, tmp_path, "--train.steps", "2")
    line = one_line(err)
    assert code == 4 and "RuntimeError: something nobody planned for" in line
    assert "--debug" in line
    with pytest.raises(RuntimeError, match="nobody planned"):
        main(["train", *SMALL, *dirs(tmp_path / "again"), "--debug"])


# --- 6. optional dependencies --------------------------------------------------------------
def test_missing_optional_packages_name_their_extra(tmp_path, capsys, monkeypatch):
    (tmp_path / "x.jsonl").write_text('{"text": "hello"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = cli(capsys, "prepare", tmp_path / "x.jsonl", "-o", tmp_path / "x.bin")
    assert code == 2 and "pip install 'fivefold[data]'" in one_line(err)
    code, _, err = cli(capsys, "schedule", "--schedule", "1f1b", "--pp", "2", "--microbatches",
                       "4", "--out", tmp_path / "s.png")
    assert code == 2 and "pip install 'fivefold[plot]'" in one_line(err)
    code, out, err = cli(capsys, "plan", "--model", "tiny", "--gpus", "1", "--plot", tmp_path)
    assert code == 2 and "pip install 'fivefold[plot]'" in one_line(err) and not out
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "s.png").exists()


# --- 9. the planner recommends only what the engine runs -----------------------------------
MOE_TOML = """
[model]
preset = "tiny"
num_experts = 4
experts_top_k = 2
moe_intermediate_size = 128
aux_loss_coeff = 0.01
[parallel]
dp = 4
[train]
gbs = 16
seq_len = 128
"""


# A dense model whose config splits its own pipeline by hand: its pp_layers, pp_split and
# SP saved input hold for pp = 2 only, and must not follow a searched layout to pp = 1 or 4.
DENSE_TOML = """
[model]
preset = "tiny"
[parallel]
dp = 2
pp = 2
pp_layers = [1, 3]
sp_saved_input = "shard"
[train]
gbs = 16
seq_len = 128
"""


def _independent_refusal(cfg, layout):
    """What `fivefold train` says of this config run at `layout`, every layout field copied
    by hand (not through the planner's filter): None when it runs."""
    from fivefold import config

    trial = copy.deepcopy(cfg)
    for key in ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "schedule", "sp", "offload",
                "virtual_stages", "cp_comm", "pp_split"):
        setattr(trial.parallel, key, getattr(layout, key))
    trial.parallel.pp_layers = list(layout.pp_layers)
    trial.parallel.sp_saved_input = layout.sp_saved
    trial.train.recompute = layout.recompute
    return config.engine_refusal(trial)


@pytest.mark.parametrize("toml", [MOE_TOML, DENSE_TOML], ids=["moe", "dense-pp-layers"])
def test_plan_config_search_offers_exactly_the_layouts_train_accepts(tmp_path, capsys, toml):
    """Against the unfiltered list: every layout the search could rank is put to the engine's
    refusal independently; the search with the engine filter (`plan --config --search`)
    shows only accepted ones, and loses none: its fastest is the fastest accepted layout
    that fits, and every pipeline depth that has an accepted fitting layout is shown."""
    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.inputs import read_training_config, training_plan_inputs
    from fivefold.plan.layout import Layout
    from fivefold.plan.search import SearchSpace, enumerate_layouts

    (tmp_path / "c.toml").write_text(toml)
    cfg = read_training_config(tmp_path / "c.toml")
    work, _ = training_plan_inputs(cfg)
    hw, assume = get_hardware("h100")
    unfiltered = enumerate_layouts(work, 4, hw, SearchSpace())
    refusals = {lay: _independent_refusal(cfg, lay) for lay in unfiltered}
    accepted = [lay for lay, why in refusals.items() if why is None]
    assert accepted
    plans = [plan_layout(work, lay, hw, assume) for lay in accepted]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.time.total)
    code, out, err = cli(capsys, "plan", "--config", tmp_path / "c.toml", "--search",
                         "--top", "500", "--json")
    assert code == 0, err
    shown = json.loads(out)["layouts"]
    assert len(shown) > 10
    shown_layouts = []
    for entry in shown:
        fields = dict(entry["layout"], pp_layers=tuple(entry["layout"]["pp_layers"]))
        lay = Layout(**fields)
        assert lay in refusals, entry["layout_short"]  # one of the unfiltered layouts
        assert refusals[lay] is None, (entry["layout_short"], refusals[lay])
        shown_layouts.append(lay)
    assert shown[0]["step_time_s"] == pytest.approx(fitting[0].time.total, rel=1e-12)
    assert {p.layout.pp for p in fitting} == {lay.pp for lay in shown_layouts}


# --- 10. small things ----------------------------------------------------------------------
def test_help_version_and_usage(capsys):
    import dataclasses

    from fivefold import config
    from fivefold.config_keys import all_keys

    code, out, _ = cli(capsys, "train", "--help")
    assert code == 0
    keys = {k: (d, m) for k, d, m in all_keys()}
    for name in config.SECTIONS:
        for f in dataclasses.fields(config.section_class(name)):
            if f.name == "overrides":
                continue
            default, meaning = keys[f"{name}.{f.name}"]
            assert meaning, f"{name}.{f.name} has no meaning in train --help"
            assert f"  {name}.{f.name} = {default}" in out and meaning in out
    assert "  train.lr = 0.003" in out and "peak learning rate" in out
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.strip().startswith("fivefold 0.")
    code, out, err = cli(capsys)
    assert code == 2 and not out and err.startswith("usage: fivefold COMMAND")
    code, out, _ = cli(capsys, "help")
    assert code == 0 and out.startswith("usage: fivefold COMMAND") and "help COMMAND" in out


def test_every_option_says_what_it_does(capsys):
    """`fivefold help COMMAND` is COMMAND --help, and every option of these commands has help
    text (before: serve --port, generate --prompt, --max-new-tokens, --seed, plan --seq-len,
    quantize --calib-samples had none); plan --serve names the KV cache's dtype as serve does."""
    import argparse

    from fivefold.models.convert import build_parser as convert
    from fivefold.plan.cli_entry import build_parser as plan
    from fivefold.plan.serve import build_parser as plan_serve
    from fivefold.quant.cli import build_parser as quantize
    from fivefold.serve.openai.api_server import build_parser as serve
    from fivefold.train.generate import build_parser as generate

    for name, build in (("serve", serve), ("generate", generate), ("plan", plan),
                        ("quantize", quantize), ("convert", convert)):
        bare = [a.option_strings[0] for a in build()._actions if a.option_strings
                and a.help in (None, "") and a.help != argparse.SUPPRESS]
        assert not bare, (name, bare)
    code, out, _ = cli(capsys, "help", "generate")
    assert code == 0 and "--max-new-tokens" in out and "the text to continue" in out
    parser = plan_serve()
    assert parser.parse_args(["--model", "tiny", "--kv-cache-dtype", "fp8"]).kv_dtype == "fp8"
    assert parser.parse_args(["--model", "tiny", "--kv-dtype", "fp8"]).kv_dtype == "fp8"


def test_fresh_resume_memory_warning_and_prepare_overwrite(tmp_path, capsys, monkeypatch):
    from fivefold.train import rundir

    monkeypatch.setattr(rundir, "available_memory_bytes", lambda: 1024)
    code, out, err = train(capsys, tmp_path, "--train.steps", "1", "--checkpoint.resume",
                           "latest")
    assert code == 0, err
    assert "holds no checkpoint yet: starting fresh" in out and "done: 1 step in" in out
    assert "warning: the plan predicts a peak of" in err and "0.0 GiB is available" in err
    text = tmp_path / "t.txt"
    text.write_text("some words " * 50)
    assert cli(capsys, "prepare", text, "-o", tmp_path / "t.bin")[0] == 0
    first = (tmp_path / "t.bin").read_bytes()
    code, _, err = cli(capsys, "prepare", text, "-o", tmp_path / "t.bin")
    assert code == 2 and "already exists; pass --overwrite" in one_line(err)
    text.write_text("other words " * 50)
    assert cli(capsys, "prepare", text, "-o", tmp_path / "t.bin", "--overwrite")[0] == 0
    assert (tmp_path / "t.bin").read_bytes() != first
