"""What a run says about itself: settings that change nothing get one note, recompute = auto
prints the plan it chose, a prepared file says how many bytes were not UTF-8, and the step
line's memory is the peak allocated bytes the plan predicts (RSS, on a CPU, labelled as
such; no MFU where there is no peak to divide by)."""

from __future__ import annotations

import pytest
from common import small_config

from fivefold.cli import main
from fivefold.train.loop import _fmt, compare_states, layout_notes, recompute_line

pytestmark = pytest.mark.usefixtures("one_thread")

REC = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0}


def test_step_line_memory_and_mfu():
    cpu = _fmt({**REC, "mfu": None, "memory_bytes": 3 * 2**30 // 2,
                "peak_allocated_bytes": 111.26 * 2**20})
    assert "peak 111.26 MiB allocated, rss 1.50 GiB" in cpu
    assert "mfu" not in cpu and " mem " not in cpu
    untracked = _fmt({**REC, "mfu": None, "memory_bytes": 2**29, "peak_allocated_bytes": None})
    assert untracked.endswith("rss 512.00 MiB") and "allocated" not in untracked
    gpu = _fmt({**REC, "mfu": 0.4, "memory_bytes": 2**31, "peak_allocated_bytes": 2**31,
                "memory_reserved_bytes": 2**32})
    assert "mfu 40.0%" in gpu and "peak 2.00 GiB allocated" in gpu and "rss" not in gpu


def test_nvme_names_the_staging_slots():
    planned = {"params": 1.0, "grads": 1.0, "master": 0.0, "optimizer": 0.0}
    measured = {**planned, "optimizer": 24.0 * 2**20}
    line = compare_states(planned, measured, nvme=True)
    assert "optimizer (NVMe files; in memory: 2 staging slots) 0.00/24.00" in line
    assert "optimizer 0.00/24.00" in compare_states(planned, measured)  # other tiers: as was


def test_cpu_steps_report_the_tracked_peak(tmp_path):
    from fivefold.train.trainer import Trainer

    cfg = small_config(tmp_path, "--parallel.zero", "3")
    assert any("nothing is sharded" in n and "parallel.zero = 3" in n
               for n in layout_notes(cfg))
    assert layout_notes(small_config(tmp_path)) == []
    trainer = Trainer(cfg)  # a logging run tracks its first two steps' peak
    first, second, third = (trainer.train_step() for _ in range(3))
    assert 0 < first["peak_allocated_bytes"] <= second["peak_allocated_bytes"]
    assert third["peak_allocated_bytes"] == second["peak_allocated_bytes"]  # steady state
    assert second["peak_allocated_bytes"] < second["memory_bytes"]  # RSS holds far more
    quiet = Trainer(small_config(tmp_path / "q"), quiet=True)
    assert quiet.train_step()["peak_allocated_bytes"] is None


def test_recompute_auto_line_names_every_layer(tmp_path):
    from fivefold.plan.recompute_auto import config_plan

    cfg = small_config(tmp_path, "--train.recompute", "auto", "--train.memory_budget_gib",
                       "0.01")
    policies = config_plan(cfg)
    line = recompute_line(cfg, policies)
    assert line.startswith("recompute auto under 0.01 GiB, per layer: ")
    counts = [int(part.split("×")[0]) for part in line.split(": ", 1)[1].split("; ")]
    assert sum(counts) == len(policies) == 2


def test_prepare_counts_bytes_that_are_not_utf8(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(b"hello \xff\xfe world \xc3 fine\n")
    assert main(["prepare", str(text), "-o", str(tmp_path / "t.bin")]) == 0
    out = capsys.readouterr().out
    assert f"note: {text}: 3 bytes are not valid UTF-8" in out
    clean = tmp_path / "c.txt"
    clean.write_text("plain text\n")
    assert main(["prepare", str(clean), "-o", str(tmp_path / "c.bin")]) == 0
    assert "not valid UTF-8" not in capsys.readouterr().out


def test_plan_gpus_0_names_only_gpus(capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--gpus 0 must be >= 1" in err and "--seq-len" not in err
