"""Tensor-parallel serving (serve/tp_worker.py) against one device: the same greedy tokens
for a mix of requests (long and short prompts, a shared prefix, n = 2 with copy-on-write,
seeded sampling, a cache small enough to preempt), logits within the reduction-order
tolerance, the planner's `--serve --tp` block count equal to the engine's, and the steps
reaching the worker as diffs."""

import pytest
import torch
from harness import run_ranks

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.plan.serve import num_blocks
from fivefold.serve.engine import Engine
from fivefold.serve.sampling_params import SamplingParams

CFG = ModelConfig(name="serve-tp", vocab_size=250, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1)
# one kv head for two ranks: each rank holds the same head (replicated, as vLLM does)
CFG_MQA = ModelConfig(name="serve-tp-mqa", vocab_size=250, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=1,
                      max_seq_len=256, init_std=0.1)
BUDGET = 40 * 16 * 2 * 2 * 1 * 16 * 4  # 40 blocks of one rank's kv head share (fp32)


def workload(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 250, (40,), generator=g).tolist()
    prompts, params = [], []
    for i in range(n):
        length = int(torch.randint(1, 60, (1,), generator=g))
        body = torch.randint(0, 250, (length,), generator=g).tolist()
        prompts.append(prefix + body if i % 3 == 0 else body)
        max_tokens = int(torch.randint(1, 24, (1,), generator=g))
        if i % 5 == 4:  # seeded sampling and two choices of one prompt
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, n=2))
        else:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return prompts, params


def serve(model, prompts, params, **kw):
    engine = Engine(model, block_size=16, **kw)
    return engine, [o.token_ids for o in engine.generate(prompts, params)]


def _tp_run(rank, world, cfg, prompts, params, probe):
    from fivefold.serve.tp_worker import driver_engine, run_worker, shard_model, tp_groups

    groups = tp_groups(world)
    model = shard_model(build_model(cfg, seed=5).eval(), groups)
    if rank != 0:
        return run_worker(model, groups)
    engine = driver_engine(model, groups, block_size=16, kv_cache_bytes=BUDGET)
    with torch.inference_mode():  # the logits of one prompt's first step, gathered
        engine.add_request(probe, SamplingParams(max_tokens=1, temperature=0), "probe")
        logits = engine.runner.execute(engine.scheduler.schedule())["probe"].clone()
        engine.abort_request("probe")
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    runner = engine.runner
    runner.close()
    return {"tokens": tokens, "logits": logits, "blocks": engine.num_blocks,
            "preemptions": engine.scheduler.num_preemptions,
            "steps": engine.num_steps + 1}  # the probe's step too


@pytest.mark.parametrize("cfg, n", [(CFG, 24), (CFG_MQA, 6)])
def test_tp2_equals_tp1(cfg, n, one_thread):
    prompts, params = workload(n, seed=1)
    probe = prompts[1]
    model = build_model(cfg, seed=5).eval()
    # tp1 with the same per-rank budget in blocks: tp2's ranks hold half the kv heads each
    # (all of them when replicated), so the same bytes give 2x (1x) the blocks
    share = 2 if cfg.num_kv_heads >= 2 else 1
    engine, expected = serve(model, prompts, params, kv_cache_bytes=BUDGET * share)
    with torch.inference_mode():
        full = model(torch.tensor([probe]))[0, -1].float()
    out, worker_steps = run_ranks(_tp_run, 2, cfg, prompts, params, probe)
    assert out["tokens"] == expected
    assert worker_steps == out["steps"]  # rank 1 ran every step rank 0 ran
    assert out["blocks"] == engine.num_blocks
    if cfg is CFG:
        assert out["preemptions"] > 0  # the small cache made requests give back blocks
    # Not bit-equal: o_proj and down_proj sum two partial dot products of K/2 terms and
    # all-reduce them, another summation order than one dot product of K. fp32 rounding of
    # a reordered sum of K terms ~ sqrt(K)·u·sum|x·w| (u = 6e-8, K <= 128: ~7e-7 on a sum
    # of order 1), carried through 2 layers into logits of magnitude ~3: measured 1e-6;
    # 1e-5 allows 10x.
    torch.testing.assert_close(out["logits"], full, rtol=0, atol=1e-5)
    # the planner: tp ranks hold max(1, kv / tp) heads each; the same budget, the same blocks
    assert out["blocks"] == num_blocks(BUDGET, cfg, 16, "fp32", tp=2)


def test_plan_serve_takes_tp(capsys):
    import json

    from fivefold.plan.cli_entry import main as plan_main

    assert plan_main(["--serve", "--model", "llama-3.1-70b", "--tp", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # 80 layers, 8 kv heads of 128 over 4 ranks: 2 heads each, bf16
    assert data["kv_bytes_per_token"] == 2 * 80 * 2 * 128 * 2 and data["tp"] == 4


def test_steps_reach_workers_as_diffs():
    from fivefold.serve.request import Request
    from fivefold.serve.scheduler import SchedulerOutput
    from fivefold.serve.tp_worker import TPDriverRunner, TPWorker

    class Kv:
        tables = {"a": [3, 4]}

        def block_ids(self, rid):
            return self.tables[rid]

    class Sched:
        requests = {}

    driver = TPDriverRunner.__new__(TPDriverRunner)
    driver.kv, driver.scheduler, driver._sent = Kv(), Sched(), {}
    worker = TPWorker.__new__(TPWorker)
    from fivefold.serve.tp_worker import MirrorTables

    worker.tables, worker.requests = MirrorTables(), {}
    a = Request("a", [1, 2, 3], SamplingParams())
    Sched.requests = {"a": a}
    first = driver.encode(SchedulerOutput([(a, 3)]))
    assert first.requests[0].new_token_ids == [1, 2, 3] and first.requests[0].replace
    worker.apply(first)
    a.num_computed_tokens = 3
    a.output_token_ids.append(9)
    Kv.tables["a"] = [3, 4, 7]
    second = driver.encode(SchedulerOutput([(a, 1)], copies=[(4, 8)]))
    item = second.requests[0]
    assert (item.new_token_ids, item.block_ids, item.replace) == ([9], [7], False)
    Kv.tables["a"] = [3, 8, 7]  # a block swapped (copy-on-write): the whole table again
    third = driver.encode(SchedulerOutput([(a, 1)]))
    assert third.requests[0].replace and third.requests[0].block_ids == [3, 8, 7]
    for msg in (second, third):
        out = worker.apply(msg)
    assert worker.tables.block_ids("a") == [3, 8, 7]
    assert out.scheduled[0][0].all_token_ids == [1, 2, 3, 9]
    Sched.requests = {}
    assert driver.encode(SchedulerOutput()).forget == ["a"]
