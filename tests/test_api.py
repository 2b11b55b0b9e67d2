"""The library API: the README's example runs as written, and a trainer fed the built-in
loader's own batches reproduces `fivefold train`'s engine loss for loss."""

from __future__ import annotations

import json
import re
import runpy
import threading
from pathlib import Path

import pytest
import torch
from common import small_config

import fivefold
from fivefold.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## Library API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    code = readme_example()
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 15
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "example.py"
    script.write_text(code)
    scope = runpy.run_path(str(script))
    out = capsys.readouterr().out
    assert "saved runs/api/ck/step_00000005" in out, out
    assert [r["step"] for r in scope["records"]] == [6, 7, 8]  # resumed from the save
    logged = [json.loads(line) for line in (tmp_path / "runs/api/metrics.jsonl").open()]
    assert [r["step"] for r in logged if r["kind"] == "train"] == [6, 7, 8]
    assert (tmp_path / "runs/api/ck/latest").read_text() == "step_00000008"
    assert not any(t.name == "fivefold-watchdog" for t in threading.enumerate())


def test_api_trainer_matches_the_engine_on_the_same_batches(tmp_path):
    """Batches taken from the config's own loader, handed to fivefold.Trainer: the losses
    and gradient norms are the engine's, exactly (same seed, same batches, fp32)."""
    from fivefold.train.trainer import Trainer as Engine

    cfg = small_config(tmp_path, "--parallel.mbs", "2")
    with Engine(cfg, quiet=True) as engine:
        batches = []
        for _ in range(3):
            micro = engine.loader.next_batch()
            batches.append((torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])))
        engine.loader.reset()
        expect = [engine.train_step() for _ in range(3)]
    api_cfg = small_config(tmp_path / "api", "--parallel.mbs", "2")
    with fivefold.Trainer(api_cfg, data=batches) as trainer:
        got = [trainer.step() for _ in range(3)]
        with pytest.raises(StopIteration):
            trainer.step()
    assert [g["loss"] for g in got] == [e["loss"] for e in expect]
    assert [g["grad_norm"] for g in got] == [e["grad_norm"] for e in expect]


def test_api_rejects_bad_batches_and_bad_keys(tmp_path):
    with pytest.raises(ConfigError, match="train.lrr"):
        fivefold.Trainer(small_config(tmp_path), train={"lrr": 1.0})
    with fivefold.Trainer(small_config(tmp_path)) as trainer:
        bad = torch.zeros(3, 5, dtype=torch.long)
        with pytest.raises(ConfigError, match=r"\(train.gbs, train.seq_len\) = \(4, 32\)"):
            trainer.step((bad, bad))
