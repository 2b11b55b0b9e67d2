"""Async scheduling (serve/async_step.py), forced on on the CPU, against the synchronous
engine it must reproduce.

Oracle: the same Engine with async_scheduling="off" on the same requests, added at the same
steps. Greedy tokens and finish reasons must agree exactly (both take `argmax` of the same
fp32 logits; the models use init_std 0.1 so that greedy choices are not near-ties). Every
case also checks that the overlap really ran (steps launched ahead) and that the block
pool is all free once every request has ended. Nothing here is timed: on a CPU the device
is the host and there is nothing to overlap.
"""

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from common import greedy_workload

from fivefold.errors import ConfigError
from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.serve.engine import Engine
from fivefold.serve.sampling_params import SamplingParams

CFG = ModelConfig(name="serve", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3).eval()


def workload(n: int, seed: int, prompt=(1, 60), output=(1, 30)):
    return greedy_workload(n, seed, CFG.vocab_size, prompt, output)


def run(engine: Engine, schedule: dict[int, list], aborts: dict[int, str] | None = None):
    """Step the engine to the end; `schedule[k]`: (request id, prompt, params) added before
    step call k, `aborts[k]`: a request id aborted before step call k. Returns request id ->
    (tokens, finish reason), and the tokens each request received step by step."""
    final, streamed, k = {}, {}, 0
    aborts = aborts or {}
    while k <= max(schedule) or engine.has_unfinished():
        for rid, prompt, params in schedule.get(k, []):
            engine.add_request(prompt, params, rid)
        if k in aborts:
            for o in engine.abort_request(aborts[k]):
                final[o.request_id] = (o.token_ids, o.finish_reason)
        for o in engine.step():
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = (o.token_ids, o.finish_reason)
        k += 1
        assert k < 2000
    return final, streamed


def both(model, schedule, aborts=None, **kw):
    """The synchronous and the async engine on the same schedule; the async one's checks."""
    sync = Engine(model, async_scheduling="off", **kw)
    ahead = Engine(model, async_scheduling="on", **kw)
    assert sync.overlap is None and ahead.overlap is not None
    expected, _ = run(sync, schedule, aborts)
    got, streamed = run(ahead, schedule, aborts)
    assert got == expected
    for rid, (tokens, _) in got.items():  # what went out step by step is the whole output
        assert streamed.get(rid, []) == tokens
    for engine in (sync, ahead):  # every block back: nothing leaked, nothing freed twice
        assert engine.kv.pool.num_free == engine.num_blocks and not engine.kv.req_blocks
        assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    return expected, ahead


def at_once(prompts, params):
    return {0: [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]}


@pytest.mark.parametrize("graphs", [False, "static"])
def test_mixed_lengths_equal_the_synchronous_engine(model, graphs):
    """16 requests of 1-60 prompt tokens and 1-30 new ones; also on the static (CUDA-graph)
    decode path, run without capture."""
    prompts, params = workload(16, seed=0)
    params[0] = SamplingParams(max_tokens=1, temperature=0.0)
    expected, ahead = both(model, at_once(prompts, params), num_blocks=128,
                           cuda_graphs=graphs, max_num_seqs=16)
    assert [len(expected[f"r{i}"][0]) for i in range(16)] == [p.max_tokens for p in params]
    assert ahead.overlap.num_ahead >= max(p.max_tokens for p in params) - 2


def test_eos_mid_batch_ends_those_requests_and_drops_their_extra_token(model):
    prompts, params = workload(12, seed=1, output=(20, 30))
    plain = Engine(model, num_blocks=128, async_scheduling="off").generate(prompts, params)
    # an id some requests produce mid-way: as EOS it ends them at different steps
    counts = torch.bincount(torch.tensor([t for o in plain for t in o.token_ids[1:15]]))
    eos = int(counts.argmax())
    expected, ahead = both(model, at_once(prompts, params), num_blocks=128,
                           eos_token_ids=[eos])
    stopped = [rid for rid, (_, why) in expected.items() if why == "stop"]
    lengths = {len(expected[rid][0]) for rid in stopped}
    assert len(stopped) >= 2 and len(lengths) >= 2 and len(stopped) < len(prompts)
    assert all(expected[rid][0][-1] == eos for rid in stopped)
    assert ahead.overlap.num_ahead >= 15


def test_requests_joining_and_finishing_at_different_steps(model):
    prompts, params = workload(10, seed=2, output=(1, 25))
    schedule = {}
    for i, k in enumerate([0, 0, 0, 3, 3, 7, 12, 12, 20, 31]):  # added before step call k
        schedule.setdefault(k, []).append((f"r{i}", prompts[i], params[i]))
    expected, ahead = both(model, schedule, num_blocks=128)
    assert sorted(expected) == sorted(f"r{i}" for i in range(10))
    assert ahead.overlap.num_ahead >= 10 and ahead.overlap.num_drained >= 5


