"""Hugging Face mixture-of-experts import/export: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Tolerance: max |logit difference| <= 1e-5 in fp32, against `transformers` on small random
checkpoints (weights std 0.1, norms in [0.5, 1.5]), both directions, with norm_topk_prob
false and true, the per-expert keys transformers writes today and its fused in-memory layout;
and at tp 2 through the trainer (import, then export of the gathered weights).
"""

import pathlib

import pytest
import torch
from common import small_config
from harness import run_ranks
from safetensors.torch import save_file

from fivefold.config import ConfigError
from fivefold.models.hf import load_hf, save_hf
from fivefold.models.hf_config import model_config_from_hf
from fivefold.models.init import build_model
from fivefold.parallel import comm
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.tensor import gather_full_state
from fivefold.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, SEQ = 256, 24
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, num_hidden_layers=3,
                       mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                       head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24)),
}
CASES = ["mixtral", "qwen2_moe-norm0", "qwen2_moe-norm1", "qwen3_moe-norm0", "qwen3_moe-norm1",
         "olmoe-norm0"]


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def hf_model(case: str):
    family, _, norm = case.partition("-")
    config_cls, model_cls, extra = FAMILIES[family]
    kw = {**SHAPE, **extra}
    if norm:
        kw["norm_topk_prob"] = norm == "norm1"
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw)).eval()
    randomize(model)
    return model


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def max_logit_diff(hf, ours) -> float:
    with torch.no_grad():
        expected, got = hf(tokens()).logits, ours(tokens())
    assert expected.abs().max() > 1.0, "logits too small for the comparison to mean much"
    return (expected - got).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_import_and_export_match_transformers(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    cfg = ours.cfg
    assert cfg.num_experts == (hf.config.num_local_experts if case == "mixtral"
                               else hf.config.num_experts)
    assert cfg.norm_topk_prob == (case == "mixtral" or case.endswith("norm1"))
    diff = max_logit_diff(hf, ours)
    print(f"import {case}: max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    # Export: our own random weights, read back by transformers.
    model = build_model(cfg, seed=5)
    randomize(model, seed=6)
    save_hf(model.eval(), cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                            dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    diff = max_logit_diff(back, model)
    print(f"export {case}: max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    again = load_hf(tmp_path / "out")
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def test_fused_expert_layout_is_read(tmp_path):
    """transformers 5 holds experts fused (gate_up_proj [E, 2I, H]); such files load too."""
    hf = hf_model("qwen3_moe-norm1")
    hf.save_pretrained(tmp_path)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    (tmp_path / "model.safetensors").unlink()
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert max_logit_diff(hf, load_hf(tmp_path).eval()) <= TOL


@pytest.mark.parametrize("arch,change,words", [
    ("DeepseekV3ForCausalLM", {}, "architecture 'DeepseekV3ForCausalLM' is not supported"),
    ("OlmoeForCausalLM", {"clip_qkv": 8.0}, "clip_qkv"),
    ("MixtralForCausalLM", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("Qwen2MoeForCausalLM", {"mlp_only_layers": [1]}, "mlp_only_layers"),
])
def test_unsupported_moe_configs_are_one_line(tmp_path, arch, change, words):
    import json

    hf = {**SHAPE, "architectures": [arch], "num_local_experts": 4, "num_experts": 4,
          "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, **change}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=words) as err:
        model_config_from_hf(tmp_path)
    assert "\n" not in str(err.value)


def tp2_import_export(rank, world, tmp, path):
    cfg = small_config(pathlib.Path(tmp), "--model.hf_path", str(path), "--parallel.tp", "2",
                       "--model.num_layers", "3", "--train.precision", "fp32")
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    model = trainer.model.chunks[0].eval()
    with torch.no_grad():
        local = model(tokens()).contiguous()  # (b, s, V/tp): this rank's vocabulary slice
    pieces = torch.empty(2 * local.numel())
    comm.all_gather(pieces, local.flatten(), trainer.dims["tp"])
    logits = torch.cat(pieces.view(2, *local.shape).unbind(0), dim=-1)
    state = gather_full_state(model, trainer.dims)
    if rank == 0:
        full = build_model(trainer.model_cfg, seed=0)
        full.load_state_dict(state, strict=False)
        save_hf(full.eval(), trainer.model_cfg, pathlib.Path(tmp) / "export")
    return logits


def test_tp2_import_and_export_match_transformers(tmp_path):
    hf = hf_model("qwen2_moe-norm0")
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(tokens()).logits
    for logits in run_ranks(tp2_import_export, 2, str(tmp_path), tmp_path / "hf"):
        assert (logits - expected).abs().max().item() <= TOL
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                            dtype=torch.float32).eval()
    for (name, a), b in zip(back.named_parameters(), hf.parameters()):
        assert torch.equal(a, b), name
