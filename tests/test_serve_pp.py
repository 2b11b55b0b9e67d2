"""Pipeline-parallel serving (serve/pp_worker.py) against one device: the same greedy tokens
for a mix of requests (a shared prefix, n = 2 with copy-on-write, seeded sampling, a cache
small enough to preempt), fused and module stages, 2 and 3 stages; the planner's `--serve
--pp` block count equal to the engine's; the stage and micro-batch splits; bad input."""

import pytest
import torch
from harness import run_ranks

from fivefold.errors import ConfigError
from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig, preset
from fivefold.plan.serve import num_blocks
from fivefold.serve.engine import Engine
from fivefold.serve.pp_worker import check_pp, micro_batches, stage_bounds
from fivefold.serve.sampling_params import SamplingParams
from tests.test_serve_tp import workload

CFG = ModelConfig(name="serve-pp", vocab_size=250, hidden_size=64, intermediate_size=128,
                  num_layers=5, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1)
BUDGET = 20 * 16 * 2 * 3 * 2 * 16 * 4  # 20 blocks of the largest stage (3 of 5 layers), fp32


def _pp_run(rank, world, prompts, params, fuse, tp=1, probe=None, **engine_kw):
    from fivefold.serve import pp_worker
    from fivefold.serve.tp_worker import shard_model

    pp = world // tp
    model = build_model(CFG, seed=5).eval()
    if not fuse:  # the module path: a model the fused forward does not take
        pp_worker.fusable = lambda m: "test"
    groups = pp_worker.pp_groups(pp, tp)
    if tp > 1:
        model = shard_model(model, groups)
    if rank != 0:
        steps = pp_worker.run_worker(model, pp, groups)
        return {"steps": steps, "params": sum(p.numel() for p in model.parameters())}
    engine = pp_worker.driver_engine(model, pp, groups, block_size=16,
                                     **(engine_kw or {"kv_cache_bytes": BUDGET}))
    logits = None
    if probe is not None:  # the logits of one prompt's first step, from the last stage
        engine.add_request(probe, SamplingParams(max_tokens=1, temperature=0), "probe")
        logits = engine.runner.execute(engine.scheduler.schedule())["probe"].clone()
        engine.abort_request("probe")
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    pp_worker.send_object(None, groups.control)
    return {"tokens": tokens, "blocks": engine.num_blocks, "steps": engine.num_steps,
            "params": sum(p.numel() for p in model.parameters()),
            "preemptions": engine.scheduler.num_preemptions,
            "layers": engine.cache.k.shape[0], "kv_heads": engine.cache.k.shape[2],
            "logits": logits, "kv_dtype": str(engine.cache.k.dtype)}


@pytest.mark.parametrize("world, fuse", [(2, True), (2, False), (3, True)])
def test_pp_equals_pp1(world, fuse, one_thread):
    prompts, params = workload(18, seed=2)
    model = build_model(CFG, seed=5).eval()
    largest = max(e - f for f, e in stage_bounds(CFG, world))
    blocks = BUDGET // (16 * 2 * largest * 2 * 16 * 4)
    expected = [o.token_ids for o in Engine(model, block_size=16, num_blocks=blocks)
                .generate(prompts, params)]
    out, *workers = run_ranks(_pp_run, world, prompts, params, fuse)
    assert out["tokens"] == expected
    assert out["blocks"] == blocks and out["layers"] == stage_bounds(CFG, world)[0][1]
    assert all(w["steps"] == out["steps"] for w in workers)  # every stage ran every step
    # each rank kept the weights of its stage alone: its layers, the embedding on the
    # first, the final norm and the (untied) head on the last
    held = [sum(p.numel() for i in range(first, end) for p in model.layers[i].parameters())
            for first, end in stage_bounds(CFG, world)]
    held[0] += model.embed_tokens.weight.numel()
    held[-1] += model.norm.weight.numel() + model.lm_head.weight.numel()
    assert [out["params"]] + [w["params"] for w in workers] == held
    if world == 2 and fuse:
        assert out["preemptions"] > 0  # the small pool preempted, and still the same


