"""Hugging Face weights in training: the same checks as `load_hf`, per-rank slices read from
the safetensors files, peak host memory about a rank's slices, and export keeping the
imported architecture."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch
from common import small_config
from harness import run_ranks
from safetensors.torch import load_file, save_file

from fivefold.config import ConfigError
from fivefold.models.hf import save_hf
from fivefold.models.hf_config import hf_config_from_model, model_config_from_hf
from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.parallel.mesh import ParallelDims

SMALL = ModelConfig(name="s", vocab_size=256, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128)


def export(path: Path, cfg: ModelConfig = SMALL, max_shard_bytes: int = 10**9) -> Path:
    model = build_model(cfg, seed=5)
    return save_hf(model, cfg, path, max_shard_bytes=max_shard_bytes)


def edit(directory: Path, change) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def trainer(tmp_path: Path, hf: Path, *extra: str):
    from fivefold.train.trainer import Trainer

    return Trainer(small_config(tmp_path, "--model.hf_path", str(hf), *extra), quiet=True)


CASES = {
    "extra": (lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)),
              "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    "missing": (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
                "missing tensor 'model.layers.1.self_attn.k_proj.weight'"),
    "row": (lambda t: t.__setitem__("model.norm.weight", torch.ones(1)),
            "tensor 'model.norm.weight' has shape (1,)"),
    "broadcastable": (lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight",
                                              torch.ones(1, 64)),
                      "tensor 'model.layers.0.mlp.down_proj.weight' has shape (1, 64)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_hf_tensors_are_named_in_one_line(tmp_path, case):
    change, words = CASES[case]
    hf = export(tmp_path / "hf")
    edit(hf, change)
    with pytest.raises(ConfigError) as err:
        trainer(tmp_path, hf)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def _slices_and_memory(rank, world, tmp, hf):
    """Load at tp = world the old way (every stored tensor on every rank, sliced after; the
    safetensors files are memory-mapped, so what counts is the pages a rank touches) and
    through the slice reader; the growth of peak RSS (VmHWM, file pages included) in each."""
    import gc

    from fivefold.models.hf import iter_hf_tensors
    from fivefold.models.hf_slices import load_hf_slices
    from fivefold.parallel.shards import local_piece
    from fivefold.parallel.tensor import gather_full_state
    from fivefold.train.trainer import Trainer

    # Large blocks always from mmap and back to the system when freed (glibc otherwise raises
    # its mmap threshold after frees and serves later tensors from already-resident heap,
    # which would hide what a load costs).
    _libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    cfg = small_config(Path(tmp), "--model.hf_path", hf, "--parallel.tp", str(world),
                       *BIG_ARGS)
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as t:
        named = t.model.named_parameters()

        def peak_growth(load) -> int:
            gc.collect()
            _libc.malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            before = _status("VmRSS")
            load()
            return _status("VmHWM") - before

        def before_this_change():  # the trainer's HF load until now: every tensor, whole
            full = dict(iter_hf_tensors(hf))
            with torch.no_grad():
                for name, p in named:
                    p.copy_(local_piece(p, full[name]).to(p.dtype))

        whole = peak_growth(before_this_change)
        sliced = peak_growth(lambda: load_hf_slices(hf, named, t.model_cfg))
        state = gather_full_state(t.model.chunks[0], t.dims)
        local = sum(p.numel() * p.element_size() for _, p in named)
    return {"sliced": sliced, "whole": whole, "local": local, "state": state}


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_libc = ctypes.CDLL("libc.so.6")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


BIG = ModelConfig(name="b", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                  num_layers=2, num_heads=8, num_kv_heads=4, max_seq_len=128)
BIG_ARGS = ["--model.hidden_size", "512", "--model.intermediate_size", "1536",
            "--model.num_heads", "8", "--model.num_kv_heads", "4", "--model.vocab_size", "4096"]


def test_each_rank_reads_its_slices_of_a_sharded_checkpoint(tmp_path):
    """A 4-shard checkpoint at tp 4: every rank's weights gather back to the stored ones, and
    a rank's peak host memory grows by about its own slices while loading (the previous
    load's growth is measured in the same process and printed beside it)."""
    model = build_model(BIG, seed=5)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    hf = save_hf(model, BIG, tmp_path / "hf", max_shard_bytes=total // 4 + 1)
    assert len(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"])
    expected = dict(model.named_parameters())
    results = run_ranks(_slices_and_memory, 4, str(tmp_path), str(hf))
    for out in results:
        for name, value in out["state"].items():
            assert torch.equal(value, expected[name].detach()), name
        # Its slices, plus at most one parameter's worth of scratch; never the checkpoint.
        assert out["sliced"] <= out["local"] + total // 8, (out, total)
    print(f"peak RSS growth per rank while loading {total / 2**20:.1f} MiB at tp 4: sliced "
          f"{max(o['sliced'] for o in results) / 2**20:.1f} MiB (its slices: "
          f"{results[0]['local'] / 2**20:.1f} MiB); the previous whole-tensor load "
          f"{max(o['whole'] for o in results) / 2**20:.1f} MiB")


def test_export_keeps_the_imported_architecture(tmp_path):
    hf = export(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["architectures"], config["model_type"] = ["MistralForCausalLM"], "mistral"
    config["sliding_window"] = 4096
    (hf / "config.json").write_text(json.dumps(config))
    cfg = model_config_from_hf(hf)
    assert hf_config_from_model(cfg)["architectures"] == ["MistralForCausalLM"]
    restored = ModelConfig(**json.loads(json.dumps(cfg.__dict__)))  # as checkpoints store it
    assert hf_config_from_model(restored)["model_type"] == "mistral"
    assert hf_config_from_model(SMALL)["architectures"] == ["LlamaForCausalLM"]
