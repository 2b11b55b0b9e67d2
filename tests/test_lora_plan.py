"""The planner's LoRA / QLoRA against the engine: model-state bytes per rank (frozen base in
its storage, adapters with their optimizer states) counted from the tensors' storages, and
`fivefold plan --lora-rank R --lora-base nf4`."""

import dataclasses
import tempfile
from pathlib import Path

import pytest
from common import save_tiny_hf_llama, small_config
from harness import run_ranks

from fivefold.models.presets import preset
from fivefold.parallel.buffers import storage_bytes
from fivefold.parallel.mesh import ParallelDims
from fivefold.plan.flops import model_flops_per_token
from fivefold.plan.lora import base_bytes_per_param, lora_flops_per_token
from fivefold.plan.model_states import model_state_bytes

# Matrices of at least 64·256 weights, so NF4's scaler blocks are whole (no padding).
SHAPE = ["--model.hidden_size", "128", "--model.intermediate_size", "256",
         "--model.num_heads", "4", "--model.num_kv_heads", "4", "--train.steps", "1"]


def _measure(rank, world, tmp, args):
    from fivefold.finetune.attach import frozen_state
    from fivefold.train.loop import planned_model_states
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp) / f"r{rank}", *SHAPE, *args)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
        trainer.train_step()
        measured = trainer.optimizer.memory_bytes()
        measured["params"] += storage_bytes(frozen_state(trainer.model.chunks))
        return measured, planned_model_states(trainer)


@pytest.mark.parametrize("args", [
    ["--lora.rank", "8"],
    ["--lora.rank", "8", "--train.precision", "bf16"],
    ["--lora.rank", "4", "--lora.targets", "q_proj,v_proj", "--lora.base", "int8"],
    ["--lora.rank", "8", "--lora.base", "nf4"],
], ids=["fp32", "bf16", "int8-qv", "nf4"])
def test_planned_model_states_equal_the_engine(args, tmp_path):
    hf = []
    if "--lora.base" in args:
        hf = ["--model.hf_path", str(_hf_base(tmp_path))]
    with tempfile.TemporaryDirectory() as tmp:
        measured, planned = run_ranks(_measure, 1, tmp, args + hf)[0]
    for item in ("params", "grads", "master", "optimizer"):
        assert abs(planned[item] - measured[item]) <= 1e-9 * max(measured[item], 1), (
            item, planned[item], measured[item])


def test_planned_model_states_under_dp2_zero2_zero3_and_tp2():
    for layout in (["--parallel.dp", "2", "--parallel.zero", "2"],
                   ["--parallel.dp", "2", "--parallel.zero", "3"], ["--parallel.tp", "2"]):
        with tempfile.TemporaryDirectory() as tmp:
            for measured, planned in run_ranks(_measure, 2, tmp, ["--lora.rank", "8", *layout]):
                for item in ("params", "grads", "master", "optimizer"):
                    assert planned[item] == measured[item], (layout, item, planned, measured)


def _hf_base(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "hf"
    save_tiny_hf_llama(path, hidden=128, intermediate=256, kv_heads=4)
    return path


def test_qlora_bytes_and_flops_of_a_real_model():
    model = preset("llama-3.1-8b")
    assert base_bytes_per_param("nf4", 2, 4096) <= 0.55  # 4.127 bits
    full = model_state_bytes(model, precision="bf16")
    qlora = model_state_bytes(model, precision="bf16", lora_rank=16, lora_base="nf4")
    lora = model_state_bytes(model, precision="bf16", lora_rank=16)
    assert qlora.total < lora.total < full.total / 7
    ratio = lora_flops_per_token(model, 2048, 16, "all-linear") / model_flops_per_token(
        model, 2048)
    assert 0.6 < ratio < 0.75  # ~2/3: the base's weight-gradient GEMMs are skipped


def test_plan_cli_lora_flags(capsys):
    from fivefold.cli import main

    code = main(["plan", "--model", "llama-3.1-8b", "--gpus", "1", "--lora-rank", "16",
                 "--lora-base", "nf4", "--seq-len", "2048", "--gbs", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "LoRA" in out, out
    assert dataclasses  # noqa: B018 - keeps the import for dataclass-based helpers


def _peaks(rank, world, tmp, args):
    from fivefold.parallel.peak import PeakTracker
    from fivefold.train.loop import planned_peak_bytes
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp) / f"r{rank}", *SHAPE, "--train.steps", "2", *args)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
        trainer.train_step()
        with PeakTracker(trainer.peak_sources()) as tracker:
            trainer.train_step()
        return dict(tracker.item_peaks), planned_peak_bytes(trainer)


@pytest.mark.parametrize("args", [["--lora.rank", "8"],
                                  ["--lora.rank", "8", "--train.recompute", "full"]],
                         ids=["none", "recompute-full"])
def test_planned_activations_and_states_at_the_peak(args):
    """Each item's own peak over a step (peak tracker) against the planner's item: the model
    states exactly, activations and the head's logits within 3% (the full-training agreement
    tests allow 2.5%)."""
    with tempfile.TemporaryDirectory() as tmp:
        measured, planned = run_ranks(_peaks, 1, tmp, args)[0]
    for item in ("params", "grads", "master", "optimizer"):
        assert measured[item] == planned[item], (item, measured, planned)
    for item in ("activations", "logits_loss"):
        assert abs(measured[item] - planned[item]) <= 0.03 * planned[item], (
            item, measured[item], planned[item])
