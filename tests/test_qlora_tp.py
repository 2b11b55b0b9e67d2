"""QLoRA (an NF4 or int8 frozen base) under tensor parallelism: each rank quantises its own
weight shard (finetune/tensor_parallel.py).

Quantising per shard rounds differently from quantising the whole tensor (a row-parallel
shard's NF4 blocks hold 64 of its own columns; its int8 scale is its half row's absmax; the
double-quantised scalers are grouped per shard), so the single-process reference quantises
the same way: its float base is the tp2 shards quantised and dequantised, put back together.
The comparison then has the tolerances of the LoRA tp2 test (tests/test_lora_parallel.py):
the float32 error model's losses, gradient norms and adapters (tests/tolerances.py), fp32,
train.eps 1e-4 (why: that file). Also: the planner's model states for QLoRA tp2 equal the
engine's to the byte, and an NF4 shard that its blocks cannot tile is refused in one line.
"""

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from common import assert_same_lora_run, small_config
from harness import run_ranks

from fivefold.cli import main
from fivefold.numerics import intx, nf4
from fivefold.parallel.mesh import ParallelDims

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--train.lr", "1e-2", "--train.steps", "4",
        "--lora.targets", "all-linear", "--train.eps", "1e-4"]
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROW = ("o_proj", "down_proj")  # split by input columns


def _hf(path: Path, hidden: int, inter: int, kv_heads: int) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return _hf(tmp_path_factory.mktemp("qlora_tp") / "hf", 32, 64, 2)


def _roundtrip(w: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "nf4":
        return nf4.dequantize_nf4(nf4.quantize_nf4(w))
    return intx.dequantize_int8(intx.quantize_int8(w))


def per_shard_base(src: Path, dst: Path, kind: str, tp: int) -> Path:
    """A copy of the HF base whose linears hold what tp ranks compute with: each tp shard
    (rows of a column-parallel weight, columns of a row-parallel one; with 2 kv heads at
    tp2, one head per rank, i.e. rows too) quantised and dequantised on its own."""
    shutil.copytree(src, dst)
    tensors = safetensors_torch.load_file(str(src / "model.safetensors"))
    for key, w in tensors.items():
        m = re.search(r"\.(\w+_proj)\.weight$", key)
        if m is None:
            continue
        dim = 0 if m.group(1) in COLUMN else 1
        assert m.group(1) in COLUMN + ROW
        shards = [_roundtrip(s.float(), kind) for s in w.chunk(tp, dim=dim)]
        tensors[key] = torch.cat(shards, dim=dim).to(w.dtype).contiguous()
    safetensors_torch.save_file(tensors, str(dst / "model.safetensors"),
                                metadata={"format": "pt"})
    return dst


def _run(rank, world, tmp, layout):
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp) / f"r{rank}", *LORA, *layout)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
        records = [trainer.train_step() for _ in range(cfg.train.steps)]
        tensors = {k: v for k, v in trainer.logical_tensors().items()
                   if k.startswith("model/")}
        quantised = sorted({type(m).__name__ for c in trainer.model.chunks
                            for m in c.modules()
                            if type(m).__name__ in ("NF4Linear", "Int8Linear")})
        floats = [n for n, p in trainer.model.named_parameters(frozen=True)
                  if n.endswith("_proj.base_layer.weight")]
        counts = re.search(r"([\d,]+) trainable of ([\d,]+)", trainer.lora_summary).groups()
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], tensors, (
        quantised, floats, counts)


