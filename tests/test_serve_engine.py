"""The serving engine against the dense path it must reproduce.

Oracles: `train.generate.generate` (the dense KVCache, batch 1: what `fivefold generate
--greedy` runs) and transformers' `generate` on the same weights. Greedy tokens must agree
exactly; K/V read back through the block table must equal the dense cache's within 1e-6
(fp32; the two paths run the same linear layers on the same tokens). Models use
init_std 0.1 so that greedy choices are not near-ties.
"""

import pytest
import torch
from common import greedy_workload

from fivefold.models.init import build_model
from fivefold.models.llama import KVCache
from fivefold.models.presets import ModelConfig
from fivefold.serve.engine import Engine
from fivefold.serve.kv_cache import PagedKVCache
from fivefold.serve.kv_cache_manager import cdiv
from fivefold.serve.sampling_params import SamplingParams
from fivefold.train.generate import generate

CFG = ModelConfig(name="serve", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=512, init_std=0.1)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3).eval()


def workload(n: int, seed: int, prompt=(1, 200), output=(1, 40)):
    return greedy_workload(n, seed, CFG.vocab_size, prompt, output)


@pytest.fixture(scope="module")
def mixed(model):
    """32 greedy requests of 1-200 prompt tokens and 1-40 new tokens, and their dense runs."""
    prompts, params = workload(32, seed=0)
    dense = [generate(model, p, sp.max_tokens, greedy=True) for p, sp in zip(prompts, params)]
    return prompts, params, dense


def test_32_mixed_requests_at_once_equal_each_alone_and_the_dense_path(model, mixed):
    prompts, params, dense = mixed
    assert min(map(len, prompts)) <= 20 and max(map(len, prompts)) >= 180
    engine = Engine(model, num_blocks=512)
    together = engine.generate(prompts, params)
    assert [o.token_ids for o in together] == dense
    assert all(o.finish_reason == "length" for o in together)
    assert engine.stats()["steps"] < sum(sp.max_tokens for sp in params) / 4  # batched
    alone = [Engine(model, num_blocks=64).generate([p], sp)[0].token_ids
             for p, sp in list(zip(prompts, params))[:8]]
    assert alone == dense[:8]


def test_decode_in_one_call_as_on_cuda_gives_the_dense_tokens(model, mixed):
    """CUDA attends every decoding sequence in one padded call (kv_cache.py); the same
    path on CPU, where groups are otherwise cut to an L2's worth of K/V."""
    prompts, params, dense = mixed
    engine = Engine(model, num_blocks=512)
    engine.cache.decode_group_bytes = None
    assert [o.token_ids for o in engine.generate(prompts, params)] == dense


def test_decode_groups_keep_each_calls_kv_within_the_budget():
    cache = PagedKVCache(2, 2, 16, 8, 16, torch.float32, "cpu")  # K+V: 256 bytes a token
    cache.decode_group_bytes = 256 * 100  # sequences x longest context <= 100 tokens
    assert cache.decode_groups([30, 20, 50, 10, 120, 40, 60]) == [2, 2, 1, 1, 1]
    assert cache.decode_groups([]) == []
    cache.decode_group_bytes = None
    assert cache.decode_groups([30, 20, 50, 10, 120, 40, 60]) == [7]


