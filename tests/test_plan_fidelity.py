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


def _cli(capsys, *args):
    code = cli_main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_which_constraint_removed_the_layouts(capsys):
    """A global batch of 977 sequences (4M tokens / 4096, the default before it was rounded
    to gpus · 2^k) is prime: no dp > 1 divides it, and 32 layers do not split over the
    pipelines 12 GPUs leave at dp = 1."""
    code, out, _ = _cli(capsys, "--model", "llama-3.1-8b", "--gpus", "12", "--gbs", "977")
    assert code == 1
    assert "no layout of 12 GPUs meets the constraints" in out
    assert "gbs = 977 is not divisible by dp" in out
    assert "num_layers = 32 is not divisible by 12 pipeline chunks" in out
    assert "--gbs 972 or 984" in out
    assert "try more GPUs" not in out
    code, out, _ = _cli(capsys, "--model", "llama-3.1-8b", "--gpus", "12", "--gbs", "972")
    assert code == 0 and "MFU" in out


def test_tp_across_nodes_is_explained_not_refused(capsys):
    code, out, _ = _cli(capsys, "--model", "llama-3.1-70b", "--gpus", "32", "--gbs", "64",
                        "--layout", "tp=16,pp=2,recompute=full")
    assert code == 0
    assert "tp = 16 spans 2 nodes of 8 GPUs" in out and "exposed TP communication" in out
    # impossible layouts are still refused, in one line with exit code 2
    code, _, err = _cli(capsys, "--model", "llama-3.1-70b", "--gpus", "24", "--gbs", "64",
                        "--layout", "tp=3,pp=1")
    assert code == 2 and "tp = 3 does not divide num_heads = 64" in err


@pytest.mark.parametrize("zero, gb", [(0, "120.0"), (1, "31.4"), (2, "16.6"), (3, "1.9")])
def test_zero_paper_worked_example(capsys, zero, gb):
    """Rajbhandari et al. 2020, Fig. 1: Ψ = 7.5B, N_d = 64, K = 12 (GB = 1e9): baseline
    (2 + 2 + K)Ψ = 120; P_os 4Ψ + KΨ/N_d = 31.4; P_os+g 2Ψ + (2 + K)Ψ/N_d = 16.6;
    P_os+g+p (2 + 2 + K)Ψ/N_d = 1.875."""
    code, out, _ = _cli(capsys, "--params", "7.5e9", "--gpus", "64", "--seq-len", "2048",
                        "--gbs", "64", "--layout", f"dp=64,zero={zero}")
    assert code == 0
    assert f"model states: {gb} GB (1e9 bytes)" in out


@pytest.mark.parametrize("rule, tflops, recompute, days",
                         [("6ND", 312, "selective", "2.67"), ("8ND", 68, "full", "16.36")])
def test_82b_whole_run_worked_example(capsys, rule, tflops, recompute, days):
    """82B parameters, 150B tokens, 1024 A100s: 6·82e9·150e9 / (1024 · 312e12) s = 2.6735
    days; 8·82e9·150e9 / (1024 · 68e12) s = 16.356 days. The rules: C = 6ND (Kaplan et al.
    2020, arXiv:2001.08361, §2.1) and, with full recomputation, training time ≈ 8TP/(nX)
    (Narayanan et al. 2021, arXiv:2104.04473); the inputs are an example, the days arithmetic."""
    code, out, _ = _cli(capsys, "--params", "82e9", "--gpu", "a100-80gb", "--gpus", "1024",
                        "--seq-len", "2048", "--gbs", "1536", "--layout",
                        f"tp=8,pp=8,zero=1,recompute={recompute}", "--tokens", "150e9",
                        "--achieved-tflops", str(tflops), "--flops-rule", rule,
                        "--hw", "price_per_gpu_hour=2", "--json")
    assert code == 0
    run = json.loads(out)["run"]
    assert f"{run['days_rule']:.2f}" == days
    assert run["num_params"] == 82e9
    assert run["total_flops"] == int(rule[0]) * 82e9 * 150e9
    assert run["gpu_hours_rule"] == pytest.approx(run["total_flops"] / (tflops * 1e12) / 3600)
    assert run["cost"] == pytest.approx(2 * run["gpu_hours"])
    assert run["days_planned"] > 0


def test_model_from_params_counts_to_within_half_a_row():
    from fivefold.plan.run_cost import model_from_params

    for n in (1e9, 7.5e9, 82e9, 175e9):
        model = model_from_params(n)
        assert abs(model.num_params() - n) <= model.hidden_size / 2
        assert model.num_heads % 8 == 0 and model.hidden_size % 128 == 0
