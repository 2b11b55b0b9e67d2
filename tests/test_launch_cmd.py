"""`fivefold launch`: torchrun's launcher with the environment a fivefold run needs.

A bad launch or config is one line before any rank starts; torchrun's arguments are the
documented ones; under --max-restarts a run whose rank is killed restarts, resumes from its
newest checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.launch import build_parser, torchrun_argv

SMALL = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "2", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "32",
         "--train.gbs", "8", "--train.warmup_steps", "0", "--train.eval_every", "0",
         "--train.precision", "fp32", "--train.device", "cpu", "--log.progress", "false",
         "--log.tensorboard", "false"]


def test_bad_launches_are_one_line_before_any_rank_starts(tmp_path, capsys):
    cases = [
        (["launch", "train", "--train.steps", "many"], "train.steps"),
        (["launch", "--nnodes", "2", "train"], "--rdzv-endpoint"),
        (["launch", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2", "train"],
         "--node-rank 2"),
        (["launch", "--nnodes", "2", "--rdzv-endpoint", "h:1", "train", "--parallel.dp", "3",
          "--train.gbs", "3"],
         "do not split evenly"),
        (["launch", "--max-restarts", "-1", "train"], "--max-restarts -1"),
    ]
    for argv, words in cases:
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and words in err, (argv, err)
    assert not any(tmp_path.iterdir())


def test_the_launcher_accepts_the_rank_counts_a_layout_takes():
    """--nproc-per-node given is checked against the layout once, in the launcher; the counts
    a layout takes pass (the refusals: tests/safety_cases.py's launch cases)."""
    from fivefold.launch import layout_world_size

    assert layout_world_size("train", [*SMALL, "--parallel.dp", "2"], 2, 1) == 2
    assert layout_world_size("train", [*SMALL, "--parallel.dp", "4"], 4, 2) == 4
    assert layout_world_size("train", [*SMALL, "--parallel.layout", "auto"], 2, 2) == 2
    assert layout_world_size("train", [*SMALL, "--parallel.layout", "auto"], 4, 2) == 4
    assert layout_world_size("serve", ["--hf", "x", "--tp", "2"], 2, 2) == 2
    # serve --pp N --tp M: N stages of M ranks
    assert layout_world_size("serve", ["--hf", "x", "--pp", "2"], 2, 2) == 2
    assert layout_world_size("serve", ["--hf", "x", "--pp", "2", "--tp", "2"], 4, 4) == 4
    from fivefold.errors import ConfigError

    with pytest.raises(ConfigError, match="starts 2 rank.* --pp 2 --tp 2 uses 4; give "
                                          "--nproc-per-node 4"):
        layout_world_size("serve", ["--hf", "x", "--pp", "2", "--tp", "2"], 2, 2)


def test_the_launch_is_torchruns_documented_one():
    one = build_parser().parse_args(["--max-restarts", "3", "train", "--parallel.dp", "2"])
    assert torchrun_argv(one, 2) == [
        "--nproc-per-node=2", "--nnodes=1", "--max-restarts=3", "--monitor-interval=0.5",
        "--standalone", "-m", "fivefold.cli", "train", "--parallel.dp", "2"]
    nodes = build_parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                                       "head:29500", "--rdzv-id", "job7", "train"])
    assert torchrun_argv(nodes, 4) == [
        "--nproc-per-node=4", "--nnodes=2", "--max-restarts=0", "--monitor-interval=0.5",
        "--rdzv-backend=c10d", "--rdzv-endpoint=head:29500", "--rdzv-id=job7",
        "--node-rank=1", "-m", "fivefold.cli", "train"]


def _workers(launcher: int) -> list[int]:
    """The launcher's child processes (torchrun's agent runs in the launcher itself)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


def _latest_step(ck: Path) -> int:
    try:
        return int((ck / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


@pytest.mark.slow  # two torchrun attempts: about 45 s on two shared cores
def test_max_restarts_restarts_a_killed_rank_and_the_run_finishes(tmp_path):
    """dp 2 under `fivefold launch --max-restarts 1`: one worker is SIGKILLed once step 3 is
    saved; the restart resumes from a saved step and the run ends at train.steps with exit
    0 and each step once in metrics.jsonl. Bounded: 300 s for the whole job."""
    steps, out = 40, tmp_path / "run"
    # The survivor names its killed peer after three heartbeat intervals and a confirmation
    # window, both set by parallel.timeout_s (parallel/watchdog.py): 4 s at 10 s, 12 s at 30 s.
    cmd = [sys.executable, "-m", "fivefold.cli", "launch", "--max-restarts", "1",
           "--monitor-interval", "0.2", "train", *SMALL, "--parallel.timeout_s", "10",
           "--parallel.dp", "2",
           "--train.steps", str(steps), "--checkpoint.every", "1",
           "--checkpoint.dir", str(out / "ck"), "--log.dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**env, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    killed = None
    try:
        while killed is None and time.monotonic() < deadline and job.poll() is None:
            if _latest_step(out / "ck") >= 3 and len(_workers(job.pid)) == 2:
                killed = _workers(job.pid)[-1]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        stdout, stderr = job.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        job.kill()
    assert killed is not None, "the run ended before a worker could be killed"
    assert job.returncode == 0, stderr[-3000:]
    # The restarted attempt resumed from a saved step >= 3 and trained only the rest.
    done = re.search(r"done: (\d+) steps", stdout)
    assert done and int(done.group(1)) <= steps - 3, stdout[-2000:]
    assert _latest_step(out / "ck") == steps
    logged = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").open())
              if r["kind"] == "train"]
    assert logged == list(range(1, steps + 1))


def test_sigterm_to_the_launcher_stops_every_rank_at_a_checkpoint(tmp_path):
    """SIGTERM to `fivefold launch` (a scheduler's stop): torchrun's agent passes it to both
    ranks, which stop together at a step boundary after a checkpoint; the launcher ends 143
    with one line, as `fivefold train` itself does (train/lifecycle.py), not 4."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fivefold.cli", "launch", "--monitor-interval", "0.2",
           "train", *SMALL, "--parallel.timeout_s", "30", "--parallel.dp", "2",
           "--train.steps", "100000",
           "--checkpoint.every", "1", "--checkpoint.dir", str(out / "ck"), "--log.dir", str(out)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and job.poll() is None and _latest_step(out / "ck") < 2:
            time.sleep(0.05)
        assert job.poll() is None, "the run ended before it could be stopped"
        job.send_signal(signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        job.kill()
    assert job.returncode == 143, stderr[-3000:]
    assert "fivefold launch: stopped by SIGTERM" in stderr, stderr[-3000:]
    assert re.search(r"stopped by SIGTERM after step (\d+); checkpoint", stderr), stderr[-3000:]
    assert _latest_step(out / "ck") >= 2
