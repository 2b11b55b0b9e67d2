"""A user's work is safe: run directories, checkpoints and outputs survive every mistake.

Each test drives the command line (in-process through `fivefold.cli.main`, which is what the
`fivefold` script calls) the way a user meets the problem. One completed tiny run is made
once and copied by the tests that change it.
"""

import os
import shutil
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
    code, _, err = cli(capsys, "train", *SMALL, "--train.steps", "6", *dirs(run_copy),
                       "--checkpoint.resume", "latest")
    line = one_line(err)
    assert code == 2 and "step_00000004 is damaged" in line and "checksum" in line, line
    assert f"newest good one before it is {ck / 'step_00000002'}" in line, line

    code, _, err = cli(capsys, "generate", "--checkpoint", ck, "--prompt", "hi")
    assert code == 2 and "step_00000004 is damaged" in one_line(err)

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