def test_generate_command_gives_the_engines_tokens(model, tmp_path, capsys):
    from fivefold.models.hf import save_hf
    from fivefold.train.generate import main

    save_hf(model, CFG, tmp_path / "hf")
    text = "The quick brown fox"
    engine = Engine(model, num_blocks=64)
    (out,) = engine.generate([list(text.encode())], SamplingParams(max_tokens=24,
                                                                    temperature=0))
    assert main(["--hf", str(tmp_path / "hf"), "--tokenizer", "byte", "--prompt", text, "--greedy",
                 "--max-new-tokens", "24", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == bytes(list(text.encode()) + [t for t in out.token_ids
                                                                  if t < 256]).decode(
        "utf-8", errors="replace")


def test_paged_kv_equals_dense_kv(model):
    prompt = list(range(3, 40))  # 37 tokens: blocks of 16 -> 3 blocks, the last partial
    engine = Engine(model, num_blocks=32, block_size=16)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
    for _ in range(6):  # prefill, then five decode steps
        engine.step()
    request = engine.scheduler.requests[rid]
    held = request.num_computed_tokens
    assert held == len(prompt) + 5
    tokens = request.all_token_ids[:held]
    dense = KVCache(CFG, 1, held, "cpu", torch.float32)
    with torch.inference_mode():
        model(torch.tensor([tokens[:len(prompt)]]), cache=dense, start=0)
        for pos in range(len(prompt), held):  # decode one token at a time, as the engine did
            model(torch.tensor([[tokens[pos]]]), cache=dense, start=pos)
    table = engine.kv.block_ids(rid)
    assert len(table) == cdiv(held, 16)
    slots = torch.tensor(engine.cache.block_slots(table, held))
    # The engine's fused forward sums its GEMMs in another order than the modules: each layer's
    # dot products of length `hidden` may differ by n·u relative (u = 2^-24, fp32; Higham's
    # gamma_n), and a layer's K/V carry every earlier layer's difference. So the bound grows with
    # the layers: 2·(layer + 1)·hidden·u of the largest value (2: the norm and the GEMM).
    u = 2.0 ** -24
    for layer in range(CFG.num_layers):
        k, v = engine.cache.gather(layer, slots)
        bound = 2 * (layer + 1) * CFG.hidden_size * u
        for got, want in ((k, dense.k[layer, 0]), (v, dense.v[layer, 0])):
            torch.testing.assert_close(got, want, rtol=0, atol=bound * want.abs().max().item())


def test_prefix_shared_equals_unshared_and_cuts_blocks(model):
    prefix = list(range(100, 164))  # 64 tokens: four full blocks of 16
    prompts = [prefix + [i, i + 1, i + 2] + [7] * i for i in range(8)]
    params = SamplingParams(max_tokens=6, temperature=0)
    peaks = {}
    results = {}
    for caching in (False, True):
        engine = Engine(model, num_blocks=128, enable_prefix_caching=caching)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # every prompt prefilled in one step
        peaks[caching] = engine.kv.pool.num_used
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        results[caching] = [outs[f"req-{i}"] for i in range(len(prompts))]
    assert results[True] == results[False]
    # unshared: every request holds its own copy of the four prefix blocks; shared: one copy
    assert peaks[False] == sum(cdiv(len(p), 16) for p in prompts)
    assert peaks[True] == peaks[False] - 4 * (len(prompts) - 1)
    print(f"prefix sharing: {peaks[False]} -> {peaks[True]} blocks for {len(prompts)} requests")


def test_preemption_under_a_tiny_budget_gives_the_same_tokens(model, mixed):
    prompts, params, dense = mixed
    prompts, params, dense = prompts[:12], params[:12], dense[:12]
    tokens = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    # room for the longest sequence and 32 tokens more
    engine = Engine(model, num_blocks=cdiv(tokens, 16) + 2, max_model_len=tokens)
    assert [o.token_ids for o in engine.generate(prompts, params)] == dense
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used == 0  # nothing leaked


def test_chunked_prefill_gives_the_same_tokens(model, mixed):
    prompts, params, dense = mixed
    engine = Engine(model, num_blocks=512, chunked_prefill=True, max_num_batched_tokens=48)
    assert [o.token_ids for o in engine.generate(prompts[:10], params[:10])] == dense[:10]


def test_waste_is_only_last_block_slack(model):
    """vLLM's claim: under 4% of KV memory wasted. Tokens held vs block slots in use, summed
    over every step of a mixed workload (prompts 16-256, outputs 16-256 as in the bench)."""
    prompts, params = workload(24, seed=1, prompt=(16, 256), output=(16, 256))
    engine = Engine(model, num_blocks=1024, enable_prefix_caching=False, block_size=16)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    held = slots = 0
    while engine.has_unfinished():
        engine.step()
        tokens = [r.num_computed_tokens for r in engine.scheduler.running]
        used = engine.kv.pool.num_used
        assert used == sum(cdiv(t, 16) for t in tokens)  # no block beyond the last partial
        held, slots = held + sum(tokens), slots + used * 16
    waste = 1 - held / slots
    print(f"KV waste over the run: {waste:.2%} of block slots")
    assert waste <= 0.04


def test_seeded_sampling_is_reproducible_and_matches_generate(model):
    prompt = [5, 9, 13, 200, 31]
    params = SamplingParams(max_tokens=20, temperature=1.3, top_k=50, top_p=0.9, seed=11)
    first = Engine(model, num_blocks=32).generate([prompt], params)[0].token_ids
    batch = Engine(model, num_blocks=64).generate([prompt, [1, 2, 3], prompt], params)
    assert batch[0].token_ids == first == batch[2].token_ids
    assert first == generate(model, prompt, 20, temperature=1.3, top_k=50, top_p=0.9, seed=11)
    assert first != Engine(model, num_blocks=32).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=1.3, seed=12))[0].token_ids


