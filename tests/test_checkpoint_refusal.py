"""A checkpoint refuses another model: by its saved config, and independently by its tensors.

Resuming, generating from or converting a checkpoint of another model (another expert count,
q/k norms it lacks, a wider layer) is one line naming the first difference and exit 2; a step
without a complete manifest is refused by generate and convert in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from common import small_config
from harness import run_ranks

from fivefold.cli import main
from fivefold.models.init import build_meta
from fivefold.models.presets import ModelConfig
from fivefold.parallel.mesh import ParallelDims
from fivefold.train import checkpoint as ckpt
from fivefold.train.trainer import Trainer

MOE = ("--model.num_experts", "8", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "32")

# A value unlike the base's for every ModelConfig field; a new field must be added here, and
# the test below then says whether it belongs in PARAMETER_KEYS.
BASE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                   num_heads=4, num_kv_heads=2, max_seq_len=64, qk_norm=True, num_experts=4,
                   experts_top_k=2, moe_intermediate_size=16, moe_first_dense=1,
                   shared_expert_intermediate_size=16)
OTHER = dict(name="other", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4,
             num_heads=2, num_kv_heads=1, head_dim=16, max_seq_len=128, rope_theta=500.0,
             rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32},
             norm_eps=1e-6, tie_embeddings=True, qkv_bias=True, qk_norm=False,
             qk_norm_whole=True, mlp="gelu", norm="layernorm", init_std=0.01,
             hf_architecture="MistralForCausalLM", num_experts=8, experts_top_k=1,
             moe_intermediate_size=8, moe_layer_freq=2, moe_first_dense=2,
             router_score="sigmoid", norm_topk_prob=False, routed_scaling_factor=2.0,
             router_groups=2, router_topk_groups=2, shared_expert_intermediate_size=8,
             shared_expert_gate=True, capacity_factor=1.0, aux_loss_coeff=0.1,
             z_loss_coeff=0.1, expert_bias_rate=0.01)


def shapes(cfg: ModelConfig) -> dict[str, tuple]:
    return {n: tuple(t.shape) for n, t in build_meta(cfg).state_dict().items()}


def test_parameter_keys_are_exactly_the_fields_that_shape_the_model():
    """Every field of ModelConfig changed alone: the tensors (names or shapes) change iff the
    field is in PARAMETER_KEYS, so the config check misses no key and refuses no harmless one."""
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(OTHER) == sorted(fields), "give the new ModelConfig field a value in OTHER"
    base = shapes(BASE)
    shaping = sorted(f for f in fields if shapes(BASE.replace(**{f: OTHER[f]})) != base)
    assert shaping == sorted(ckpt.PARAMETER_KEYS)


def cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    return code, err


def one_line(err: str) -> str:
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def saved_run(root: Path, *extra: str) -> Path:
    """A one-step run's checkpoint directory (step 1 saved)."""
    cfg = small_config(root, *extra, "--checkpoint.dir", str(root / "ck"))
    with Trainer(cfg, quiet=True) as t:
        t.train_step()
        t.save_checkpoint()
    return root / "ck"


def resume_args(root: Path, *extra: str) -> list[str]:
    """`fivefold train` of small_config's model, resuming from root/ck."""
    return ["train", "--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs",
            "1", "--model.hidden_size", "32", "--model.intermediate_size", "64",
            "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
            "--train.seq_len", "32", "--train.gbs", "4", "--train.steps", "3",
            "--train.precision", "fp32", "--train.device", "cpu", "--train.eval_every", "0",
            "--log.progress", "false", "--log.tensorboard", "false",
            "--checkpoint.dir", str(root / "ck"), "--log.dir", str(root / "log2"),
            "--checkpoint.resume", "auto", *extra]


@pytest.mark.parametrize("saved, asked, key", [
    (MOE, ("--model.num_experts", "4"), "model.num_experts = 8"),
    (("--model.qk_norm", "true"), ("--model.qk_norm", "false"), "model.qk_norm = True"),
])
def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, capsys, saved, asked, key):
    """Before: 8 saved experts resumed as 4 (the first four read as boxes), and q/k norms
    were dropped; now one line naming the key, exit 2, and the checkpoint untouched."""
    ck = saved_run(tmp_path, *saved)
    before = sorted(p.name for p in ck.iterdir())
    code, err = cli(capsys, *resume_args(tmp_path, *saved, *asked))
    line = one_line(err)
    assert code == 2 and key in line and "step_00000001" in line, line
    assert sorted(p.name for p in ck.iterdir()) == before