def test_pp2_tp2_equals_pp1(one_thread):
    """Two stages of two tensor-parallel ranks each: stage s on ranks 2s, 2s + 1, each
    holding half of its layers' linears and one of the two kv heads of their blocks."""
    prompts, params = workload(12, seed=3)
    probe = prompts[1]
    model = build_model(CFG, seed=5).eval()
    largest = max(e - f for f, e in stage_bounds(CFG, 2))
    blocks = BUDGET // (16 * 2 * largest * 1 * 16 * 4)  # one kv head a rank: 2x the blocks
    expected = [o.token_ids for o in Engine(model, block_size=16, num_blocks=blocks)
                .generate(prompts, params)]
    with torch.inference_mode():
        full = model(torch.tensor([probe]))[0, -1].float()
    out, *workers = run_ranks(_pp_run, 4, prompts, params, True, tp=2, probe=probe)
    assert out["tokens"] == expected
    assert out["blocks"] == blocks == num_blocks(BUDGET, CFG, 16, "fp32", tp=2, pp=2)
    assert out["layers"] == stage_bounds(CFG, 2)[0][1] and out["kv_heads"] == 1
    # every rank ran every step (and the probe's); each holds half of its stage's weights
    assert all(w["steps"] == out["steps"] + 1 for w in workers)
    whole = [r["params"] for r in (out, *workers)]
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)  # replicated
    assert whole[0] == whole[1] and whole[2] == whole[3]
    assert whole[0] + whole[2] == (total - norms) // 2 + norms
    # Not bit-equal: o_proj and down_proj sum two partial dot products of K/2 terms and
    # all-reduce them, another summation order (as tests/test_serve_tp.py): each reordered
    # fp32 sum of K <= 128 terms of order 1 is off by ~sqrt(K)·u ~ 7e-7, carried through 5
    # layers into logits of magnitude ~3; 2e-5 allows about 10x that.
    torch.testing.assert_close(out["logits"], full, rtol=0, atol=2e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_pp_fp8_kv_equals_pp1(tp, one_thread):
    """An FP8 KV cache whose scales are set on the fly by each layer's first write: the
    first step runs as one micro-batch, so the scales (and every token) are one device's."""
    prompts, params = workload(12, seed=3)
    model = build_model(CFG, seed=5).eval()
    expected = [o.token_ids for o in Engine(model, block_size=16, num_blocks=60,
                                            kv_cache_dtype="fp8").generate(prompts, params)]
    out, *_ = run_ranks(_pp_run, 2 * tp, prompts, params, True, tp=tp, num_blocks=60,
                        kv_cache_dtype="fp8")
    assert out["tokens"] == expected and out["kv_dtype"] == "torch.float8_e4m3fn"


def _pp_lora_run(rank, world, adapter_dirs, prompts, order):
    from fivefold.serve import pp_worker
    from fivefold.serve.lora_batch import MultiLoraLinear, load_adapter

    model = build_model(CFG, seed=5).eval()
    groups = pp_worker.pp_groups(world)
    staged = pp_worker.stage_adapters(model, world, groups,
                                      [load_adapter(n, d) for n, d in adapter_dirs])
    wrapped = {n for n, m in model.named_modules() if isinstance(m, MultiLoraLinear)}
    if rank != 0:
        return {"wrapped": wrapped, "steps": pp_worker.run_worker(model, world, groups, staged)}
    engine = pp_worker.driver_engine(model, world, groups, staged, block_size=16,
                                     num_blocks=128)
    tokens = _mixed(engine, prompts, order)
    pp_worker.send_object(None, groups.control)
    return {"tokens": tokens, "wrapped": wrapped, "steps": engine.num_steps}


def _mixed(engine, prompts, order):
    """Requests round robin over the adapters and the base (rows interleave in each step)."""
    ids = [engine.add_request(prompts[i], SamplingParams(max_tokens=12, temperature=0,
                                                         adapter=name)) for name, i in order]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return [done[rid] for rid in ids]


@pytest.mark.parametrize("world", [2, 3])
def test_pp_lora_equals_pp1(tmp_path, world, one_thread):
    """--lora with --pp: each stage holds its own layers' factors (the head's on the last);
    requests for three adapters and the base, mixed in every step and cut into micro-batches
    across them, give the tokens of one engine serving the same adapters."""
    from test_serve_lora import ADAPTERS, make_adapter

    from fivefold.serve.lora_batch import apply_adapters, attach, load_adapter

    base = build_model(CFG, seed=5).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 40, (5,), generator=g)]
    dirs = [(name, str(tmp_path / name)) for name, *_ in ADAPTERS]
    for seed, (name, *spec) in enumerate(ADAPTERS):
        make_adapter(base, tmp_path / name, seed, *spec)
    order = [(name, i) for i in range(len(prompts)) for name in (None, "alpha", "beta",
                                                                    "gamma")]
    one = build_model(CFG, seed=5).eval()
    adapter_set = apply_adapters(one, [load_adapter(n, d) for n, d in dirs])
    engine = Engine(one, block_size=16, num_blocks=128)
    attach(engine, adapter_set)
    expected = _mixed(engine, prompts, order)
    assert len({str(expected[k::4]) for k in range(4)}) == 4  # each adapter changes tokens
    out, *workers = run_ranks(_pp_lora_run, world, dirs, prompts, order)
    assert out["tokens"] == expected
    assert all(w["steps"] == out["steps"] for w in workers)
    # each stage wrapped the linears of its own layers alone: the stages' sets partition the
    # whole model's (beta targets all linears: every layer has some)
    bounds = stage_bounds(CFG, world)
    for (first, end), stage in zip(bounds, [out, *workers], strict=True):
        layers = {int(n.split(".")[1]) for n in stage["wrapped"]}
        assert layers == set(range(first, end))
    assert set().union(*(w["wrapped"] for w in [out, *workers])) == {
        n for n, m in one.named_modules() if type(m).__name__ == "MultiLoraLinear"}


