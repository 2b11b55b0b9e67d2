"""The float32 decode step of the fused forward (serve/fused_decode.py) against the fused
forward's general layer loop (serve/fused.py, `lean_decode = False`) and the model's own
forward: the same greedy tokens, and logits within the float32 error model below, over
decode steps with equal and unequal lengths (a mask), one and several decode groups, with
and without q/k/v biases.

The error model: the step differs from the layer loop by the order of its sums, never by
its arithmetic. Each GEMM of length `width` (κ ≈ √width) moves a logit by sum_rtol(width,
√width) (tests/tolerances.py), 3 GEMMs a layer and the head; each norm by its sum of
hidden + 1 squares (all positive: κ = 1), halved by the square root, plus three single
roundings (√hidden·g, the product, the quotient) and RoPE's fused multiply-add (one ulp);
the errors independent, so in quadrature, and two runs √2 apart.
"""

import math

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.serve import fused_decode
from fivefold.serve.engine import Engine
from fivefold.serve.fused import FusedLlama
from fivefold.serve.sampling_params import SamplingParams
from tests.tolerances import U32, sum_rtol

CFG = ModelConfig(name="fused-decode", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=512, init_std=0.1)

pytestmark = pytest.mark.usefixtures("one_thread")


def step_rtol(cfg: ModelConfig) -> float:
    """Norm-wise relative error of the logits between two orders of sums (module docstring)."""
    width = max(cfg.hidden_size, cfg.intermediate_size)
    gemm = sum_rtol(width, math.sqrt(width))
    norm = sum_rtol(cfg.hidden_size + 1) / 2 + 4 * U32
    layers = cfg.num_layers
    return math.sqrt(2) * math.sqrt((3 * layers + 1) * gemm**2 + (2 * layers + 1) * norm**2)


def test_the_norm_by_one_vector_norm_is_rms_norm():
    """The norm as the step computes it (the fused forward's constant column and √n·g,
    vector_norm) against torch.rms_norm, element by element: the sum of squares in another
    order (relative λ·√(n+1)·u, halved by the root) and six roundings of the two. At the
    smallest scale ε is a tenth of the mean square."""
    fused = FusedLlama(build_model(CFG.replace(norm_eps=1e-5), seed=2).eval())
    n, g1 = CFG.hidden_size, fused.norm_scales[0][0]
    gen = torch.Generator().manual_seed(0)
    for scale in (1e-2, 1.0, 30.0):
        x = torch.randn(33, n, generator=gen) * scale
        hx = torch.cat((x, fused.norm_column.expand(33, 1)), 1)
        got = x.mul(g1).div_(torch.linalg.vector_norm(hx, 2, 1, True))
        want = torch.rms_norm(x, (n,), fused.layers[0].norm1, fused.eps)
        bound = sum_rtol(n + 1) / 2 + 6 * U32
        assert ((got - want).abs() <= bound * want.abs()).all(), scale


def _engines(model, group_bytes):
    engines = []
    for variant in ("lean", "loop", "modules"):
        e = Engine(model, num_blocks=128, fuse=variant != "modules")
        if variant == "loop":
            e.runner.fused.lean_decode = False
        e.cache.decode_group_bytes = group_bytes
        engines.append(e)
    return engines


@pytest.mark.parametrize("qkv_bias, group_bytes", [(False, None), (False, 256 * 24),
                                                   (True, 256 * 24)])
