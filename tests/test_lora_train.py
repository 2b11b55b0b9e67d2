"""LoRA and QLoRA runs of the engine: adapters only in the optimizer and the checkpoint, resume,
`convert --peft` / merged export / `generate` on a LoRA checkpoint, `lora.init_from`, bad
inputs (one line, exit 2, nothing written)."""

import json

import pytest
import torch
from common import small_config

from fivefold.cli import main
from fivefold.finetune.attach import load_for_inference
from fivefold.finetune.lora import LoraLinear
from fivefold.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "hf"
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def lora_args(hf_dir, *extra):
    return ["--model.hf_path", str(hf_dir), "--lora.rank", "4", "--lora.alpha", "8",
            "--train.lr", "1e-2", *extra]


def hf_logits(path, x, adapter=None):
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def test_lora_run_trains_adapters_only_and_saves_them_alone(tmp_path, hf_dir):
    cfg = small_config(tmp_path, *lora_args(hf_dir), "--train.steps", "6")
    with Trainer(cfg, quiet=True) as trainer:
        names = [n for n, _ in trainer.model.named_parameters()]
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        model = trainer.model.chunks[0]
        base_before = {n: p.detach().clone() for n, p in model.named_parameters()
                       if not p.requires_grad}
        losses = [trainer.train_step()["loss"] for _ in range(6)]
        assert losses[-1] < losses[0] - 0.05, losses
        for n, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None and torch.equal(p, base_before[n]), n
        trainable = sum(p.numel() for _, p in trainer.model.named_parameters())
        # rank 4 on q (32->32), k, v (32->16), o (32->32), gate, up (32->64), down (64->32)
        assert trainable == 2 * 4 * (64 + 48 + 48 + 64 + 96 + 96 + 96)
        mem = trainer.optimizer.memory_bytes()
        assert mem["optimizer"] == 2 * 4 * trainable  # Adam moments for adapters only
        assert "4,096 trainable of 39,072" in trainer.lora_summary
        trainer.save_checkpoint()
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "step_00000006")).read_metadata()
    model_keys = [k for k in keys.state_dict_metadata if k.startswith(("model/", "optim/"))]
    assert model_keys and all(".lora_" in k for k in model_keys)


def test_resume_continues_the_same_run(tmp_path, hf_dir):
    straight = small_config(tmp_path / "a", *lora_args(hf_dir), "--train.steps", "4")
    with Trainer(straight, quiet=True) as t:
        expected = [t.train_step()["loss"] for _ in range(4)]
    first = small_config(tmp_path / "b", *lora_args(hf_dir), "--train.steps", "4")
    with Trainer(first, quiet=True) as t:
        got = [t.train_step()["loss"] for _ in range(2)]
        t.save_checkpoint()
    with Trainer(first, quiet=True) as t:
        assert t.step == 2
        got += [t.train_step()["loss"] for _ in range(2)]
    assert got == expected


def test_convert_peft_merged_and_generate(tmp_path, hf_dir, capsys):
    cfg_args = ["train", *small_config_args(tmp_path), *lora_args(hf_dir),
                "--train.steps", "4", "--lora.targets", "all-linear", "--log.progress", "true"]
    assert main(cfg_args) == 0
    assert "LoRA rank 4" in capsys.readouterr().out
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--checkpoint", str(ckpt), "--out", str(tmp_path / "peft"),
                 "--peft"]) == 0
    assert main(["convert", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    ours, _, _, lora = load_for_inference(str(ckpt))
    assert lora["rank"] == 4 and any(isinstance(m, LoraLinear) for m in ours.modules())
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mine = ours(x)
    peft_out = hf_logits(hf_dir, x, adapter=tmp_path / "peft")
    merged = hf_logits(tmp_path / "merged", x)
    assert (peft_out - mine).abs().max() <= 1e-4
    assert (merged - mine).abs().max() <= 1e-4
    assert (hf_logits(hf_dir, x) - mine).abs().max() > 1e-3  # the adapters did something
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "To be",
                 "--max-new-tokens", "5", "--greedy"]) == 0


def small_config_args(tmp_path):
    return ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
            "--train.seq_len", "32", "--train.gbs", "4", "--train.warmup_steps", "0",
            "--train.eval_every", "0", "--train.precision", "fp32", "--train.device", "cpu",
            "--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.every", "0",
            "--log.dir", str(tmp_path / "log"), "--log.progress", "false",
            "--log.tensorboard", "false"]


def test_init_from_a_peft_adapter_gives_peft_logits(tmp_path, hf_dir):
    torch.manual_seed(3)
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                             task_type="CAUSAL_LM")
    made = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), config)
    with torch.no_grad():
        for n, p in made.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    made.save_pretrained(tmp_path / "adapter")
    cfg = small_config(tmp_path, "--model.hf_path", str(hf_dir), "--lora.init_from",
                       str(tmp_path / "adapter"))
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (2, 6.0, "q_proj,v_proj")
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    with Trainer(cfg, quiet=True) as trainer, torch.no_grad():
        mine = trainer.model.chunks[0](x)
    assert (mine - hf_logits(hf_dir, x, adapter=tmp_path / "adapter")).abs().max() <= 1e-4