def test_stage_and_micro_batch_splits():
    # a layer of CFG reads 36,992 weights a token, its head 16,000: 3 + 2 layers is the
    # least largest stage (110,976 against 89,984 with the head)
    assert stage_bounds(CFG, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(CFG, 3) == [(0, 2), (2, 4), (4, 5)]
    assert stage_bounds(CFG, 5) == [(i, i + 1) for i in range(5)]
    # llama-25m's head (32000 x 512) outweighs five of its layers: the last stage gets one
    assert stage_bounds(preset("llama-25m"), 2) == [(0, 7), (7, 8)]
    for cfg, pp in ((preset("llama-3.1-8b"), 4), (CFG, 2), (preset("llama-25m"), 3)):
        bounds = stage_bounds(cfg, pp)
        assert bounds[0][0] == 0 and bounds[-1][1] == cfg.num_layers
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
    assert micro_batches([1] * 8, 2) == [4, 4]
    assert micro_batches([100, 1, 1, 1], 2) == [1, 3]
    assert micro_batches([1, 1, 1, 100], 2) == [3, 1]
    assert micro_batches([5], 3) == [1]
    assert micro_batches([], 2) == []
    for tokens in ([3, 1, 4, 1, 5, 9, 2, 6], [1, 1], [7, 7, 7]):
        for pp in (2, 3, 4):
            sizes = micro_batches(tokens, pp)
            assert sum(sizes) == len(tokens) and min(sizes) >= 1
            assert len(sizes) == min(pp, len(tokens))


def test_plan_serve_pp_counts_the_largest_stage(capsys, tmp_path):
    import json

    from fivefold.models.hf import save_hf
    from fivefold.plan.cli_entry import main as plan_main

    model = build_model(CFG, seed=1).eval()
    budget = 3 * 2**20 + 999
    largest = max(e - f for f, e in stage_bounds(CFG, 2))
    engine = Engine(model, kv_cache_bytes=budget, num_layers=largest)
    assert engine.num_blocks == num_blocks(budget, CFG, 16, "fp32", pp=2)
    assert num_blocks(budget, CFG, 16, "fp32", pp=2) > num_blocks(budget, CFG, 16, "fp32")
    # stages of two tensor-parallel ranks: the largest stage's layers, one kv head a rank;
    # `plan --serve --pp 2 --tp 2` on the same model and budget counts the engine's blocks
    staged = Engine(model, kv_cache_bytes=budget, num_layers=largest, num_kv_heads=1)
    save_hf(model, CFG, tmp_path / "m")
    assert plan_main(["--serve", "--model", str(tmp_path / "m"), "--pp", "2", "--tp", "2",
                      "--kv-cache-dtype", "fp32", "--kv-cache-gib", repr(budget / 2**30),
                      "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_blocks"] == staged.num_blocks == num_blocks(budget, CFG, 16, "fp32",
                                                                 tp=2, pp=2)
    assert plan["kv_bytes_per_token"] == 2 * largest * 1 * 16 * 4
    assert plan_main(["--serve", "--model", "llama-3.1-8b", "--pp", "4", "--json"]) == 0

    plan = json.loads(capsys.readouterr().out)
    # llama-3.1-8b in 4 stages: 8, 9, 9 and 6 layers (the head on the last); the pools are
    # sized for 9 of the 32 layers' 128 KiB a token
    assert plan["pp"] == 4 and plan["kv_bytes_per_token"] == 131072 * 9 // 32


def test_bad_pp_is_one_line():
    with pytest.raises(ConfigError, match="more stages than the model's 5 layers"):
        check_pp(6, num_layers=5)
    with pytest.raises(ConfigError, match="--pp with --dp"):
        check_pp(2, dp=2)
    check_pp(2, tp=2, num_layers=5)  # stages of tensor-parallel ranks compose
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_pp(0)


def test_a_pp_step_that_fails_after_reaching_the_workers_ends_the_server(monkeypatch):
    """As under --tp (tests/test_serve_fuzz.py): a step failing on rank 0 before its message
    goes out fails its requests alone; one failing after it (the workers may wait for hidden
    states rank 0 never sends) is RanksOutOfStep, and no further message is sent, not even
    the stop."""
    from fivefold.serve import pp_worker, tp_worker
    from fivefold.serve.request import Request
    from fivefold.serve.scheduler import SchedulerOutput

    sent = []
    monkeypatch.setattr(pp_worker, "send_object", lambda obj, group: sent.append(obj))
    monkeypatch.setattr(tp_worker, "send_object", lambda obj, group: sent.append(obj))

    class Kv:
        tables = {}

        def block_ids(self, rid):
            return self.tables[rid]

    class Stage:  # a first stage whose forward fails (a worker gone, say)
        adapters, stages = None, 2
        cache = type("Cache", (), {"fp8": False})()

        def run_stage(self, out, sizes):
            raise RuntimeError("connection closed by peer")

    a = Request("a", [1, 2], SamplingParams())
    driver = pp_worker.PPDriverRunner.__new__(pp_worker.PPDriverRunner)
    driver.kv, driver._sent, driver.control, driver.broken = Kv(), {}, None, None
    driver.stage_runner = Stage()
    driver.scheduler = type("S", (), {"requests": {"a": a}})()
    with pytest.raises(KeyError):  # encoding fails before anything is sent
        driver.execute(SchedulerOutput([(a, 2)]))
    assert sent == [] and driver.broken is None and driver._sent == {}
    Kv.tables = {"a": [3]}
    with pytest.raises(tp_worker.RanksOutOfStep, match="out of step.*connection closed"):
        driver.execute(SchedulerOutput([(a, 2)]))
    assert len(sent) == 1
    with pytest.raises(tp_worker.RanksOutOfStep):
        driver.execute(SchedulerOutput([(a, 1)]))
    driver.close()
    assert len(sent) == 1