def test_stop_strings_and_eos(model):
    prompt = list(b"abc")
    (free,) = Engine(model, num_blocks=32).generate([prompt], SamplingParams(max_tokens=12,
                                                                               temperature=0))
    eos = free.token_ids[3]
    (out,) = Engine(model, num_blocks=32, eos_token_ids=[eos]).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0))
    assert out.token_ids == free.token_ids[:4] and out.finish_reason == "stop"

    def text(ids):
        return "".join(chr(65 + t % 26) for t in ids)

    full = text(free.token_ids)
    stop = full[5:7]
    assert full.find(stop) > 0  # the text before the stop string is not empty
    engine = Engine(model, num_blocks=32, detokenize=text)
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    assert len(cut.token_ids) < 12  # it stopped early
    assert engine.kv.pool.num_used == 0


def test_moe_model_batched_equals_dense():
    cfg = ModelConfig(name="serve-moe", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=1, max_seq_len=128,
                      init_std=0.1, num_experts=4, experts_top_k=2, moe_intermediate_size=64)
    moe = build_model(cfg, seed=5).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (1, 9, 30, 17, 60)]
    params = SamplingParams(max_tokens=10, temperature=0)
    dense = [generate(moe, p, 10, greedy=True) for p in prompts]
    assert [o.token_ids for o in Engine(moe, num_blocks=64).generate(prompts, params)] == dense


def test_hf_parity_with_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fivefold.models.hf import load_hf

    hf_cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path, dtype=torch.float32, device="cpu").eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 7, 33, 80)]
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
            expected.append(out[0, len(p):].tolist())
    got = Engine(ours, num_blocks=64).generate(prompts, SamplingParams(max_tokens=16,
                                                                       temperature=0))
    assert [o.token_ids for o in got] == expected


def test_n_choices_share_the_prompt_and_copy_its_last_block_on_write(model):
    prompt = list(range(10, 50))  # 40 tokens: two full blocks and a partial one of 8
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=4)
    engine = Engine(model, num_blocks=64, enable_prefix_caching=False)
    rid = engine.add_request(prompt, params)
    engine.step()  # the prompt, once; the four choices fork from it
    assert engine.choice_ids(rid) == [rid] + [f"{rid}#{i}" for i in (1, 2, 3)]
    assert engine.kv.pool.num_used == 3  # one copy of the prompt's blocks for all four
    engine.step()  # each choice writes into the shared partial block: three copies
    assert engine.kv.pool.num_used == 3 + 3
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    choices = [outs[c] for c in [rid, f"{rid}#1", f"{rid}#2", f"{rid}#3"]]
    assert [o.index for o in choices] == [0, 1, 2, 3]
    # choice i is the request with seed 5 + i on its own
    for i, o in enumerate(choices):
        alone = Engine(model, num_blocks=64).generate(
            [prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i))[0]
        assert o.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in choices}) > 1
    assert engine.kv.pool.num_used == 0 and not engine._choices
    greedy = Engine(model, num_blocks=64).generate(
        [prompt, [1, 2]], SamplingParams(max_tokens=5, temperature=0, n=3))
    assert len(greedy) == 6 and len({tuple(o.token_ids) for o in greedy[:3]}) == 1