def test_an_abort_mid_flight(model):
    """Aborted while its next step runs on the device: the output is what was read, and
    the row in flight is dropped."""
    prompts, params = workload(6, seed=3, output=(25, 30))
    engine = Engine(model, num_blocks=128, async_scheduling="on")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, f"r{i}")
    for _ in range(5):
        engine.step()
    pending = engine.overlap.pending
    assert pending is not None and "r2" in pending.index  # its step 6 is in flight
    (out,) = engine.abort_request("r2")
    assert out.finish_reason == "abort" and len(out.token_ids) == 5
    expected, _ = both(model, at_once(prompts, params), aborts={5: "r2"}, num_blocks=128)
    assert expected["r2"] == (out.token_ids, "abort")


def test_preemption_under_a_tiny_pool(model):
    """8 requests that cannot all hold their blocks: the scheduler preempts (the async
    engine drains first) and recomputes; tokens as the synchronous engine's."""
    prompts, params = workload(8, seed=4, prompt=(20, 40), output=(20, 30))
    expected, ahead = both(model, at_once(prompts, params), num_blocks=14, block_size=8,
                           max_model_len=80)
    assert ahead.scheduler.num_preemptions > 0 and ahead.overlap.num_ahead >= 10
    assert all(why == "length" for _, why in expected.values())


def test_other_sampling_drains_and_equals_the_synchronous_engine(model):
    """Seeded sampling, logit_bias, n = 2 and stop strings beside greedy requests."""
    prompts, params = workload(6, seed=5, output=(10, 20))
    params[1] = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    params[2] = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={5: 3.0})
    params[3] = SamplingParams(max_tokens=12, temperature=0.0, n=2)
    schedule = at_once(prompts, params)
    both(model, schedule, num_blocks=128)
    # greedy alone, with stop strings: a stop ends the request once its text is made
    plain = Engine(model, num_blocks=128, async_scheduling="off").generate(
        prompts, [SamplingParams(max_tokens=20, temperature=0.0)] * 6)
    text = lambda ids: "".join(chr(65 + t % 26) for t in ids)  # noqa: E731
    stops = [SamplingParams(max_tokens=20, temperature=0.0, stop=(text(o.token_ids[4:6]),))
             for o in plain]
    expected, ahead = both(model, at_once(prompts, stops), num_blocks=128, detokenize=text)
    assert sum(why == "stop" for _, why in expected.values()) >= 3
    assert ahead.overlap.num_ahead >= 3


def test_one_copy_to_the_host_per_overlapped_step_after_the_next_launch(model, monkeypatch):
    """In a step that runs ahead: step N+1's forward is launched, then step N's ids are read
    with one `tolist` and nothing else reads the device (no .cpu(), .item(), .numpy(),
    no aten::_local_scalar_dense behind int()/bool(), no nonzero)."""
    prompts, params = workload(8, seed=6, output=(30, 30))
    engine = Engine(model, num_blocks=128, async_scheduling="on")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, f"r{i}")
    for _ in range(3):
        engine.step()
    events = []
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute",
                        lambda out: events.append("launch") or execute(out))
    for name in ("tolist", "cpu", "item", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _n=name, _r=real, **k: events.append(_n)
                            or _r(self, *a, **k))
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        before, pending = engine.overlap.num_ahead, engine.overlap.pending
        events.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            outputs = engine.step()
        assert engine.overlap.num_ahead == before + 1  # this step ran ahead
        assert events == ["launch", "tolist"]
        ops = {e.key: e.count for e in prof.key_averages()}
        assert not any(k in ops for k in ("aten::_local_scalar_dense", "aten::nonzero",
                                           "aten::item", "aten::masked_select"))
        # what came out is step N's: the step that was pending when this one began
        assert {o.request_id for o in outputs} == {r.request_id for r in pending.requests}
        assert engine.overlap.pending is not pending
    # step N+1 is in flight: it computes the K/V of every token the host knows (the newest
    # included, its input), and the id it samples is on the device alone
    assert engine.overlap.pending is not None
    for r in engine.scheduler.running:
        assert r.num_computed_tokens == r.num_tokens


def test_the_option(model):
    with pytest.raises(ConfigError, match="async_scheduling"):
        Engine(model, num_blocks=64, async_scheduling="sometimes")
    assert Engine(model, num_blocks=64).overlap is None  # auto: CUDA only
    assert Engine(model, num_blocks=64, async_scheduling=True).overlap is not None


