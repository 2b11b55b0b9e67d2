"""An export that keeps the model: the routers' aux-loss-free expert bias.

`fivefold convert` of an MoE trained with model.expert_bias_rate > 0 writes the bias where
the Hugging Face family has a place for it (dots.llm1's `gate.e_score_correction_bias`, as in
DeepSeek-V3), and transformers' model then gives the same logits; where the family has no
place (Mixtral, Qwen-MoE, OLMoE) the export is refused in one line. Before, the bias was
dropped and the exported model routed differently.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from common import small_config

from fivefold.cli import main
from fivefold.models.hf import load_hf
from fivefold.train.checkpoint import load_model_for_inference
from fivefold.train.trainer import Trainer

# DeepSeek-V3's router in small: sigmoid scores, 4 groups of 2 experts (2 kept), scaled by
# 2.5, a shared expert, the first layer dense; Qwen3's per-head q/k norms.
SIGMOID_MOE = ("--model.num_layers", "3", "--model.num_experts", "8", "--model.experts_top_k",
               "2", "--model.moe_intermediate_size", "16", "--model.moe_first_dense", "1",
               "--model.router_score", "sigmoid", "--model.routed_scaling_factor", "2.5",
               "--model.router_groups", "4", "--model.router_topk_groups", "2",
               "--model.shared_expert_intermediate_size", "32", "--model.qk_norm", "true",
               "--model.expert_bias_rate", "0.05", "--model.aux_loss_coeff", "0")


def trained(root: Path, *extra: str, steps: int = 4) -> Path:
    """A checkpoint after `steps` steps (the routers' expert biases move each step)."""
    cfg = small_config(root, *extra, "--checkpoint.dir", str(root / "ck"))
    with Trainer(cfg, quiet=True) as t:
        for _ in range(steps):
            t.train_step()
        t.save_checkpoint()
    return root / "ck"


def test_convert_exports_the_expert_bias_and_transformers_routes_the_same(tmp_path, capsys):
    ck = trained(tmp_path, *SIGMOID_MOE)
    model, cfg, _ = load_model_for_inference(str(ck))
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases.values())
    assert main(["convert", "--checkpoint", str(ck), "--to-hf", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Dots1ForCausalLM"]

    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        for n, b in model.named_buffers():  # without its biases the model routes otherwise
            if n in biases:
                b.zero_()
        unbiased = model(tokens)
        for n, b in model.named_buffers():
            if n in biases:
                b.copy_(biases[n])
    assert (ours - unbiased).abs().max() > 1e-3  # so the comparisons below can fail

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert (theirs - ours).abs().max() <= 2e-5 * ours.abs().max(), (theirs - ours).abs().max()
    back = load_hf(tmp_path / "hf")  # and fivefold reads the bias back
    with torch.no_grad():
        again = back(tokens)
    assert (again - ours).abs().max() <= 1e-6 * ours.abs().max()


def test_a_family_without_a_place_for_the_bias_is_refused_in_one_line(tmp_path, capsys):
    """tiny-moe's shape exports as Mixtral, which has no expert bias: with a trained bias the
    export is refused, nothing written (without one it exports as before: test_hf_moe.py)."""
    moe = ("--model.num_experts", "4", "--model.experts_top_k", "2",
           "--model.moe_intermediate_size", "16")
    ck = trained(tmp_path / "a", *moe, "--model.expert_bias_rate", "0.05", steps=3)
    model = load_model_for_inference(str(ck))[0]  # (at 4 steps this one's biases are back at 0)
    assert any(b.abs().max() > 0 for n, b in model.named_buffers() if n.endswith("expert_bias"))
    code = main(["convert", "--checkpoint", str(ck), "--to-hf", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "MixtralForCausalLM has no place for one" in err and "expert_bias_rate" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("dense_first", [0, 1])
def test_dots1_config_round_trips(dense_first):
    from fivefold.models.hf_config import dots1_fields, hf_config_from_model
    from fivefold.models.presets import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=4, num_kv_heads=2, qk_norm=True, num_experts=8,
                      experts_top_k=2, moe_intermediate_size=16, moe_first_dense=dense_first,
                      router_score="sigmoid", routed_scaling_factor=2.5, router_groups=4,
                      router_topk_groups=2, shared_expert_intermediate_size=32)
    hf = hf_config_from_model(cfg)
    assert hf["architectures"] == ["Dots1ForCausalLM"] and hf["n_shared_experts"] == 2
    back = cfg.replace(**dots1_fields(hf))
    assert back == cfg


def test_init_from_keeps_the_expert_bias(tmp_path):
    """model.init_from of an MoE run starts from its routers' expert biases as well as its
    weights: without them the new run routes tokens otherwise than the model it started from."""
    ck = trained(tmp_path / "a", *SIGMOID_MOE, steps=3)
    model, _, _ = load_model_for_inference(str(ck))
    saved = {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert saved and all(b.abs().max() > 0 for b in saved.values())
    cfg = small_config(tmp_path / "b", *SIGMOID_MOE, "--model.init_from", str(ck))
    with Trainer(cfg, quiet=True) as t:
        started = t.moe.expert_biases()
        assert started.keys() == saved.keys()
        for name, bias in started.items():
            assert torch.equal(bias, saved[name]), name
