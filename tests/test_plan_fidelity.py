"""Planner fidelity: stage splits shared with the engine, per-stage answers, SP's saved input.

Numbers in these tests are derived by hand from the cited sources, not from the planner."""

import json

import pytest

from fivefold.cli import main as cli_main
from fivefold.models.presets import preset
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.comm import ledger_volume
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.split import model_stage_layers, split_costs, stage_layer_counts


def test_even_split_spares_the_ends():
    assert stage_layer_counts(10, 4) == (2, 3, 3, 2)
    assert stage_layer_counts(126, 16)[0] == 7 and stage_layer_counts(126, 16)[-1] == 7  # Llama 3
    assert sum(stage_layer_counts(126, 16)) == 126


def test_balanced_split_llama_8b_by_hand():
    """nanotron's costs for Llama-3.1-8B (h 4096, 32 heads, 8 kv heads of 128, ffn 14336,
    V 128256): layer h·(2·4096 + 2·1024) + 3·h·14336 = 218,103,808; head V·h = 525,336,576,
    2.41 layers. Over 4 stages the best bound is 9 layers' cost (8.41 leaves room for only
    8 + 8 + 8 + 6 = 30 layers); 9 + 9 + 9 + 6 = 33 fit, one too many comes off the first of
    the costliest stages: [8, 9, 9, 6]. The even split's last stage costs 8 + 2.41 = 10.41."""
    model = preset("llama-3.1-8b")
    assert split_costs(model) == (218_103_808.0, 0.0, 525_336_576.0)
    assert model_stage_layers(model, 4, "balanced") == (8, 9, 9, 6)
    assert model_stage_layers(model, 4, "even") == (8, 8, 8, 8)
    assert model_stage_layers(model, 4, "even", (7, 9, 9, 7)) == (7, 9, 9, 7)


@pytest.mark.parametrize("layers, words", [((1, 2), "sums to 3"), ((4,), "has 1 entries"),
                                           ((0, 4), "at least one layer")])
def test_bad_explicit_split(layers, words):
    with pytest.raises(ValueError, match=words):
        stage_layer_counts(4, 2, "even", layers)


def test_sp_shard_saves_the_column_inputs_once_per_rank():
    """Korthikanti et al. 2022 Table 2: with SP every saved [s, b, h] tensor is 1/t. Keeping
    the shard instead of the gathered input saves (t−1)/t of the two column-region inputs per
    layer; the backward gathers them again: two more all-gathers of b·s·h per layer."""
    model = preset("llama-3.1-8b")
    full = activation_bytes_per_microbatch(model, 1, 4096, tp=4, sp=True)
    shard = activation_bytes_per_microbatch(model, 1, 4096, tp=4, sp=True,
                                            sp_saves_gathered=False)
    t_h_b = 4096 * 4096 * 2
    assert full.layer - shard.layer == 2 * t_h_b * 3 / 4
    work = Workload(model, 4096, 8)
    lay = Layout(dp=2, tp=4, sp=True)
    gathers = {s: ledger_volume(work, lay.replace(sp_saved=s))["tp"]["all_gather"]
               for s in ("full", "shard")}
    assert gathers["shard"] - gathers["full"] == 2 * 32 * 4 * t_h_b  # 2 per layer, m = 4


def test_per_stage_answers_in_json(capsys):
    code = cli_main(["plan", "--model", "llama-3.1-8b", "--gpus", "16", "--gbs", "64",
                     "--layout", "tp=2,pp=4,zero=1,pp_split=balanced", "--json"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)["layouts"][0]
    stages = plan["stages"]
    assert [s["layers"] for s in stages] == [8, 9, 9, 6]
    assert stages[0]["embedding"] and stages[-1]["head"]
    assert plan["named_stages"]["most_loaded"] == plan["memory_rank"]
    assert max(s["memory_total_bytes"] for s in stages) == plan["memory_total_bytes"]
    assert plan["named_stages"]["slowest"] in (1, 2)  # the 9-layer stages