@pytest.mark.parity
@pytest.mark.parametrize("kind, extra", [
    ("nf4", []), ("int8", []), ("nf4", ["--parallel.sp", "true"]),
    ("nf4", ["--parallel.dp", "2", "--parallel.zero", "2"]),
    ("nf4", ["--parallel.dp", "2", "--parallel.zero", "3"]),
], ids=["nf4", "int8", "nf4-sp", "nf4-dp2-zero2", "nf4-dp2-zero3"])
def test_qlora_tp2_matches_single_process_with_the_same_quantisation(hf_base, tmp_path,
                                                                    kind, extra):
    ref = per_shard_base(hf_base, tmp_path / "ref", kind, 2)
    with tempfile.TemporaryDirectory() as tmp:
        losses, norms, tensors, (_, _, counts) = run_ranks(
            _run, 1, tmp, ["--model.hf_path", str(ref)])[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_run, 4 if "--parallel.dp" in extra else 2, tmp, [
            "--model.hf_path", str(hf_base), "--lora.base", kind, "--parallel.tp", "2",
            *extra])
    for *_, (quantised, floats, rank_counts) in results:  # each from its quantised shard
        assert quantised == [{"nf4": "NF4Linear", "int8": "Int8Linear"}[kind]]
        assert floats == []
        assert rank_counts == counts  # trainable / total logical parameters, as printed
    assert losses[-1] < losses[0]
    assert all(".lora_" in k for k in tensors)
    assert_same_lora_run(losses, norms, tensors, [r[:3] for r in results])


def _measure(rank, world, tmp, args):
    from fivefold.finetune.attach import frozen_state
    from fivefold.parallel.buffers import storage_bytes
    from fivefold.train.loop import planned_model_states
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp) / f"r{rank}", *args)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
        trainer.train_step()
        measured = trainer.optimizer.memory_bytes()
        measured["params"] += storage_bytes(frozen_state(trainer.model.chunks))
        return measured, planned_model_states(trainer)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_planned_model_states_of_qlora_tp2_equal_the_engine(tmp_path, kind):
    # Shards of 64·256 weights or more, so NF4's scaler blocks are whole (the planner's
    # bytes per weight assume no padding), as in tests/test_lora_plan.py.
    hf = _hf(tmp_path / "hf", 256, 512, 4)
    args = ["--model.hidden_size", "256", "--model.intermediate_size", "512",
            "--model.num_heads", "4", "--model.num_kv_heads", "4", "--train.steps", "1",
            "--model.hf_path", str(hf), "--lora.rank", "8", "--lora.base", kind,
            "--parallel.tp", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        for measured, planned in run_ranks(_measure, 2, tmp, args):
            for item in ("params", "grads", "master", "optimizer"):
                assert planned[item] == measured[item], (kind, item, planned, measured)


def test_nf4_shard_that_blocks_cannot_tile_is_refused(hf_base, tmp_path, capsys):
    # intermediate 34 at tp2: gate/up shards are 17x32 = 544 weights, 8.5 NF4 blocks.
    hf = tmp_path / "odd"
    shutil.copytree(hf_base, hf)
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] = 34
    (hf / "config.json").write_text(json.dumps(config))
    code = main(["train", "--model.preset", "tiny", "--model.hf_path", str(hf),
                 "--model.intermediate_size", "34", "--data.tokenizer", "byte",
                 "--train.seq_len", "32", "--train.gbs", "4", "--train.device", "cpu",
                 "--parallel.tp", "2", "--lora.rank", "4", "--lora.base", "nf4",
                 "--checkpoint.dir", str(tmp_path / "ckpt"), "--log.dir",
                 str(tmp_path / "log"), "--log.tensorboard", "false"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "gate_proj is 17x32 = 544 weights, not a multiple of the NF4 block (64)" in err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "log").exists()


def _resume_run(rank, world, tmp, args, steps, resume):
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp), *LORA, *args)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
        if resume:
            assert trainer.load_checkpoint(Path(tmp) / "ckpt" / "step_00000002") is None
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        trainer.save_checkpoint()
    return losses


def test_qlora_tp2_resumes_the_same_run(hf_base):
    """A tp2 int8 QLoRA checkpoint (adapters only; each rank quantises its shard again on
    load) continues the run it left: 2 + 2 steps give the 4-step run's losses exactly."""
    args = ["--model.hf_path", str(hf_base), "--lora.base", "int8", "--parallel.tp", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        whole = run_ranks(_resume_run, 2, tmp, args, 4, False)[0]
    with tempfile.TemporaryDirectory() as tmp:
        first = run_ranks(_resume_run, 2, tmp, args, 2, False)[0]
        second = run_ranks(_resume_run, 2, tmp, args, 2, True)[0]
    assert first + second == whole, (first + second, whole)