def test_the_tensor_check_refuses_on_its_own(tmp_path):
    """With the config check out of the way, the tensors alone refuse: a saved tensor the
    model lacks (q/k norms), one it has in another shape (a wider layer; before, a larger
    saved tensor was read as a box), one the checkpoint lacks."""
    with_norms = saved_run(tmp_path / "a", "--model.qk_norm", "true") / "step_00000001"
    model = build_meta(small_config(tmp_path).model.resolve()).to_empty(device="cpu")
    with pytest.raises(ckpt.ModelMismatch, match=r"k_norm.weight of shape \(8,\), which this "
                                                 r"model does not have"):
        ckpt.load(with_norms, ckpt.inference_parts(model), {})
    wide = saved_run(tmp_path / "b", "--model.intermediate_size", "96") / "step_00000001"
    with pytest.raises(ckpt.ModelMismatch, match=r"mlp.gate_proj.weight with shape \(96, 32\), "
                                                 r"but this model's is \(64, 32\)"):
        ckpt.load(wide, ckpt.inference_parts(model), {})
    normed = build_meta(small_config(tmp_path, "--model.qk_norm", "true").model.resolve())
    plain = saved_run(tmp_path / "c") / "step_00000001"
    with pytest.raises(ckpt.ModelMismatch, match=r"has no tensor model/layers.0.self_attn.q_norm"):
        ckpt.load(plain, ckpt.inference_parts(normed.to_empty(device="cpu")), {})


def _resume_without_norms(rank, world, tmp):
    """dp 2, ZeRO-1: saved with q/k norms, resumed without them and with the config check
    switched off. Each rank finds every tensor it reads; only the union of both ranks' reads
    shows the norms unread, and every rank refuses together."""
    root = Path(tmp)
    layout = ("--parallel.dp", "2", "--parallel.zero", "1", "--train.gbs", "4",
              "--checkpoint.dir", str(root / "ck"))
    cfg = small_config(root, *layout, "--model.qk_norm", "true")
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as t:
        t.train_step()
        t.save_checkpoint()
    ckpt.check_model_shape = lambda *args: None
    cfg = small_config(root, *layout, "--checkpoint.resume", "auto")
    try:
        Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True).close()
    except ckpt.ModelMismatch as e:
        return str(e)
    return "resumed"


def test_two_ranks_refuse_tensors_no_rank_reads(tmp_path):
    for message in run_ranks(_resume_without_norms, 2, str(tmp_path)):
        assert "holds model/layers.0.self_attn.k_norm.weight" in message, message
        assert "which this model does not have" in message, message
        assert "\n" not in message


@pytest.fixture
def saved_steps(tmp_path) -> Path:
    """Steps 1 and 2 of a small run, both complete."""
    cfg = small_config(tmp_path, "--checkpoint.keep", "5")
    with Trainer(cfg, quiet=True) as t:
        for _ in range(2):
            t.train_step()
            t.save_checkpoint()
    return tmp_path / "ckpt"


def test_generate_and_convert_refuse_a_step_without_a_complete_manifest(saved_steps, capsys):
    """Before: without manifest.json, flipped bytes in the shard generated garbage (exit 0)
    and a truncated shard ended in a long EOFError traceback."""
    step = saved_steps / "step_00000002"
    (step / "manifest.json").unlink()
    shard = next(step.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.seek(200)
        f.write(os.urandom(512))
    code, err = cli(capsys, "generate", "--checkpoint", step, "--prompt", "ab",
                    "--max-new-tokens", "2")
    line = one_line(err)
    assert code == 2 and "step_00000002 is incomplete" in line and "manifest.json" in line
    assert "step_00000001" in line, line  # the newest complete one before it
    os.truncate(shard, 100)
    code, err = cli(capsys, "convert", "--checkpoint", step, "--to-hf", saved_steps / "hf")
    line = one_line(err)
    assert code == 2 and "step_00000002 is incomplete" in line, line
    assert not (saved_steps / "hf").exists()

    # A manifest that does not list every file of the step.
    first = saved_steps / "step_00000001"
    (first / "extra.distcp").write_bytes(b"\0" * 64)
    code, err = cli(capsys, "generate", "--checkpoint", first, "--prompt", "ab")
    line = one_line(err)
    assert code == 2 and "does not list extra.distcp" in line, line


def test_generate_load_errors_are_one_line(saved_steps, capsys):
    step = saved_steps / "step_00000001"
    code, err = cli(capsys, "generate", "--checkpoint", saved_steps / "nope", "--prompt", "a")
    assert code == 2 and f"{saved_steps / 'nope'}" in one_line(err)
    (saved_steps / "latest").write_text("step_00000009")
    code, err = cli(capsys, "generate", "--checkpoint", saved_steps, "--prompt", "a")
    assert code == 2 and "step_00000009" in one_line(err)
    # A complete step whose meta.json claims another model: the tensors refuse it.
    meta = json.loads((step / "meta.json").read_text())
    meta["model"]["intermediate_size"] = 96
    (step / "meta.json").write_text(json.dumps(meta))
    from fivefold.train.manifest import write_manifest

    write_manifest(step)
    code, err = cli(capsys, "convert", "--checkpoint", step, "--to-hf", saved_steps / "hf")
    line = one_line(err)
    assert code == 2 and "with shape (64, 32), but this model's is (96, 32)" in line, line
    assert not (saved_steps / "hf").exists()
