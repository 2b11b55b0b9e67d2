"""`fivefold bench` end to end on the tiny preset, beside transformers."""

import json

import pytest

from fivefold import cli


def test_bench_tiny_with_hf_peer_writes_a_record(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--model.preset", "tiny", "--data.tokenizer", "byte",
                     "--steps", "2", "--warmup", "1", "--peer", "hf", "--threads", "1",
                     "--train.gbs", "8", "--parallel.mbs", "4", "--train.seq_len", "64",
                     "--train.precision", "fp32", "--train.device", "cpu", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "fivefold step   2/2" in text and "transformers step   2/2" in text  # progress
    assert "fivefold / transformers tokens/s" in text
    record = json.loads(out.read_text())
    assert record["model"]["name"] == "tiny" and record["run"]["precision"] == "fp32"
    assert record["git_revision"] and record["machine"]["torch"]
    ours, theirs = record["engines"]["fivefold"], record["engines"]["transformers"]
    for engine in (ours, theirs):
        assert engine["tokens_per_s"] > 0 and engine["steps_timed"] == 2
        assert set(engine["step_parts_s"]) == {"forward", "backward", "optimizer",
                                               "grad_sync_wait"}
        assert engine["memory"]["peak_allocated_bytes"] > 0
    # Same weights, batches and optimizer: the same losses (fp32), and the ratio is theirs.
    assert len(ours["losses"]) == 3
    for a, b in zip(ours["losses"], theirs["losses"]):
        assert abs(a - b) / b <= 1e-5
    assert record["ratio_tokens_per_s"] == pytest.approx(
        ours["tokens_per_s"] / theirs["tokens_per_s"])
    assert record["ratio_tokens_per_cpu_s"] == pytest.approx(
        ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"])
    assert len(record["ratio_by_round"]) == 1 and record["ratio_by_round"][0] > 0
    assert "per CPU-second" in text
    # The planner's peak beside the measured one: within 10% on this model.
    planned = record["planned"]["peak_bytes"]
    assert abs(ours["memory"]["peak_allocated_bytes"] - planned) <= 0.10 * planned


def test_bench_bad_input_is_one_line(capsys):
    assert cli.main(["bench", "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --steps = 0 must be >= 1"
    assert cli.main(["bench", "--peer", "hf", "--train.precision", "fp16",
                     "--train.device", "cpu"]) == 2
    assert "set train.precision to fp32 or bf16" in capsys.readouterr().err
