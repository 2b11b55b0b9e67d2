"""The fused serving forward (serve/fused.py) against the model's own forward.

Same weights, same steps: the logits of every step (prefills, decodes, mixed, chunked)
agree within the float32 error model (tests/tolerances.py: the fused GEMMs may block their
sums differently), greedy tokens are identical, and the model keeps its weights as views of
the fused ones (no second copy, the same values).
"""

import math

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.serve.engine import Engine
from fivefold.serve.fused import FusedLlama, fusable
from fivefold.serve.kv_cache import PagedKVCache
from fivefold.serve.sampling_params import SamplingParams
from fivefold.train.generate import generate
from tests.tolerances import sum_rtol

CFG = ModelConfig(name="fused", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=512, init_std=0.1)

pytestmark = pytest.mark.usefixtures("one_thread")


def workload(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, CFG.vocab_size, (int(torch.randint(1, 120, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(torch.randint(1, 24, (1,), generator=g)),
                             temperature=0.0) for _ in range(n)]
    return prompts, params


def forward_rtol(cfg: ModelConfig) -> float:
    """Norm-wise relative error of logits between two GEMM blockings: each of the 3 GEMMs
    a layer (width ≤ ffn, κ ≈ √width) in quadrature, two runs √2 apart."""
    width = max(cfg.hidden_size, cfg.intermediate_size)
    return math.sqrt(2) * sum_rtol(width, math.sqrt(width)) * math.sqrt(3 * cfg.num_layers + 1)


def test_which_models_fuse():
    assert fusable(build_model(CFG, seed=0)) is None
    assert "SwiGLU" in fusable(build_model(CFG.replace(mlp="gelu"), seed=0))
    assert "q/k norm" in fusable(build_model(CFG.replace(qk_norm=True), seed=0))
    model = build_model(CFG, seed=0)
    model.layers[1].mlp.up_proj = torch.nn.Identity()
    assert "layer 1" in fusable(model)
    with pytest.raises(ValueError, match="cannot fuse"):
        FusedLlama(model)


def test_every_step_matches_the_models_forward_and_greedy_tokens_are_identical():
    model = build_model(CFG, seed=5).eval()
    prompts, params = workload(12, seed=1)
    engines = [Engine(model, num_blocks=96, max_num_batched_tokens=256, chunked_prefill=True,
                      fuse=fuse) for fuse in (True, False)]
    assert engines[0].runner.fused is not None and engines[1].runner.fused is None
    for e in engines:
        for p, sp in zip(prompts, params):
            e.add_request(p, sp)
    bound, steps, decodes = forward_rtol(CFG), 0, 0
    while engines[1].has_unfinished():
        outs, logits, tokens = [], [], []
        for e in engines:
            out = e.scheduler.schedule()
            rows = e.runner.execute(out)
            sampled = {rid: int(rows[rid].argmax()) for rid in rows.ids}
            e.scheduler.update_from_output(out, sampled)
            outs.append([(r.request_id, n) for r, n in out.scheduled])
            logits.append(rows.rows)
            tokens.append(sampled)
        assert outs[0] == outs[1] and tokens[0] == tokens[1]
        decodes += all(n == 1 for _, n in outs[0])
        err = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
        assert err <= bound, (steps, err, bound)
        steps += 1
    assert steps > 20 and decodes > 10  # mixed steps and decode-only (the lean path) both ran


def test_fused_engine_gives_the_dense_paths_greedy_tokens_in_one_call_and_groups():
    model = build_model(CFG, seed=7).eval()
    prompts, params = workload(16, seed=2)
    dense = [generate(model, p, sp.max_tokens, greedy=True) for p, sp in zip(prompts, params)]
    for group_bytes in (None, 256 * 40):  # one call a layer (as on CUDA); small groups
        engine = Engine(model, num_blocks=160)
        engine.cache.decode_group_bytes = group_bytes
        assert [o.token_ids for o in engine.generate(prompts, params)] == dense


def test_bf16_fused_and_modules_agree():
    model = build_model(CFG, seed=9).eval().to(torch.bfloat16)
    prompts, params = workload(8, seed=3)
    a, b = (Engine(model, num_blocks=96, fuse=f).generate(prompts, params) for f in (True, False))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_the_model_keeps_its_weights_as_views_of_the_fused_ones():
    model = build_model(CFG, seed=11).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bytes_before = sum(p.untyped_storage().nbytes() for p in model.parameters())
    engine = Engine(model, num_blocks=64)
    layer, attn = engine.runner.fused.layers[0], model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == \
            layer.qkv_w.untyped_storage().data_ptr()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    assert sum(storages.values()) == bytes_before  # nothing stored twice


def test_block_rows_are_each_layers_k_and_v_blocks():
    cache = PagedKVCache(3, 2, 4, num_blocks=5, block_size=4, dtype=torch.float32,
                         device="cpu")
    cache.kv_ext.copy_(torch.randn(cache.kv_ext.shape))
    assert cache.k_ext.data_ptr() == cache.kv_ext.data_ptr()  # views of the one tensor
    assert cache.k.shape == (3, 20, 2, 4) and cache.trash_slot == 20
    rows, offsets = cache.block_rows()
    for layer in range(3):
        for block in range(5):
            for i, pool in enumerate((cache.k, cache.v)):
                assert torch.equal(rows[block + offsets[layer, i, 0]],
                                   pool[layer].reshape(5, -1)[block])


def test_decode_attention_takes_k_and_v_adjacent_or_apart_alike():
    """The lean decode writes K and V with one index_copy_ when they are adjacent columns
    of the QKV rows (as layers_forward passes them), with two otherwise: the same pool and
    output, bit for bit."""
    model = build_model(CFG, seed=13).eval()
    engine = Engine(model, num_blocks=64)
    for n in (5, 17, 9):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the prefills
    out = engine.scheduler.schedule()
    step = engine.runner.prepare(out)
    cache, fused = engine.cache, engine.runner.fused
    T, H, KV, d = 3, CFG.num_heads, CFG.num_kv_heads, fused.head_dim
    qkv = torch.randn(T, (H + 2 * KV) * d)
    q = qkv[:, :H * d].view(T, H, d)
    k, v = qkv[:, H * d:(H + KV) * d].view(T, KV, d), qkv[:, (H + KV) * d:].view(T, KV, d)
    before = cache.kv_ext.clone()
    cache.batch = step.batch
    try:
        results = []
        for kk, vv in ((k, v), (k.clone(), v.clone())):
            cache.kv_ext.copy_(before)
            attend = fused._attention_for(cache, T)
            results.append((attend(1, q, kk, vv), cache.kv_ext.clone()))
    finally:
        cache.batch = None
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][1], before)  # the step's K and V were written
