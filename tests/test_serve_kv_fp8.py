"""The FP8 (e4m3) KV cache: half the bytes of bf16, so twice the blocks, as the planner's
`--kv-dtype fp8` plans; what it stores is each key and value rounded to e4m3 under its
layer's and head's scale; with calibrated scales a batch gives what each request gives alone.
Quality on trained models: bench/serve/kv_fp8.py."""

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.llama import KVCache
from fivefold.models.presets import ModelConfig
from fivefold.plan.serve import kv_bytes_per_token, num_blocks
from fivefold.serve.engine import Engine
from fivefold.serve.kv_cache import FP8, FP8_MAX, calibrate_kv_scales, sdpa
from fivefold.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(name="fp8-kv", vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype, name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_fp8_blocks_equal_the_plan_and_double_bf16(dtype, name):
    model = build_model(CFG, seed=1, dtype=dtype).eval()
    budget = 3 * 2**20 + 12345  # not a whole number of blocks
    fp8 = Engine(model, kv_cache_bytes=budget, kv_cache_dtype="fp8")
    assert fp8.cache.k.dtype == FP8
    assert fp8.num_blocks == num_blocks(budget, CFG, 16, "fp8")
    assert fp8.cache.nbytes == fp8.num_blocks * 16 * kv_bytes_per_token(CFG, "fp8")
    bf16 = num_blocks(budget, CFG, 16, "bf16")
    assert fp8.num_blocks in (2 * bf16, 2 * bf16 + 1)  # floor(2x) vs 2 floor(x)
    plain = Engine(model, kv_cache_bytes=budget)
    assert plain.num_blocks == num_blocks(budget, CFG, 16, name)


class RoundingCache:
    """The oracle: a dense forward whose attention reads each key and value rounded to e4m3
    under the given per-head scales, recording what it read."""

    def __init__(self, k_scale, v_scale):
        self.scales, self.read = (k_scale, v_scale), []

    def attend(self, layer, q, k, v):
        k, v = ((x / s[layer][:, None, None]).to(FP8).float() * s[layer][:, None, None]
                for x, s in zip((k, v), self.scales, strict=True))
        self.read.append((k[0], v[0]))
        return sdpa(q, k, v, causal=True)


def test_the_cache_holds_each_key_rounded_to_e4m3_under_its_heads_scale():
    model = build_model(CFG, seed=2).eval()
    (prompt,) = prompts([70])
    engine = Engine(model, num_blocks=32, kv_cache_dtype="fp8")
    engine.generate([prompt], SamplingParams.greedy_params(1))
    cache = engine.cache
    oracle = RoundingCache(cache.k_scale, cache.v_scale)
    model(torch.tensor([prompt]), cache=oracle)
    dense = KVCache(CFG, 1, 80, "cpu", torch.float32)
    model(torch.tensor([prompt]), cache=dense)
    slots = torch.tensor(cache.block_slots(list(range(5)), 70))  # a fresh pool's first blocks
    for layer in range(CFG.num_layers):
        k, v = cache.gather(layer, slots)  # (kv_heads, 70, d), as attention reads them
        torch.testing.assert_close(k, oracle.read[layer][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, oracle.read[layer][1], rtol=1e-6, atol=1e-7)
    # layer 0 sees the same input as the unrounded model: the rounding error alone. e4m3
    # keeps 3 mantissa bits, so rounding moves a value by at most 2^-4 of itself, or half
    # the smallest subnormal step (2^-9 · scale) near zero; on the fly, amax / 200 (keys)
    # and amax / 100 (values) leave every value of the first write inside +-448
    k, v = cache.gather(0, slots)
    for got, want, scale in ((k, dense.k[0, 0, :, :70], cache.k_scale[0]),
                             (v, dense.v[0, 0, :, :70], cache.v_scale[0])):
        s = scale[:, None, None]
        assert (want.abs() / s).amax() <= FP8_MAX
        assert ((got - want).abs() <= want.abs() / 16 + s * 2**-10 + 1e-7).all()
        assert (got != want).any()  # it did round


def test_fp8_with_calibrated_scales_a_batch_equals_each_alone_and_preemption():
    model = build_model(CFG, seed=3).eval()
    batch = prompts([5, 40, 100, 17, 60, 33])
    scales = calibrate_kv_scales(model, prompts([120, 90], seed=9))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def engine(**kw):
        return Engine(model, kv_cache_dtype="fp8", kv_scales=scales, **kw)

    alone = [engine(num_blocks=16).generate([p], params)[0].token_ids for p in batch]
    together = engine(num_blocks=64).generate(batch, params)
    assert [o.token_ids for o in together] == alone
    tight = engine(num_blocks=12, max_model_len=128)  # 6 requests of <= 8 blocks: preemptions
    squeezed = tight.generate(batch, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in squeezed] == alone
