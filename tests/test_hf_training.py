"""Training from Hugging Face weights (`model.hf_path`), under one process and under TP."""

import pathlib

import pytest
import torch
from common import save_tiny_hf_llama, small_config
from harness import run_ranks

from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.tensor import gather_full_state
from fivefold.train.trainer import Trainer

transformers = pytest.importorskip("transformers")


def save_hf_llama(path: pathlib.Path):
    return save_tiny_hf_llama(path, tied=False, max_position_embeddings=128)


def hf_args(path):
    return ["--model.hf_path", str(path), "--train.precision", "fp32"]


def gathered(rank, world, tmp, path):
    cfg = small_config(pathlib.Path(tmp), *hf_args(path), "--parallel.tp", "2")
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    return gather_full_state(trainer.model.chunks[0], trainer.dims)


def test_trainer_starts_from_hf_weights(tmp_path):
    hf = save_hf_llama(tmp_path / "hf")
    trainer = Trainer(small_config(tmp_path, *hf_args(tmp_path / "hf")), quiet=True)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (trainer.model.chunks[0](tokens) - hf(tokens).logits).abs().max()
    assert diff <= 1e-5
    expected = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    for rank_state in run_ranks(gathered, 2, str(tmp_path), tmp_path / "hf"):
        for name, value in rank_state.items():
            assert torch.equal(value, expected[name]), name
