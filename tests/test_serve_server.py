"""`fivefold serve` end to end: a real server process on a free loopback port, driven by the
official `openai` client (and httpx for what the client will not send).

Checks: models, completions and chat (greedy text equals the engine's in this process),
streaming equals non-streaming, bad requests answer 400 with OpenAI's error body and the
server keeps serving, concurrent requests each get what they get alone, a client that
leaves mid-stream has its blocks freed, and SIGTERM ends the process with exit code 0
within seconds. Every wait is bounded.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import ModelConfig  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402

CFG = ModelConfig(name="served", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=512, init_std=0.1,
                  tie_embeddings=True)
MODEL = "tiny-served"


def start_server(args: list[str], start_s: float = 90) -> tuple[subprocess.Popen, str]:
    """`fivefold serve ARGS` on the CPU, one thread, 127.0.0.1, stopped 1 s after SIGTERM:
    (the process, its base URL) once /health answers, or one error with its stderr."""
    port = args[args.index("--port") + 1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fivefold.cli", "serve", *args, "--device", "cpu",
         "--shutdown-grace", "1"], env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_s
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served")
    model = build_model(CFG, seed=9).eval()
    save_hf(model, CFG, directory)
    port = free_port()
    proc, base = start_server(["--hf", str(directory), "--tokenizer", "byte", "--port",
                               str(port), "--served-model-name", MODEL, "--kv-cache-gib",
                               "0.01"])
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    yield {"proc": proc, "base": base, "client": client, "model": model}
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def greedy_text(model, prompt: str, max_tokens: int) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (out,) = Engine(model, num_blocks=64).generate(
            [list(prompt.encode())], SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:
        torch.set_num_threads(threads)
    return bytes(t for t in out.token_ids if t < 256).decode("utf-8", errors="replace")


def test_models_and_completion(server):
    client = server["client"]
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)
    assert out.choices[0].text == greedy_text(server["model"], "Hello", 12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12


def test_chat_uses_the_plain_template(server):
    client = server["client"]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=10,
        temperature=0)
    expected = greedy_text(server["model"], "user: hi there\nassistant:", 10)
    assert out.choices[0].message.content == expected
    assert out.choices[0].message.role == "assistant"


def test_streaming_equals_whole(server):
    client = server["client"]
    whole = client.completions.create(model=MODEL, prompt="Once", max_tokens=20,
                                      temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=20,
                                            temperature=0, stream=True))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once"}], max_tokens=8,
        temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chat)
    assert text == greedy_text(server["model"], "user: Once\nassistant:", 8)


def sampled_text(model, prompt: str, max_tokens: int, seed: int) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (out,) = Engine(model, num_blocks=64).generate(
            [list(prompt.encode())], SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                    seed=seed))
    finally:
        torch.set_num_threads(threads)
    return bytes(t for t in out.token_ids if t < 256).decode("utf-8", errors="replace")


def test_n_choices_whole_and_streamed(server):
    client = server["client"]
    out = client.completions.create(model=MODEL, prompt="Pick", max_tokens=10, n=3,
                                    temperature=1.0, seed=3)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts == [sampled_text(server["model"], "Pick", 10, 3 + i) for i in range(3)]
    chunks = list(client.completions.create(model=MODEL, prompt="Pick", max_tokens=10, n=3,
                                            temperature=1.0, seed=3, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "", "max_tokens": 4}, "empty"),
    ({"prompt": "y" * 600, "max_tokens": 4}, "context"),
    ({"prompt": "z" * 500, "max_tokens": 100}, "context"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"max_tokens": 4}, "prompt"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, needle):
    r = httpx.post(f"{server['base']}/v1/completions", json={"model": MODEL, **body},
                   timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        server["client"].completions.create(model=MODEL, prompt="x", max_tokens=0)
    ok = server["client"].completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert len(ok.choices[0].text.encode("utf-8", errors="replace")) >= 1


def test_concurrent_requests_each_get_their_own_answer(server):
    client = server["client"]
    prompts = [f"request number {i}: " + "ab" * i for i in range(8)]

    def ask(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [greedy_text(server["model"], p, 16) for p in prompts]


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    base = server["base"]
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{base}/v1/completions",
                                                       json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        during = metrics(base)
    assert during["fivefold_kv_blocks_used"] > 0 and during["fivefold_requests_running"] == 1
    deadline = time.monotonic() + 15
    while metrics(base)["fivefold_kv_blocks_used"] > 0:
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        time.sleep(0.1)
    assert metrics(base)["fivefold_requests_running"] == 0


def test_sigterm_stops_the_server_with_exit_code_0(server):
    proc, base = server["proc"], server["base"]
    events = []

    def long_stream():
        body = {"model": MODEL, "prompt": "go", "max_tokens": 450, "temperature": 0,
                "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
                events.extend(r.iter_lines())
        except httpx.HTTPError as e:
            events.append(f"error: {e}")

    reader = threading.Thread(target=long_stream)
    reader.start()
    deadline = time.monotonic() + 15
    while metrics(base)["fivefold_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)  # a hang guard: the drain's own bound is --shutdown-grace
    reader.join(timeout=30)
    assert code == 0, proc.stderr.read()[-2000:]
    # What the drain promises: the running stream was ended by the server, not cut off — its
    # last chunk carries a finish reason and [DONE] follows (finished, or aborted once the
    # grace ran out).
    lines = [e for e in events if e]
    assert not reader.is_alive() and lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(e[len("data: "):]) for e in lines if e.startswith("data: {")]
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] is not None, lines[-3:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/health", timeout=2)


def test_chat_template_from_tokenizer_config_or_plain(tmp_path):
    from fivefold.serve.openai.api_server import chat_template, plain_chat_prompt

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_template(None) is plain_chat_prompt
    assert plain_chat_prompt(messages) == "system: be brief\nuser: hi\nassistant:"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]"
                         "{{ m['content'] }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    render = chat_template(tmp_path)
    assert render(messages) == "<s>[system]be brief</s>[user]hi</s>[assistant]"


def test_only_the_rank_that_binds_the_port_checks_it(monkeypatch):
    """A taken port is one line before any model loads, on the rank that would bind it; a
    `fivefold launch` rank other than 0 never binds it, so it does not check it (two ranks
    binding it at once to check it found it taken now and then)."""
    from fivefold.errors import ConfigError
    from fivefold.serve.openai.api_server import _check_port

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        monkeypatch.delenv("RANK", raising=False)
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            _check_port("127.0.0.1", port)
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ConfigError, match="cannot listen"):
            _check_port("127.0.0.1", port)
        monkeypatch.setenv("RANK", "1")
        _check_port("127.0.0.1", port)  # rank 1 serves no HTTP: nothing to check