def test_the_serve_flag_reaches_the_engine_and_is_refused_with_tp():
    from argparse import Namespace

    from fivefold.serve.openai.api_server import build_parser
    from fivefold.serve.openai.backends import check_parallel_args, engine_kwargs

    codec = type("Codec", (), {"eos_id": None, "decode": staticmethod(lambda ids: "")})()
    for argv, value in (([], "auto"), (["--async-scheduling", "on"], "on"),
                        (["--async-scheduling", "off"], "off")):
        args = build_parser().parse_args(["--checkpoint", "x", *argv])
        assert engine_kwargs(args, codec)["async_scheduling"] == value
    for layout in ({"tp": 2}, {"pp": 2}, {"lora": ["a=b"]}):
        args = Namespace(**{"tp": 1, "dp": 1, "pp": 1, "lora": [],
                            "async_scheduling": "on", **layout})
        with pytest.raises(ConfigError, match="--async-scheduling on"):
            check_parallel_args(args)


def test_generated_blocks_are_found_by_prefix_as_without_it(model):
    """The blocks a step ahead fills are named (hashed) once their ids are read: a later
    prompt that repeats a finished request's prompt and output hits the same blocks."""
    prompts, params = workload(3, seed=7, prompt=(20, 30), output=(30, 30))
    hits = []
    for mode in ("off", "on"):
        engine = Engine(model, num_blocks=64, block_size=8, async_scheduling=mode)
        first = engine.generate(prompts, params)
        again = [p + o.token_ids[:25] for p, o in zip(prompts, first)]
        second = engine.generate(again, params)
        hits.append((engine.stats()["prefix_hit_tokens"], [o.token_ids for o in second]))
        assert engine.kv.pool.num_free == engine.num_blocks
    assert hits[0] == hits[1]
    assert hits[0][0] >= sum((len(p) - 1) // 8 * 8 for p in again) > 0


def test_the_http_server_with_async_scheduling_on():
    """`fivefold serve --async-scheduling on` on the CPU: concurrent greedy requests get
    the synchronous engine's text, a stream equals the whole answer, and a client that
    leaves mid-stream has its blocks freed."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from test_serve_server import CFG as SERVED
    from test_serve_server import MODEL, free_port, greedy_text, metrics, start_server

    from fivefold.models.hf import save_hf

    with tempfile.TemporaryDirectory() as directory:
        served = build_model(SERVED, seed=9).eval()
        save_hf(served, SERVED, directory)
        proc, base = start_server(["--hf", directory, "--tokenizer", "byte", "--port",
                                   str(free_port()), "--served-model-name", MODEL,
                                   "--kv-cache-gib", "0.01", "--async-scheduling", "on"])
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                               timeout=60)
        prompts = [f"request {i}: " + "ab" * i for i in range(6)]

        def ask(i):
            return client.completions.create(model=MODEL, prompt=prompts[i],
                                             max_tokens=8 + 3 * i,
                                             temperature=0).choices[0].text

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, range(6)))
        assert answers == [greedy_text(served, p, 8 + 3 * i) for i, p in enumerate(prompts)]
        chunks = list(client.completions.create(model=MODEL, prompt=prompts[5],
                                                max_tokens=23, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == answers[5]
        body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{base}/v1/completions",
                                                           json=body) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(6))
            assert metrics(base)["fivefold_kv_blocks_used"] > 0
        deadline = time.monotonic() + 15
        while metrics(base)["fivefold_kv_blocks_used"] > 0:
            assert time.monotonic() < deadline, "the aborted request kept its blocks"
            time.sleep(0.1)
        assert metrics(base)["fivefold_steps_ahead"] >= 20  # the overlap ran in the server
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_step_ahead_that_raises_ends_its_requests_after_the_step_before_is_read(
        model, monkeypatch):
    prompts, params = workload(4, seed=8, output=(20, 20))
    engine = Engine(model, num_blocks=64, async_scheduling="on")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, f"r{i}")
    for _ in range(3):
        engine.step()
    execute = engine.runner.execute

    def broken(out):
        assert out.input_ids is not None  # the step ahead
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == [f"r{i}" for i in range(4)]
    for o in outputs:  # step 4's token was read, then the step ahead failed
        assert o.finish_reason == "error" and "device lost" in o.error
        assert len(o.token_ids) == 4
    assert engine.kv.pool.num_free == engine.num_blocks and not engine.has_unfinished()
    monkeypatch.setattr(engine.runner, "execute", execute)
    (again,) = engine.generate([prompts[0]], params[0])  # the engine goes on
    assert again.finish_reason == "length" and len(again.token_ids) == 20
