"""The planner's mixture-of-experts terms: total vs active parameters against the published
figures, active-parameter FLOPs, MoE presets and HF MoE configs through `fivefold plan`."""

import json

import pytest

from fivefold.cli import main
from fivefold.models.presets import preset
from fivefold.plan.flops import model_flops_per_token
from fivefold.plan.inputs import model_from_hf_config


@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mixtral of Experts (Jiang et al. 2024): 47B / 13B
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # Qwen3 model card: 30.5B / 3.3B
    ("olmoe-1b-7b", 6.9e9, 1.3e9),  # OLMoE (Muennighoff et al. 2024): 6.9B / 1.3B
])
def test_total_and_active_parameters_match_the_published_figures(name, total, active):
    mc = preset(name)
    assert mc.num_params() == pytest.approx(total, rel=0.01)
    assert mc.num_active_params() == pytest.approx(active, rel=0.03)


def test_flops_count_active_parameters_and_dense_layers():
    mc = preset("deepseek-v3-shaped")
    h, s = mc.hidden_size, 4096
    # 6·N_active (matmul weights: no embedding lookup, no norms) + 12·L·s·q attention
    n_active = (mc.num_active_params() - mc.vocab_size * h - h  # embedding, final norm
                - mc.num_layers * mc.attention_params())
    proj = 2 * h * mc.q_size + 2 * h * mc.kv_size
    expected = 6 * (n_active + mc.num_layers * proj) + 12 * mc.num_layers * s * mc.q_size
    assert model_flops_per_token(mc, s) == pytest.approx(expected, rel=1e-9)
    assert model_flops_per_token(mc, s) < 0.15 * model_flops_per_token(
        mc.replace(experts_top_k=mc.num_experts), s)


def test_plan_explains_moe_presets_and_hf_configs(tmp_path, capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--gbs", "64",
                 "--layout", "tp=2,pp=2,zero=1"]) == 0
    out = capsys.readouterr().out
    assert "32 of 32 layers MoE (softmax, top-2 of 8, renormalised" in out
    assert "12.88B of 46.70B parameters active" in out
    qwen = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64, "mlp_only_layers": [0]}
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    mc = model_from_hf_config(tmp_path)
    assert (mc.num_moe_layers, mc.shared_expert_intermediate_size, mc.qkv_bias) == (3, 64, True)
    assert main(["plan", "--model", str(tmp_path), "--gpus", "4", "--gbs", "8", "--seq-len",
                 "512", "--search", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 of 4 layers MoE" in out and "shared expert of 64" in out