def test_qlora_nf4_run_learns_with_a_quantised_base(tmp_path, hf_dir):
    cfg = small_config(tmp_path, *lora_args(hf_dir, "--lora.base", "nf4"), "--train.steps", "6")
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    with Trainer(cfg, quiet=True) as trainer:
        model = trainer.model.chunks[0]
        loras = [m for m in model.modules() if isinstance(m, LoraLinear)]
        assert len(loras) == 14
        assert all(type(m.base_layer).__name__ == "NF4Linear" for m in loras)
        assert not any(isinstance(m.base_layer, torch.nn.Linear) for m in loras)
        base_bytes = sum(m.base_layer.quantized_bytes() for m in loras)
        base_params = sum(m.in_features * m.out_features for m in loras)
        # These matrices are small (one scaler block of 256, mostly padding): under 1 B each.
        assert base_bytes / base_params < 1.0
        from fivefold.quant.linear import NF4Linear

        big = NF4Linear.from_float(torch.nn.Linear(1024, 256, bias=False))
        assert big.quantized_bytes() / (1024 * 256) <= 0.55  # ~4.13 bits: NF4 + scales
        with torch.no_grad():
            err = (model(x) - hf_logits(hf_dir, x)).abs().max()
        assert 0 < err < 0.5  # quantisation error only
        losses = [trainer.train_step()["loss"] for _ in range(6)]
        trainer.save_checkpoint()
    assert losses[-1] < losses[0] - 0.05, losses
    ours, _, _, lora = load_for_inference(str(tmp_path / "ckpt"))
    assert lora["base"] == "nf4"
    assert all(type(m.base_layer).__name__ == "NF4Linear" for m in ours.modules()
               if isinstance(m, LoraLinear))


@pytest.mark.parametrize("extra, message", [
    (["--lora.targets", "q_proj,qkv_proj"], "lora.targets: 'qkv_proj' matches no linear"),
    (["--lora.rank", "-1"], "lora.rank = -1 must be a positive integer"),
    (["--lora.rank", "0", "--lora.base", "nf4"], "lora.rank = 0 must be a positive integer"),
])
def test_bad_lora_inputs_one_line_exit_2(tmp_path, hf_dir, capsys, extra, message):
    code = main(["train", *small_config_args(tmp_path), *lora_args(hf_dir), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "log").exists()


def test_nf4_without_a_base_reference_is_refused(tmp_path, hf_dir, capsys):
    code = main(["train", *small_config_args(tmp_path), "--lora.rank", "4", "--lora.base",
                 "nf4"])
    err = capsys.readouterr().err
    assert code == 2 and "model.hf_path and model.init_from are empty" in err
    assert len(err.strip().splitlines()) == 1
    # a QLoRA checkpoint whose meta.json lost its base reference
    assert main(["train", *small_config_args(tmp_path), *lora_args(hf_dir, "--lora.base",
                                                                   "nf4"),
                 "--train.steps", "1"]) == 0
    step = tmp_path / "ckpt" / "step_00000001"
    meta = json.loads((step / "meta.json").read_text())
    meta["config"]["model"]["hf_path"] = ""
    (step / "meta.json").write_text(json.dumps(meta))
    from fivefold.train.manifest import write_manifest

    write_manifest(step)  # as if saved so, not damaged afterwards
    capsys.readouterr()
    out = tmp_path / "out"
    code = main(["convert", "--checkpoint", str(step), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "must name its base" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_adapter_of_another_architecture_is_refused(tmp_path, hf_dir, capsys):
    other = tmp_path / "other"
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    made = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                               peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    made.save_pretrained(other)
    capsys.readouterr()  # what transformers printed while saving is not the command's
    code = main(["train", *small_config_args(tmp_path), "--model.hf_path", str(hf_dir),
                 "--lora.init_from", str(other)])
    err = capsys.readouterr().err
    assert code == 2 and "another architecture" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_convert_peft_names_a_base_transformers_loads(tmp_path, hf_dir, capsys):
    """A LoRA run of a preset (its base drawn from the seed: no directory to name) writes its
    base beside the adapter; --base-hf names one instead, checked; bad uses are one line."""
    assert main(["train", *small_config_args(tmp_path), "--lora.rank", "4",
                 "--train.steps", "1"]) == 0
    ckpt = str(tmp_path / "ckpt")
    assert main(["convert", "--checkpoint", ckpt, "--out", str(tmp_path / "a"), "--peft"]) == 0
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "a-base").resolve())
    assert (tmp_path / "a-base" / "config.json").is_file()
    assert main(["convert", "--checkpoint", ckpt, "--out", str(tmp_path / "b"), "--peft",
                 "--base-hf", str(hf_dir)]) == 0
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir)
    assert not (tmp_path / "b-base").exists()
    capsys.readouterr()
    for extra, words in ((["--peft", "--base-hf", str(tmp_path / "ckpt")],
                          "is not a Hugging Face model directory"),
                         (["--base-hf", str(hf_dir)], "add --peft or drop --base-hf"),
                         (["--peft"], "c-base, which already exists")):
        if extra == ["--peft"]:
            (tmp_path / "c-base").mkdir()
            (tmp_path / "c-base" / "x").write_text("taken")
        code = main(["convert", "--checkpoint", ckpt, "--out", str(tmp_path / "c"), *extra])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "c").exists()
