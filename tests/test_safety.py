"""A user's work is safe: run directories, checkpoints and outputs survive every mistake.

Each test drives the command line (in-process through `fivefold.cli.main`, which is what the
`fivefold` script calls) the way a user meets the problem. One completed tiny run is made
once and copied by the tests that change it.
"""

import os
import shutil
from pathlib import Path

import pytest

from fivefold.cli import main

SMALL = ["--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "2", "--train.seq_len", "32", "--train.gbs", "4", "--train.eval_every", "0",
         "--train.warmup_steps", "0", "--train.device", "cpu", "--log.progress", "false",
         "--log.tensorboard", "false"]


def dirs(run: Path) -> list[str]:
    return ["--checkpoint.dir", str(run / "ck"), "--log.dir", str(run)]


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
            if p.is_file() and p.name != "train.lock"}


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