@pytest.mark.parametrize("kind", ["int8", "int4", "lora"])
def test_quantised_and_lora_models_serve_like_their_dense_path(kind):
    """The engine takes the models those loaders return (linears swapped, forward kept)."""
    model = build_model(CFG, seed=3).eval()
    if kind == "lora":
        from fivefold.finetune.inject import apply_lora

        apply_lora(model, 4, 8.0, "q_proj,v_proj")
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make the adapters matter
                torch.nn.init.normal_(p, std=0.1)
    else:
        from fivefold.quant.convert import QuantSpec, quantize_

        quantize_(model, QuantSpec(kind, group_size=32))
    prompts, params = workload(6, seed=2, output=(1, 16))
    dense = [generate(model, p, sp.max_tokens, greedy=True) for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in Engine(model, num_blocks=128).generate(prompts, params)] == dense


def _poison_unheld_slots(engine, out):
    """NaN in every K/V slot no live sequence has written yet: free blocks, the tail of each
    last block, whatever a padded table or a chunk's context reads past a sequence's length.
    For an FP8 cache the byte 0x7f, e4m3fn's NaN."""
    held = torch.zeros(engine.cache.k.shape[1], dtype=torch.bool)
    for rid in engine.kv.req_blocks:
        written = engine.scheduler.requests[rid].num_computed_tokens  # before this step
        held[engine.cache.block_slots(engine.kv.block_ids(rid), written)] = True
    for pool in (engine.cache.k, engine.cache.v):
        if engine.cache.fp8:
            pool.view(torch.uint8)[:, ~held] = 0x7F
        else:
            pool[:, ~held] = float("nan")


@pytest.mark.parametrize("kv_cache_dtype, one_call, chunked", [
    ("auto", False, False), ("auto", True, True), ("fp8", True, False)])
def test_nan_in_unwritten_slots_changes_no_logit(model, kv_cache_dtype, one_call, chunked):
    """Decode groups pad every table to the longest and mask past each length; a chunk's
    context reads the rest of its last block. Masked slots must not reach the output,
    whatever they hold (0 · NaN is NaN): poisoned before every step, the logits are the
    unpoisoned run's bit for bit."""
    prompts, params = workload(10, seed=5, prompt=(1, 70), output=(1, 24))
    runs = []
    for poison in (False, True):
        engine = Engine(model, num_blocks=64, enable_prefix_caching=False,
                        kv_cache_dtype=kv_cache_dtype, chunked_prefill=chunked,
                        max_num_batched_tokens=40 if chunked else None)
        if one_call:
            engine.cache.decode_group_bytes = None
        execute, logits = engine.runner.execute, []

        def run(out, execute=execute, engine=engine, poison=poison, logits=logits):
            if poison:
                _poison_unheld_slots(engine, out)
            step = execute(out)
            logits.append(step.rows.clone())
            return step

        engine.runner.execute = run
        tokens = [o.token_ids for o in engine.generate(prompts, params)]
        runs.append((tokens, logits))
    (tokens, logits), (poisoned_tokens, poisoned_logits) = runs
    assert poisoned_tokens == tokens
    assert len(poisoned_logits) == len(logits) > 10
    assert all(torch.equal(a, b) for a, b in zip(poisoned_logits, logits))
