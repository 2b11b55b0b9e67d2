"""The planner's optimizer terms against the engine: state bytes per optimizer equal the
bytes the engine's optimizer holds (counted from its storages), tensor by tensor rules
included (small tensors keep fp32 states); the shapes it walks are the model's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fivefold.config.optim import OptimSection
from fivefold.models.init import build_meta, build_model
from fivefold.models.presets import preset
from fivefold.parallel.mesh import ParallelDims
from fivefold.plan.optimizer import (
    newton_schulz_flops,
    optimizer_state_bytes,
    param_shapes,
)
from fivefold.train.optim import MasterWeightOptimizer
from fivefold.train.precision import LossScaler

MODEL = dataclasses.replace(preset("nano"), vocab_size=256, hidden_size=64,
                            intermediate_size=128)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "adamw4bit", "adafactor", "muon"])
def test_planned_state_bytes_equal_the_engines(name):
    from fivefold.config import Config

    tr = Config().train
    tr.optimizer, tr.precision = name, "fp32"
    model = build_model(MODEL, 0)
    opt = MasterWeightOptimizer(list(model.named_parameters()), tr, ParallelDims.single(),
                                LossScaler(), OptimSection())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(1e-3)
    assert opt.memory_bytes()["optimizer"] == optimizer_state_bytes(MODEL, name)


@pytest.mark.parametrize("cfg", [preset("llama-25m"), dataclasses.replace(
    preset("nano"), num_experts=4, moe_intermediate_size=16, mlp="swiglu", qkv_bias=True,
    tie_embeddings=False, shared_expert_intermediate_size=8, shared_expert_gate=True)])
def test_planned_shapes_are_the_models(cfg):
    engine = {n: tuple(p.shape) for n, p in build_meta(cfg).named_parameters()}
    assert dict(param_shapes(cfg)) == engine


def test_planner_constants_are_the_engines():
    from fivefold.numerics import optim_states
    from fivefold.plan import optimizer

    assert optimizer.OPTIM_BLOCK == {8: optim_states.BLOCK_8BIT, 4: optim_states.BLOCK_4BIT}
    assert optimizer.OPTIM_MIN_QUANTISED == optim_states.MIN_QUANTISED


def test_newton_schulz_flops_of_one_matrix():
    """5 iterations of X·Xᵀ (2·m²·n), A·A (2·m³) and B·X (2·m²·n) on a 64x128 matrix."""
    cfg = dataclasses.replace(MODEL, num_layers=1)
    per = {(64, 64): 5 * (4 * 64 * 64 * 64 + 2 * 64 ** 3),
           (32, 64): 5 * (4 * 32 * 32 * 64 + 2 * 32 ** 3),
           (64, 128): 5 * (4 * 64 * 64 * 128 + 2 * 64 ** 3)}
    expected = (2 * per[(64, 64)] + 2 * per[(32, 64)]  # q, o; k, v
                + 3 * per[(64, 128)])  # gate, up, down
    assert newton_schulz_flops(cfg) == expected
