"""`fivefold plan --config run.toml` plans the config's `train.optimizer` and the [optim] keys
its plan depends on: the same plan as `--optimizer` naming that optimizer, and not AdamW's."""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main

EXAMPLE = """[model]
preset = "llama-25m"
[parallel]
mbs = 4
dp = 2
zero = 1
[train]
gbs = 8
seq_len = 256
precision = "fp32"
device = "cpu"
"""


def _plan(capsys, tmp_path, optimizer: str, *args, optim: str = "") -> dict:
    path = tmp_path / f"{optimizer}.toml"
    path.write_text(EXAMPLE + f'optimizer = "{optimizer}"\n' + optim)
    assert main(["plan", "--config", str(path), *args, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def _memory(plan: dict) -> dict:
    return plan["layouts"][0]["stages"][0]["memory_bytes"]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adamw4bit", "adafactor", "muon",
                                       "sgd"])
def test_plan_config_is_plan_config_with_the_same_optimizer(optimizer, capsys, tmp_path):
    by_config = _plan(capsys, tmp_path, optimizer)
    named = _plan(capsys, tmp_path, optimizer, "--optimizer", optimizer)
    assert by_config == named
    assert by_config["workload"]["optimizer"] == optimizer
    adamw = _plan(capsys, tmp_path, optimizer, "--optimizer", "adamw")
    if optimizer != "adamw":  # what the config's optimizer holds, not AdamW's 8 B/param
        assert _memory(by_config)["optimizer"] < _memory(adamw)["optimizer"]


def test_plan_config_follows_the_optimizers_keys(capsys, tmp_path):
    """optim.muon_exclude moves matrices to AdamW (8 B instead of Muon's 4 B and no
    gather); optim.adafactor_factored = false keeps a whole second moment (4 B/param)."""
    muon = _memory(_plan(capsys, tmp_path, "muon"))
    fewer = _memory(_plan(capsys, tmp_path, "muon", optim='[optim]\nmuon_exclude = '
                          '"embed_tokens,lm_head,norm,router,mlp"\n'))
    assert fewer["optimizer"] > muon["optimizer"]
    assert fewer["comm_buffers"] < muon["comm_buffers"]  # the largest gathered: attention's
    factored = _memory(_plan(capsys, tmp_path, "adafactor"))
    whole = _memory(_plan(capsys, tmp_path, "adafactor",
                          optim="[optim]\nadafactor_factored = false\n"))
    assert whole["optimizer"] > 10 * factored["optimizer"]
