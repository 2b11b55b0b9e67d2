"""Hugging Face import/export: fivefold and transformers must compute the same logits.

Tolerance: max |logit difference| <= 1e-5 in fp32 on CPU. Weights are drawn with std 0.1
(norm weights in [0.5, 1.5], biases non-zero) so that a mis-mapped tensor, a wrong RoPE
layout or a dropped bias moves the logits far beyond that.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fivefold.config import ConfigError
from fivefold.models.hf import iter_hf_tensors, load_hf, save_hf
from fivefold.models.hf_config import hf_config_from_model, model_config_from_hf
from fivefold.models.init import build_model
from fivefold.models.llama import rope_inv_freq
from fivefold.models.presets import ModelConfig

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, SEQ = 96, 24
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def hf_model(arch: str = "llama", **overrides):
    if arch == "qwen2":
        if not hasattr(transformers, "Qwen2ForCausalLM"):
            pytest.skip("this transformers has no Qwen2ForCausalLM")
        config_cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    else:
        config_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SHAPE, **overrides})).eval()
    randomize(model)
    return model


def max_logit_diff(hf, ours) -> float:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert expected.abs().max() > 1.0, "logits too small for the comparison to mean much"
    return (expected - got).abs().max().item()


@pytest.mark.parametrize("case", ["untied", "tied_sharded", "llama3", "qwen2_bias"])
def test_import_matches_transformers(tmp_path, case):
    arch = "qwen2" if case == "qwen2_bias" else "llama"
    overrides = {"tie_word_embeddings": case in ("tied_sharded", "qwen2_bias")}
    if case == "llama3":
        overrides.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    hf = hf_model(arch, **overrides)
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if case == "tied_sharded" else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (case == "tied_sharded")
    ours = load_hf(tmp_path).eval()
    cfg = ours.cfg
    assert cfg.tie_embeddings == overrides["tie_word_embeddings"]
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.num_kv_heads == 2
    if case == "llama3":
        assert cfg.rope_scaling["factor"] == 4.0
        plain = rope_inv_freq(cfg.replace(rope_scaling=None))
        assert not torch.allclose(plain, rope_inv_freq(cfg))  # the scaling is exercised
    diff = max_logit_diff(hf, ours)
    print(f"import {case}: max |logit diff| = {diff:.3g}")
    assert diff <= TOL


def export_model(qkv_bias=False, tied=False, scaling=None) -> tuple:
    cfg = ModelConfig(name="export", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=128,
                      tie_embeddings=tied, qkv_bias=qkv_bias, rope_scaling=scaling,
                      rope_theta=500000.0 if scaling else 10000.0)
    model = build_model(cfg, seed=3)
    randomize(model, seed=4)
    return model.eval(), cfg


@pytest.mark.parametrize("case", ["untied_sharded", "tied_llama3", "qwen2_bias"])
def test_export_loads_in_transformers(tmp_path, case):
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_type"} if "llama3" in case else None
    model, cfg = export_model(qkv_bias=case == "qwen2_bias", tied=case != "untied_sharded",
                              scaling=scaling)
    out = tmp_path / "export"
    save_hf(model, cfg, out, max_shard_bytes=100_000 if "sharded" in case else 10**9)
    index = out / "model.safetensors.index.json"
    assert index.exists() == ("sharded" in case)
    if index.exists():
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected_cls = "Qwen2ForCausalLM" if case == "qwen2_bias" else "LlamaForCausalLM"
    assert type(hf).__name__ == expected_cls
    diff = max_logit_diff(hf, model)
    print(f"export {case}: max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    # and back: our own loader reproduces every parameter exactly
    again = load_hf(out)
    assert again.cfg.replace(name="export") == cfg.replace(init_std=again.cfg.init_std)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def test_tied_lm_head_copy_is_skipped(tmp_path):
    model, cfg = export_model(tied=True)
    save_hf(model, cfg, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    state = load_file(path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, path)
    names = [n for n, _ in iter_hf_tensors(tmp_path / "m")]
    assert "lm_head.weight" not in names and "embed_tokens.weight" in names
    load_hf(tmp_path / "m")


def edit_weights(directory, edit) -> None:
    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda s: s.pop("lm_head.weight"), "missing tensor 'lm_head.weight'"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
     "tensor 'model.layers.0.self_attn.k_proj.weight' has shape (64, 64)"),
    (lambda s: s.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(128, 64)}),
     "unexpected tensor 'model.layers.7.mlp.up_proj.weight'"),
])
def test_bad_weights_are_named(tmp_path, edit, words):
    model, cfg = export_model()
    save_hf(model, cfg, tmp_path / "m")
    edit_weights(tmp_path / "m", edit)
    with pytest.raises(ConfigError, match="^.*" + words.replace("(", r"\(").replace(")", r"\)")):
        load_hf(tmp_path / "m")


def write_config(tmp_path, **changes):
    _, cfg = export_model()
    hf = hf_config_from_model(cfg)
    hf.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path / "config.json"


@pytest.mark.parametrize("changes, words", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"attention_bias": True}, "attention_bias = True"),
])
def test_unsupported_configs(tmp_path, changes, words):
    path = write_config(tmp_path, **changes)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as err:
        model_config_from_hf(path)
    assert "\n" not in str(err.value)


def test_config_spellings(tmp_path):
    """transformers 5's rope_parameters, Mistral's sliding window, default head_dim."""
    path = write_config(tmp_path, rope_theta=None, rope_scaling=None, head_dim=None,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **{
                            k: v for k, v in LLAMA3.items() if k != "rope_type"}})
    cfg = model_config_from_hf(path)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["original_max_position_embeddings"] == 16
    assert cfg.head_dim is None and cfg.dim_per_head == 16
    path = write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=64)
    assert model_config_from_hf(path).max_seq_len == 64
    path = write_config(tmp_path, head_dim=32)
    assert model_config_from_hf(path).q_size == 128


def test_save_is_atomic_and_refuses_to_overwrite(tmp_path, monkeypatch):
    model, cfg = export_model()
    out = save_hf(model, cfg, tmp_path / "m")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConfigError, match="already exists"):
        save_hf(model, cfg, out)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("fivefold.models.hf.save_file", fail)
    with pytest.raises(OSError):
        save_hf(model, cfg, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary left behind


def test_convert_reshards_and_keeps_companions(tmp_path, capsys):
    from fivefold.models.convert import main

    hf = hf_model("llama", tie_word_embeddings=True, eos_token_id=7)
    hf.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    assert main(["--hf", str(tmp_path / "src"), "--to-hf", str(out),
                 "--max-shard-size", "40KB"]) == 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "tokenizer.json").read_text() == "{}"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 7
    source = dict(iter_hf_tensors(tmp_path / "src"))
    for name, tensor in iter_hf_tensors(out):
        assert torch.equal(tensor, source.pop(name)), name
    assert not source
    assert main(["--hf", str(tmp_path / "src"), "--to-hf", str(out)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err


def test_export_checkpoint_to_hf(tmp_path, monkeypatch):
    from fivefold.models import convert
    from fivefold.train import checkpoint

    model, cfg = export_model(qkv_bias=True)
    monkeypatch.setattr(checkpoint, "load_model_for_inference",
                        lambda path: (model, cfg, "byte"), raising=False)
    convert.export_checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "out", dtype="bf16")
    again = load_hf(tmp_path / "out", dtype=torch.bfloat16)
    hf_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert hf_cfg["torch_dtype"] == "bfloat16"
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), name


def test_load_into_a_shard_and_a_pipeline_stage(tmp_path):
    """The hooks tensor and pipeline parallelism use: `_shard_fn` slices, `names` renames."""
    from fivefold.models.hf import load_hf_into
    from fivefold.models.init import build_meta

    model, cfg = export_model()
    save_hf(model, cfg, tmp_path / "m")
    stage = build_meta(cfg.replace(num_layers=1))  # holds the full model's last layer
    up = stage.layers[0].mlp.up_proj
    up.weight = torch.nn.Parameter(torch.empty(64, 64, device="meta"))
    up.weight._shard_fn = lambda full: full[64:]  # the second half of the rows, as on tp rank 1
    names = {n: n.replace("layers.0.", "layers.2.") for n, _ in stage.named_parameters()}
    load_hf_into(stage, iter_hf_tensors(tmp_path / "m"), cfg=cfg, names=names)
    full = dict(model.named_parameters())
    for name, param in stage.named_parameters():
        expected = full[names[name]][64:] if name.endswith("up_proj.weight") else full[names[name]]
        assert torch.equal(param, expected), name
    with pytest.raises(ConfigError, match="missing tensor 'model.layers.0"):
        load_hf_into(build_meta(cfg.replace(num_layers=1)),
                     [(n, t) for n, t in iter_hf_tensors(tmp_path / "m") if "layers.0." not in n],
                     cfg=cfg)
