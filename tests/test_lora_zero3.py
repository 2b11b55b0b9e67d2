"""ZeRO-3 shards a LoRA/QLoRA run's frozen base too (parallel/zero3_frozen.py): dp2 + ZeRO-3
with a plain, NF4 or int8 base matches the single-process run (fp32, same seed and global
batch; tolerances of tests/test_lora_parallel.py: losses 1e-6 relative, gradient norms 1e-5
relative, adapters 1e-5 absolute), each rank keeps 1/2 of every block's frozen bytes (counted
from the tensors' storages after the step), and the planner's model-state bytes equal the
engine's."""

import tempfile
from pathlib import Path

import pytest
from common import assert_same_lora_run, save_tiny_hf_llama, small_config
from harness import run_ranks

from fivefold.parallel.mesh import ParallelDims

# Matrices of at least 64·256 weights, so NF4's scaler blocks are whole (the planner's NF4
# bytes are then exact). train.eps = 1e-4 as in tests/test_lora_parallel.py.
ARGS = ["--model.hidden_size", "128", "--model.intermediate_size", "256",
        "--model.num_heads", "4", "--model.num_kv_heads", "4",
        "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "all-linear",
        "--train.lr", "1e-2", "--train.steps", "3", "--train.eps", "1e-4"]


def _run(rank, world, tmp, args):
    from fivefold.finetune.attach import frozen_state
    from fivefold.parallel.buffers import storage_bytes
    from fivefold.parallel.zero3_frozen import block_frozen_tensors
    from fivefold.train.loop import planned_model_states
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp) / f"r{rank}", *ARGS, *args)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
        records = [trainer.train_step() for _ in range(cfg.train.steps)]
        chunks = trainer.model.chunks
        blocks = [b for c in chunks for b in (c.layers.values() if hasattr(c.layers, "values")
                                               else c.layers)]  # a pipeline stage's ModuleDict
        block_tensors = [t for b in blocks for *_, t in block_frozen_tensors(b)]
        frozen = getattr(trainer.optimizer, "frozen", None)
        shard = [] if frozen is None else [frozen.shard]
        measured = trainer.optimizer.memory_bytes() if world > 1 else {}
        if measured:
            measured["params"] += storage_bytes(frozen_state(chunks))
        out = {
            "losses": [r["loss"] for r in records],
            "norms": [r["grad_norm"] for r in records],
            "adapters": {k: v for k, v in trainer.logical_tensors().items()
                         if k.startswith("model/")},
            # resident frozen bytes: the whole tensors left whole, plus this rank's shard
            "resident": storage_bytes(frozen_state(chunks)) + storage_bytes(shard),
            "block_bytes": [sum(t.numel() * t.element_size()
                                for *_, t in block_frozen_tensors(b)) for b in blocks],
            "block_storage": storage_bytes(block_tensors),  # gathered copies still held
            "shard": storage_bytes(shard),
            "measured": measured,
            "planned": planned_model_states(trainer) if world > 1 else {},
        }
    return out


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("zero3-lora") / "hf"
    save_tiny_hf_llama(path, hidden=128, intermediate=256, kv_heads=4)
    return path


@pytest.fixture(scope="module")
def singles():
    return {}  # base -> the single-process run (one per base, shared by the layouts)


ZERO3 = ["--parallel.dp", "2", "--parallel.zero", "3"]


@pytest.mark.parity
@pytest.mark.parametrize("base,layout,world", [
    ("none", ZERO3, 2), ("nf4", ZERO3, 2), ("int8", ZERO3, 2),
    ("nf4", ZERO3 + ["--parallel.pp", "2", "--train.recompute", "full"], 4),
], ids=["lora", "nf4", "int8", "nf4-pp2-recompute"])
def test_zero3_shards_the_frozen_base(hf_base, singles, base, layout, world):
    args = ["--model.hf_path", str(hf_base), "--lora.base", base]
    if base not in singles:
        with tempfile.TemporaryDirectory() as tmp:
            singles[base] = run_ranks(_run, 1, tmp, args)[0]
    single = singles[base]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(_run, world, tmp, args + layout)

    # The same run: losses, gradient norms, final adapters.
    assert_same_lora_run(single["losses"], single["norms"], single["adapters"],
                         [(r["losses"], r["norms"], r["adapters"]) for r in ranks],
                         width=256)  # ffn 256: the longest GEMM

    # Resident frozen bytes: the blocks' frozen bytes halved (each block padded to even),
    # the rest (tied embedding, final norm) whole; no gathered block left after the step.
    # Under pp2 each stage shards its own block (its end of the tied embedding stays whole).
    blocks = single["block_bytes"]
    assert sum(blocks) > 0
    rest = single["resident"] - sum(blocks)
    for r in ranks:
        assert r["block_storage"] == 0
        assert r["shard"] == sum(-(-b // 2) for b in r["block_bytes"]) > 0
        if world == 2:
            assert r["block_bytes"] == blocks
            assert r["resident"] == rest + sum(-(-b // 2) for b in blocks), (
                r["resident"], rest, blocks)

    # The planner's model states (frozen shard included) equal the engine's, to the byte.
    for r in ranks:
        for item in ("params", "grads", "master", "optimizer"):
            assert r["planned"][item] == r["measured"][item], (item, r["planned"],
                                                               r["measured"])


def _peaks(rank, world, tmp, args):
    from fivefold.parallel.peak import PeakTracker
    from fivefold.train.loop import planned_peak_bytes
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp) / f"r{rank}", *ARGS, *args)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as trainer:
        trainer.train_step()
        with PeakTracker(trainer.peak_sources()) as tracker:
            trainer.train_step()
        return dict(tracker.item_peaks), planned_peak_bytes(trainer)


def test_zero3_gathered_frozen_blocks_at_the_peak():
    """Over a step (peak tracker), 4 blocks: the resident params (adapter and frozen shards,
    the whole rest) and the comm buffers (at most two blocks' frozen bases and adapters
    gathered at once, forward and backward) equal the planner's items to the byte."""
    args = ["--model.num_layers", "4", "--parallel.dp", "2", "--parallel.zero", "3"]
    with tempfile.TemporaryDirectory() as tmp:
        for measured, planned in run_ranks(_peaks, 2, tmp, args):
            for item in ("params", "comm_buffers"):
                assert measured[item] == planned[item], (item, measured, planned)