def test_decode_steps_match_the_layer_loop_and_the_modules(qkv_bias, group_bytes,
                                                           monkeypatch):
    cfg = CFG.replace(qkv_bias=qkv_bias)
    model = build_model(cfg, seed=3).eval()
    if qkv_bias:  # biases that matter (initialised to zero)
        with torch.no_grad():
            for block in model.layers:
                for proj in (block.self_attn.q_proj, block.self_attn.k_proj,
                             block.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    calls = []
    real = fused_decode.decode_layers
    monkeypatch.setattr(fused_decode, "decode_layers",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    engines = _engines(model, group_bytes)
    g = torch.Generator().manual_seed(1)
    for i, length in enumerate((5, 5, 5, 17, 30, 9)):  # equal lengths, then mixed ones
        prompt = torch.randint(3, cfg.vocab_size, (length,), generator=g).tolist()
        for e in engines:
            e.add_request(prompt, SamplingParams(max_tokens=12 + i, temperature=0))
    bound, lean_steps = step_rtol(cfg), 0
    while engines[2].has_unfinished():
        logits, tokens = [], []
        for e in engines:
            out = e.scheduler.schedule()
            before = len(calls)
            rows = e.runner.execute(out)
            ran = len(calls) > before
            if e is engines[0]:
                decode_only = all(n == 1 for _, n in out.scheduled)
                assert ran == decode_only  # every float32 decode-only step, and only those
                lean_steps += ran
            else:
                assert not ran
            sampled = {rid: int(rows[rid].argmax()) for rid in rows.ids}
            e.scheduler.update_from_output(out, sampled)
            logits.append(rows.rows)
            tokens.append(sampled)
        assert tokens[0] == tokens[1] == tokens[2]
        for other in logits[1:]:
            err = ((logits[0] - other).norm() / other.norm()).item()
            assert err <= bound, (err, bound)
    assert lean_steps >= 10
    if group_bytes is not None:  # several decode groups a step did run
        assert len(engines[0].cache.decode_groups([40] * 6)) > 1


def test_bf16_and_prefills_take_the_layer_loop(monkeypatch):
    model = build_model(CFG, seed=4).eval().to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(fused_decode, "decode_layers", lambda *a, **k: calls.append(1))
    engine = Engine(model, num_blocks=64)
    out = engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert [len(o.token_ids) for o in out] == [4, 4] and not calls


def test_a_layers_new_keys_match_the_layer_loop_element_by_element():
    """Layer 0's keys of one decode step, the step against the layer loop from the same
    pool: k = rope(norm(h) · Wₖᵀ). The normalised inputs differ by at most `norm` relative
    (test above); each dot product of length n then by norm·(|x|·|Wₖ|ᵀ) plus both
    orders' sums, 2·λ√n·u·(|x|·|Wₖ|ᵀ); RoPE (|cos|, |sin| ≤ 1) mixes an element with its
    partner and adds two roundings (one fewer with the FMA) of each product."""
    model = build_model(CFG, seed=6).eval()
    engine = Engine(model, num_blocks=64)
    for n in (7, 7, 19):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the prefills
    step = engine.runner.prepare(engine.scheduler.schedule())
    cache, fused = engine.cache, engine.runner.fused
    T, KV, d = step.positions.shape[0], CFG.num_kv_heads, fused.head_dim
    slots = step.batch.slot_mapping
    pool = cache.kv_ext.clone()
    keys = []
    cache.batch = step.batch
    try:
        for lean in (True, False):
            cache.kv_ext.copy_(pool)
            fused.lean_decode = lean
            assert fused_decode.applies(fused, fused.embed_tokens(step.tokens), cache)
            fused.layers_forward(fused.embed_tokens(step.tokens), step.positions, cache, 0, 1)
            keys.append(cache.k[0].index_select(0, slots).reshape(T, KV * d))
    finally:
        cache.batch, fused.lean_decode = None, True
    n = CFG.hidden_size
    x = torch.rms_norm(fused.embed_tokens(step.tokens), (n,), fused.layers[0].norm1,
                       fused.eps)
    wk = model.layers[0].self_attn.k_proj.weight
    mag = (x.abs() @ wk.abs().t()).view(T, KV, 2, d // 2)
    norm = sum_rtol(n + 1) / 2 + 6 * U32
    dot = (norm + 2 * sum_rtol(n)) * mag
    partner = mag.flip(2)
    k = keys[1].view(T, KV, 2, d // 2).abs()
    bound = dot + (norm + 2 * sum_rtol(n)) * partner + 2 * U32 * (k + k.flip(2))
    diff = (keys[0] - keys[1]).abs().view(T, KV, 2, d // 2)
    assert (diff <= bound).all(), (diff / bound).max()
    assert not torch.equal(keys[0], pool[0, 0].index_select(0, slots).reshape(T, KV * d))
