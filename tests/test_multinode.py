"""Two torchrun "nodes" on loopback (c10d rendezvous on 127.0.0.1) train a 3-D layout and
reproduce the one-process run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from tolerances import loss_rtol, trained_rtol, within

# The tests' model: the byte tokenizer with tiny's vocabulary, one sequence per micro-batch.
SMALL = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "4", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "32",
         "--train.gbs", "8", "--train.steps", "3", "--train.warmup_steps", "0",
         "--train.eval_every", "0", "--train.precision", "fp32", "--train.device", "cpu",
         "--log.progress", "false", "--log.tensorboard", "false"]
LAYOUT = ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero",
          "1", "--parallel.mbs", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


@pytest.mark.slow
@pytest.mark.parity
def test_two_nodes_on_loopback_match_one_process(tmp_path):
    """dp 2 × tp 2 × pp 2 over two 4-rank "nodes" (fp32): loss and gradient norm within
    tests/tolerances.py's bounds of the one-process run; both launchers exit 0."""
    out = tmp_path / "two_nodes"
    args = ["-m", "fivefold.cli", "train", *SMALL, *LAYOUT, "--checkpoint.dir", str(out / "ck"),
            "--log.dir", str(out)]
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         "4", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--rdzv-id", "loopback", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for node in (0, 1)]
    results = [node.communicate(timeout=900) for node in nodes]
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
        assert "terminate called" not in err
    ref_dir = tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", *SMALL,
                           "--checkpoint.dir", str(ref_dir / "ck"), "--log.dir", str(ref_dir)],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, reference = records(out), records(ref_dir)
    assert [r["step"] for r in ours] == [r["step"] for r in reference] == [1, 2, 3]
    for a, b in zip(ours, reference):
        # tests/tolerances.py at SMALL's sizes: 8 sequences of 32 tokens, 4 blocks of 3 GEMMs.
        assert within(abs(a["loss"] - b["loss"]) / b["loss"], loss_rtol(8 * 32, 3 * 4),
                      "two nodes"), (a["loss"], b["loss"])
        assert within(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"],
                      trained_rtol(8 * 32, 3 * 4), "two nodes")
    assert (out / "ck" / "latest").read_text() == "step_00000003"
