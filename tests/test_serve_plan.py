"""`fivefold plan --serve` against the serving engine: the same block counts, pool bytes and
concurrent sequences, exactly; and the formulas on known numbers."""

import json

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig, preset
from fivefold.plan.cli_entry import main as plan_main
from fivefold.plan.serve import (
    kv_bytes_per_token,
    num_blocks,
    plan_serving,
    weight_bytes_read,
)
from fivefold.serve.engine import Engine
from fivefold.serve.sampling_params import SamplingParams

CFG = ModelConfig(name="plan-serve", vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=128, init_std=0.1)


def test_kv_bytes_per_token_of_known_models():
    # Llama 3.1 8B: 32 layers, 8 kv heads of 128 -> 128 KiB per token in bf16
    assert kv_bytes_per_token(preset("llama-3.1-8b"), "bf16") == 131072
    # Llama 2 7B has no GQA: 32 heads of 128 -> 512 KiB per token
    assert kv_bytes_per_token(preset("llama-2-7b"), "bf16") == 524288
    assert kv_bytes_per_token(preset("llama-3.1-8b"), "fp8") == 65536


def test_roofline_and_moe_weights_read():
    m = preset("llama-3.1-8b")
    plan = plan_serving(m, 3.35e12, 80 * 2**30, 1.5 * 2**30, batch=1, context=1, output=2)
    # batch 1: ~all weight bytes per token, so tokens/s ~ bandwidth / bf16 weights
    assert plan.roofline_tokens_per_s == pytest.approx(3.35e12 / plan.bytes_read_per_step)
    assert plan.bytes_read_per_step == pytest.approx(
        weight_bytes_read(m, "bf16", 1) + 2 * kv_bytes_per_token(m))
    moe = preset("mixtral-8x7b")
    one, many = weight_bytes_read(moe, "bf16", 1), weight_bytes_read(moe, "bf16", 256)
    assert one < many and many == pytest.approx(moe.num_params() * 2 - moe.vocab_size *
                                                moe.hidden_size * 2, rel=1e-3)


@pytest.mark.parametrize("dtype, name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_engine_pool_equals_the_plan(dtype, name):
    model = build_model(CFG, seed=1, dtype=dtype).eval()
    budget = 3 * 2**20 + 12345  # not a whole number of blocks
    engine = Engine(model, kv_cache_bytes=budget, block_size=16)
    assert engine.num_blocks == num_blocks(budget, CFG, 16, name)
    assert engine.cache.nbytes == engine.num_blocks * 16 * kv_bytes_per_token(CFG, name)


def test_engine_runs_exactly_the_planned_number_of_sequences_at_once(one_thread):
    model = build_model(CFG, seed=1).eval()
    context, output, block = 40, 24, 16  # 64 tokens: 4 blocks a request
    per_token = kv_bytes_per_token(CFG, "fp32")
    planned = 5
    budget = (4 * planned + 2) * block * per_token + block * per_token - 1  # 22 blocks
    plan = plan_serving(CFG, 1e9, 0, 0, weights="fp32", kv_dtype="fp32", context=context,
                        output=output, block_size=block, kv_budget_bytes=budget)
    assert plan.num_blocks == 22 and plan.max_concurrent_sequences == planned
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    for count, preempted in ((planned, False), (planned + 1, True)):
        engine = Engine(model, kv_cache_bytes=budget, block_size=block,
                        enable_prefix_caching=False)
        assert engine.num_blocks == plan.num_blocks
        prompts = [torch.randint(0, 128, (context,), generator=g).tolist()
                   for _ in range(count)]
        engine.generate(prompts, params)
        # the planned number fit side by side; one more cannot grow without a preemption
        assert (engine.scheduler.num_preemptions > 0) == preempted


def test_plan_serve_command(capsys, tmp_path):
    assert plan_main(["--serve", "--model", "llama-3.1-8b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 131072 and data["blocks_per_sequence"] == 144
    assert data["max_concurrent_sequences"] == data["num_blocks"] // 144
    assert plan_main(["--serve", "--model", "llama-3.1-8b", "--weights", "int9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --weights int9") and err.count("\n") == 1
    assert plan_main(["--serve", "--model", "llama-3.1-70b"]) == 2  # no room for a KV cache
