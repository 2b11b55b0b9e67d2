"""`fivefold serve` takes any request without failing (issue 43 §2).

A real server on 127.0.0.1 (byte tokenizer, a 64 KiB body limit) answers each malformed shape
found by an earlier fuzz with a 400 whose OpenAI-shaped JSON error names the field: lone
surrogates (escaped, and as the raw bytes ED A0 80) in the prompt, chat content and `model`;
token ids -1, 2^63, 2^64, 10^30 with echo; a content part whose `type` is a list or dict;
loose types (`max_tokens` "5", 5.0, true; `n` 16.0; `include_usage` "yes"); one token twice
in `logit_bias`. A body past the limit gets 413 (declared or chunked). A fuzz mixing these
shapes with valid requests, bounded in count and time, gets only 2xx and 4xx with JSON (or
event-stream) bodies, and /health still answers. A client that disconnects leaves no
traceback in the log. In process: tokenisation runs off the event loop, so /health is
answered while a request's tokenizer is still busy.
"""

import json
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve_server import free_port, start_server  # noqa: E402

from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import ModelConfig  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402

CFG = ModelConfig(name="fuzzed", vocab_size=256, hidden_size=32, intermediate_size=64,
                  num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=256, init_std=0.1,
                  tie_embeddings=True)
MODEL = "tiny-fuzzed"
LIMIT = 65536
ERROR_KEYS = {"message", "type", "param", "code"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def dumps(body: dict) -> bytes:
    return json.dumps(body).encode()  # lone surrogates as \ud800 escapes


# (path, body bytes, the field the 400 must name)
SHAPES = [
    (CMPL, dumps({"model": MODEL, "prompt": "a\ud800b"}), "prompt"),
    (CMPL, dumps({"model": MODEL, "prompt": "\ud83d"}), "prompt"),  # half an emoji
    (CMPL, b'{"prompt": "a\xed\xa0\x80b"}', "prompt"),
    (CHAT, dumps({"messages": [{"role": "user", "content": "a\ud800b"}]}), "messages"),
    (CHAT, dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}), "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "messages"),
    (CMPL, dumps({"model": "m\ud800", "prompt": "hi"}), "model"),
    (CHAT, dumps({"model": "\udfff", "messages": [{"role": "user", "content": "hi"}]}),
     "model"),
    (CMPL, dumps({"prompt": [-1], "echo": True}), "prompt"),
    (CMPL, dumps({"prompt": [2**63], "echo": True}), "prompt"),
    (CMPL, dumps({"prompt": [2**64], "echo": True}), "prompt"),
    (CMPL, dumps({"prompt": [10**30], "echo": True}), "prompt"),
    (CMPL, dumps({"prompt": [1, 300], "echo": True}), "prompt"),  # past the vocabulary
    (CHAT, dumps({"messages": [{"role": "user", "content": [{"type": ["text"]}]}]}),
     "messages"),
    (CHAT, dumps({"messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}),
     "messages"),
    (CMPL, dumps({"prompt": "hi", "max_tokens": "5"}), "max_tokens"),
    (CMPL, dumps({"prompt": "hi", "max_tokens": 5.0}), "max_tokens"),
    (CMPL, dumps({"prompt": "hi", "max_tokens": True}), "max_tokens"),
    (CMPL, dumps({"prompt": "hi", "n": 16.0}), "n"),
    (CMPL, dumps({"prompt": "hi", "stream": True, "stream_options": {
        "include_usage": "yes"}}), "stream_options"),
    (CMPL, dumps({"prompt": "hi", "echo": "yes"}), "echo"),
    (CMPL, dumps({"prompt": "hi", "temperature": "0"}), "temperature"),
    (CMPL, dumps({"prompt": "hi", "logit_bias": {"05": 60, "5": 60}}), "logit_bias"),
    (CMPL, dumps({"prompt": "hi", "logit_bias": {" 5": 1}}), "logit_bias"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzzed")
    save_hf(build_model(CFG, seed=3).eval(), CFG, directory)
    port = free_port()
    proc, base = start_server(["--hf", str(directory), "--tokenizer", "byte", "--port",
                               str(port), "--served-model-name", MODEL, "--kv-cache-gib",
                               "0.01", "--max-request-bytes", str(LIMIT)])
    yield {"proc": proc, "base": base, "port": port}
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def send(base: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json"})


def assert_answered(r: httpx.Response) -> None:
    """2xx or 4xx, never 5xx; an error is OpenAI's JSON object, a stream ends with [DONE]."""
    assert 200 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == ERROR_KEYS, r.text[:300]
    elif r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]", r.text[-300:]
        assert not any('"error"' in line for line in lines), r.text[:300]
    else:
        assert r.json()["choices"], r.text[:300]


@pytest.mark.parametrize("path,content,field", SHAPES,
                         ids=[f"{i}-{s[2]}" for i, s in enumerate(SHAPES)])
def test_each_malformed_shape_is_a_400_naming_its_field(server, path, content, field):
    r = send(server["base"], path, content)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error"
    assert (error["param"] or "").split(".")[0] == field, error
    assert field in error["message"] or error["param"] == field, error


def test_logit_bias_past_100_on_one_token_is_never_applied(server):
    # "05" and "5" are one token: refused, never 60 + 60 = 120 added to it
    r = send(server["base"], CMPL, dumps({"prompt": "hi", "max_tokens": 1,
                                          "logit_bias": {"05": 60, "5": 60}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = send(server["base"], CMPL, dumps({"prompt": "hi", "max_tokens": 1, "temperature": 0,
                                          "logit_bias": {"05": 100}}))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "\x05"


def test_a_body_past_the_limit_is_413(server):
    base = server["base"]
    big = dumps({"prompt": "x" * LIMIT})
    r = send(base, CMPL, big)
    assert r.status_code == 413 and set(r.json()["error"]) == ERROR_KEYS
    assert "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = httpx.post(f"{base}{CMPL}", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and set(r.json()["error"]) == ERROR_KEYS
    r = send(base, CMPL, dumps({"prompt": "x" * (LIMIT // 2), "max_tokens": 1}))
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]  # not 413


FUZZ_VALUES = {  # each field's values, valid and not
    "model": [MODEL, None, "x\ud800", 7, "gpt-4o"],
    "max_tokens": [1, 3, "3", 2.0, True, 0, -1, 2**64],
    "n": [1, 2, 16.0, "2", 17],
    "temperature": [0, 1, 0.5, "1", True, -1],
    "logit_bias": [{"05": 60, "5": 60}, {"5": 100}, {"x": 1}, {"5": 101}],
    "stream": [True, False, "no"],
    "seed": [1, 2**64, 1.5, -(2**63)],
    "stop": ["\ud800", ["a"], [1]],
    "prompt": ["é\ud83d", [1, 2], [-1], [2**64], [10**30], [True], "", "x" * 300],
    "echo": [True, "yes", 1],
    "messages": [[{"role": "user", "content": c}] for c in (
        "\ud800", [{"type": "text", "text": "a"}], [{"type": ["x"]}],
        [{"type": "text", "text": 5}], [{"type": {"k": "v"}}], None)],
}


def fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    """A named shape (a third), or a valid request with up to two fields fuzzed."""
    if rng.random() < 0.35:
        path, content, _ = rng.choice(SHAPES)
        return path, content
    chat = rng.random() < 0.4
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else
                {"prompt": "hi"})
    names = [k for k in FUZZ_VALUES if k not in (("prompt", "echo") if chat else
                                                   ("messages",))]
    for name in rng.sample(names, rng.choice([0, 1, 1, 2])):
        body[name] = rng.choice(FUZZ_VALUES[name])
    if body.get("stream") is True and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": rng.choice([True, "yes"])}
    return (CHAT if chat else CMPL), dumps(body)


def test_fuzz_only_2xx_and_4xx_with_json_then_health(server):
    base = server["base"]
    rng = random.Random(43)
    requests = [fuzz_body(rng) for _ in range(160)]
    deadline = time.monotonic() + 20  # bounded in time as well as in count

    def one(item):
        if time.monotonic() > deadline:
            return None
        r = send(base, *item)
        assert_answered(r)
        return r.status_code

    with ThreadPoolExecutor(4) as pool:
        codes = [c for c in pool.map(one, requests) if c is not None]
    assert len(codes) >= 40 and codes.count(400) >= 20 and codes.count(200) >= 5, \
        (len(codes), sorted(set(codes)))
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    assert_answered(send(base, CMPL, dumps({"prompt": "hi", "max_tokens": 2})))


def test_a_client_that_leaves_logs_no_traceback(server):
    base, port, proc = server["base"], server["port"], server["proc"]
    body = dumps({"model": MODEL, "prompt": "go", "max_tokens": 200, "ignore_eos": True})
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.2)
        sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    assert "Exception" not in err, err[-3000:]


def test_tokenising_runs_off_the_event_loop():
    """A tokenizer still busy with one request's prompt does not hold /health: the encode
    below waits until /health has answered, which could never happen on the loop."""
    from fastapi.testclient import TestClient

    from fivefold.serve.openai.api_server import build_app, plain_chat_prompt
    from fivefold.serve.openai.serving import EngineLoop, OpenAIServing

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(build_model(CFG, seed=3).eval(), num_blocks=32)
    entered, released = threading.Event(), threading.Event()
    seen = {}

    def slow_encode(text: str) -> list[int]:
        entered.set()
        seen["released"] = released.wait(10)  # False: /health was never answered
        return list(text.encode())

    loop = EngineLoop(engine)
    serving = OpenAIServing(loop, MODEL, slow_encode, plain_chat_prompt, 256)
    loop.start()
    try:
        with TestClient(build_app(serving, loop)) as http:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(http.post, CMPL, json={"prompt": "hi", "max_tokens": 1})
                assert entered.wait(10)
                assert http.get("/health").status_code == 200  # while encode waits
                released.set()
                assert pending.result(timeout=30).status_code == 200
        assert seen["released"] is True
    finally:
        loop.stop()
        loop.thread.join(timeout=5)
        torch.set_num_threads(threads)


def test_codecs_encode_through_the_batch_form_with_encodes_ids():
    """gil_free_ids: the batch form lets go of the GIL (bench/serve/serve_stall.py measures the
    event loop's waits) and gives encode's ids, for the bundled BPE (no special tokens) and
    a tokenizer.json served with --hf (the model's BOS)."""
    pytest.importorskip("tokenizers")
    from fivefold.data.tokenizer import BUILTIN, load_tokenizer
    from fivefold.train.generate import TextCodec

    text = "The quick brown fox, naïve café — 123 jumps.\n  Over\tthe lazy dog! 🦊 " * 20
    bpe = load_tokenizer("corpus-bpe")
    assert bpe.encode(text) == bpe._tok.encode(text, add_special_tokens=False).ids
    hf = TextCodec(BUILTIN["corpus-bpe"])
    assert hf.encode(text) == hf._tok.encode(text).ids and len(hf.encode(text)) > 100


def test_a_bad_body_limit_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "fivefold.cli", "serve", "--hf", str(tmp_path),
                           "--max-request-bytes", "0"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--max-request-bytes 0" in lines[0], proc.stderr


def test_a_tp_step_that_fails_after_reaching_the_workers_ends_the_server(monkeypatch):
    """serve --tp: a step failing on rank 0 before its message goes out fails its requests
    alone (no rank saw it); one failing after (the workers may wait in a collective rank 0
    never joins) is RanksOutOfStep: the loop dies, /health answers 503, serve exits 1
    (test_serve_exits_1_when_the_engine_loop_dies), and no further message is sent."""
    from fastapi.testclient import TestClient

    from fivefold.serve import tp_worker
    from fivefold.serve.openai.api_server import build_app, plain_chat_prompt
    from fivefold.serve.openai.serving import EngineLoop, OpenAIServing
    from fivefold.serve.request import Request
    from fivefold.serve.runner import ModelRunner
    from fivefold.serve.scheduler import SchedulerOutput

    sent = []
    monkeypatch.setattr(tp_worker, "send_object", lambda obj, group: sent.append(obj))
    monkeypatch.setattr(ModelRunner, "execute", lambda self, out: (_ for _ in ()).throw(
        RuntimeError("connection closed by peer")))

    class Kv:
        tables = {"a": [3]}

        def block_ids(self, rid):
            return self.tables[rid]

    a = Request("a", [1, 2], SamplingParams())
    driver = tp_worker.TPDriverRunner.__new__(tp_worker.TPDriverRunner)
    driver.kv, driver.scheduler, driver._sent, driver.control = Kv(), None, {}, None
    driver.broken = None
    driver.scheduler = type("S", (), {"requests": {"a": a}})()
    Kv.tables = {}  # encoding fails before anything is sent: an ordinary error
    with pytest.raises(KeyError):
        driver.execute(SchedulerOutput([(a, 2)]))
    assert sent == [] and driver.broken is None and driver._sent == {}
    Kv.tables = {"a": [3]}
    with pytest.raises(tp_worker.RanksOutOfStep, match="out of step.*connection closed"):
        driver.execute(SchedulerOutput([(a, 2)]))
    assert len(sent) == 1 and not issubclass(tp_worker.RanksOutOfStep, Exception)
    with pytest.raises(tp_worker.RanksOutOfStep):
        driver.execute(SchedulerOutput([(a, 1)]))
    driver.close()
    assert len(sent) == 1  # nothing more once out of step, not even the stop message

    engine = Engine(build_model(CFG, seed=3).eval(), num_blocks=32)

    def out_of_step(_out):
        raise tp_worker.RanksOutOfStep("the ranks are out of step")

    monkeypatch.setattr(engine.runner, "execute", out_of_step)
    fatal = threading.Event()
    loop = EngineLoop(engine, on_fatal=fatal.set)
    serving = OpenAIServing(loop, MODEL, lambda s: list(s.encode()), plain_chat_prompt, 256)
    loop.start()
    try:
        with TestClient(build_app(serving, loop)) as http:
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 500 and "out of step" in r.json()["error"]["message"]
            assert fatal.wait(5) and not loop.alive
            assert http.get("/health").status_code == 503
    finally:
        loop.stop()
        loop.thread.join(timeout=5)
