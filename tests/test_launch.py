"""End to end through the real launcher: torchrun starts fivefold train on 2 and 8 ranks."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tolerances import loss_rtol, trained_rtol, within

from fivefold.cli import main
from fivefold.data.dataset import corpus_files

WORD = re.compile(r"[A-Za-z']+")

# The tests' model: the byte tokenizer with tiny's vocabulary, one sequence per micro-batch.
SMALL = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "4", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "32",
         "--train.gbs", "8", "--train.steps", "4", "--train.warmup_steps", "0",
         "--train.eval_every", "0", "--train.precision", "fp32", "--train.device", "cpu",
         "--log.progress", "false", "--log.tensorboard", "false"]


def train(tmp_path, name, nproc, *layout):
    out = tmp_path / name
    args = ["train", *SMALL, *layout, "--checkpoint.dir", str(out / "ck"), "--log.dir", str(out)]
    if nproc == 1:
        cmd = [sys.executable, "-m", "fivefold.cli", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "fivefold.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:  # show the ranks' own errors, not only the launcher's summary
        lines = [ln for ln in proc.stderr.splitlines() if "Warning" not in ln and "warn(" not in ln]
        raise AssertionError("\n".join(lines[:60]))
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


# tests/tolerances.py at SMALL's sizes: 8 sequences of 32 tokens, 4 blocks of 3 GEMMs.
LOSS_RTOL = loss_rtol(tokens=8 * 32, depth=3 * 4)
TRAINED_RTOL = trained_rtol(tokens=8 * 32, depth=3 * 4)


def assert_same_run(ours, reference, tol):
    assert [r["step"] for r in ours] == [r["step"] for r in reference]
    for a, b in zip(ours, reference):
        assert within(abs(a["loss"] - b["loss"]) / b["loss"], tol, "torchrun"), \
            (a["step"], a["loss"], b["loss"])
        assert within(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"], TRAINED_RTOL,
                      "torchrun")


@pytest.mark.slow
@pytest.mark.parity
def test_torchrun_world_2_and_8_match_one_process(tmp_path):
    """dp 2 (ZeRO-2) and dp 2 × tp 2 × pp 2 (ZeRO-1, 1F1B) reproduce the one-process run
    (fp32: loss ≤ LOSS_RTOL, gradient norm ≤ TRAINED_RTOL relative)."""
    reference = train(tmp_path, "single", 1)
    assert_same_run(train(tmp_path, "dp2", 2, "--parallel.dp", "2", "--parallel.zero", "2"),
                    reference, LOSS_RTOL)
    assert_same_run(train(tmp_path, "3d", 8, "--parallel.dp", "2", "--parallel.tp", "2",
                          "--parallel.pp", "2", "--parallel.zero", "1", "--parallel.mbs", "2"),
                    reference, LOSS_RTOL)


def run_while_it_progresses(argv: list[str], cwd: Path, metrics: Path,
                            stall_s: float = 600.0) -> tuple[int, str]:
    """Run a training command to its end, however slow the machine; stop it only when its
    metrics file has not grown for `stall_s` seconds (a hang, not a slow step: the default
    job logs every 10 steps). (exit code, stderr)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        size, last = -1, time.monotonic()
        while proc.poll() is None:
            now_size = metrics.stat().st_size if metrics.exists() else 0
            if now_size != size:
                size, last = now_size, time.monotonic()
            if time.monotonic() - last > stall_s:
                proc.kill()
                proc.wait()
                pytest.fail(f"no metrics for {stall_s:.0f} s: the run hangs")
            time.sleep(1.0)
        err.seek(0)
        return proc.returncode, err.read()


@pytest.mark.slow
def test_default_job_learns_and_generates(tmp_path, monkeypatch, capsys):
    """The README's main job with its built-in defaults (only the output moved to tmp_path):
    the loss falls by at least 40% from its first value, and what the checkpoint generates
    with the command's default sampling is mostly words that occur in the corpus (measured:
    0.77-0.98 of the words of a 100-token sample for seeds 0-4, 0.91 over seeds 0-2; the
    byte-level job this replaced gave 0.58-0.83 with the same sampling, on fewer words).
    """
    code, err = run_while_it_progresses([sys.executable, "-m", "fivefold.cli", "train"],
                                        tmp_path, tmp_path / "runs/default/metrics.jsonl")
    assert code == 0, err[-2000:]
    records = [json.loads(line) for line in (tmp_path / "runs/default/metrics.jsonl").open()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 450 and losses[-1] <= 0.6 * losses[0], (losses[0], losses[-1])
    corpus_words = {w.lower() for f in corpus_files() for w in WORD.findall(f.read_text())}
    words = []
    # The command's entry point in this process: the same sampling and output as
    # `fivefold generate`, without starting and importing torch three times over.
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for seed in range(3):
        code = main(["generate", "--checkpoint", "runs/default/checkpoints", "--prompt",
                     "ROMEO:", "--max-new-tokens", "100", "--seed", str(seed)])
        gen = capsys.readouterr()
        assert code == 0 and gen.out.startswith("ROMEO:"), gen.err[-2000:]
        words += WORD.findall(gen.out[len("ROMEO:"):])
    real = sum(w.lower() in corpus_words for w in words) / len(words)
    assert len(words) >= 100 and real >= 0.8, (real, " ".join(words))
