"""Through the real launcher: torch elastic restarts a job whose rank was killed, and the
run resumes by itself (checkpoint.resume = auto) to the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# The tests' model: the byte tokenizer with tiny's vocabulary, one sequence per micro-batch.
SMALL = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "2", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "32",
         "--train.gbs", "8", "--train.warmup_steps", "0", "--train.eval_every", "0",
         "--train.precision", "fp32", "--train.device", "cpu", "--log.progress", "false",
         "--log.tensorboard", "false", "--checkpoint.every", "1"]
# A survivor names a killed peer once it has been silent three heartbeat intervals and then a
# confirmation window (parallel/watchdog.py: interval timeout_s / 20, window max(5 intervals,
# min(timeout_s / 2, 2 s))): up to 12 s a kill at 30 s, 4 s at 10 s, and three of the five
# kills wait it out (rank 0 hosts the store: its loss is seen at once). The job's collectives
# take well under 10 s (the timeout test below runs its first steps at 5 s).
TIMEOUT_S = "10"
# torchrun's shared rendezvous store keeps the last attempt's keys: a restarted worker can be
# handed its dead peer's address (pytorch/pytorch#135712). Not sharing it avoids that.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").open())
            if r["kind"] == "train"]


def start_reference(out: Path, steps: int) -> subprocess.Popen:
    """The uninterrupted one-process run, started beside the job: it runs while the job's
    ranks wait out a lost peer or restart (`reference` collects it)."""
    return subprocess.Popen([sys.executable, "-m", "fivefold.cli", "train", *SMALL,
                             "--train.steps", str(steps), "--checkpoint.dir", str(out / "ck"),
                             "--log.dir", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def reference(proc: subprocess.Popen, out: Path) -> list[tuple[int, float]]:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return losses(out)


def torchrun(out: Path, steps: int, *launcher: str, faults: str = "") -> subprocess.Popen:
    args = [*SMALL, "--train.steps", str(steps), "--parallel.dp", "2", "--parallel.zero", "1",
            "--parallel.timeout_s", TIMEOUT_S, "--checkpoint.dir", str(out / "ck"),
            "--log.dir", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--monitor-interval=0.2", *launcher, str(HERE / "fault_worker.py"),
           faults or "none:-1:0", "--", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)


def survivors_named(err: str) -> list[bool]:
    """Per killed rank, in order: did the survivor's words, between this kill and the next,
    name it ("lost rank R")? With dp 2 the one other rank is the survivor and the killed
    rank says nothing more; attempt k's lines all precede attempt k+1's kill, as the restart
    waits for every worker of the attempt to end."""
    attempts = re.split(r"fault_worker: SIGKILL rank (\d+)\n", err)[1:]
    return [f"lost rank {victim}" in lines
            for victim, lines in zip(attempts[0::2], attempts[1::2])]


def same(ours, ref) -> bool:
    return [s for s, _ in ours] == [s for s, _ in ref] and all(
        abs(a - b) <= 1e-6 * b for (_, a), (_, b) in zip(ours, ref))


@pytest.mark.slow
def test_killed_ranks_restart_and_resume_to_the_uninterrupted_losses(tmp_path):
    """One SIGKILL per attempt under --max-restarts 5 (dp 2, ZeRO-1): in the forward, the
    backward, entering the gradient reduction, entering the optimizer step, and after writing
    a checkpoint's data but before publishing it. Each restart resumes from the newest
    complete checkpoint; the last attempt finishes; metrics.jsonl holds each step once, with
    the losses of an uninterrupted one-process run (fp32, ≤ 1e-6 relative)."""
    steps = 7
    faults = "forward:1:2,backward:0:3,reduction:1:4,optimizer:0:5,save:1:6"
    job = torchrun(tmp_path / "job", steps, "--max-restarts=5", faults=faults)
    ref = start_reference(tmp_path / "reference", steps)
    try:
        out, err = job.communicate(timeout=900)
        assert job.returncode == 0, err[-4000:]
        assert err.count("fault_worker: SIGKILL") == 5, err[-4000:]
        assert "terminate called" not in err
        # Every survivor names the rank that was killed, each attempt (dp 2: one survivor each).
        assert survivors_named(err) == [True] * 5, err[-4000:]
        ck = tmp_path / "job" / "ck"
        assert (ck / "latest").read_text() == f"step_{steps:08d}"
        assert not list(ck.glob("*.tmp"))  # the interrupted save was cleared by a later one
        assert same(losses(tmp_path / "job"), reference(ref, tmp_path / "reference"))
    finally:
        for proc in (job, ref):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow  # waits out a 5 s timeout under torchrun: about 35 s
def test_a_collective_timing_out_with_every_rank_alive_names_the_key(tmp_path):
    """Rank 1 sleeps 10 s before step 2 (its heartbeat goes on) under parallel.timeout_s = 5:
    gloo times the collective out. Before: a raw gloo error and exit 4 (or "lost no silent
    peer found", exit 3); now one line naming parallel.timeout_s, exit 1, no traceback."""
    out = tmp_path / "slow"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--monitor-interval=0.2", str(HERE / "fault_worker.py"), "slow:1:2", "--",
           *SMALL, "--parallel.timeout_s", "5", "--train.steps", "3", "--parallel.dp", "2",
           "--checkpoint.dir", str(out / "ck"), "--log.dir", str(out)]
    job = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert job.returncode != 0
    lines = [ln for ln in job.stderr.splitlines() if ln.startswith("error: ")]
    # The rank whose collective timed out names the key; its peer, finding it gone, may name
    # it as lost (the store it hosted went with it).
    timed_out = [ln for ln in lines if "every rank alive" in ln]
    assert timed_out and all("parallel.timeout_s = 5.0" in ln for ln in timed_out), \
        job.stderr[-3000:]
    assert "exit 4" not in job.stderr and " failed with RuntimeError" not in job.stderr
