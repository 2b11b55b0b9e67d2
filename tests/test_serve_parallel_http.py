"""`fivefold serve --tp 2` as a real process (rank 1 spawned by serve itself), and `--dp 2`
with three `--lora` adapters through the HTTP app, both driven by the openai client:

- tp 2 answers concurrent greedy requests with the text of the one-device engine, and exits
  0 after SIGTERM with its worker gone;
- dp 2 answers every request, base and adapters mixed, with the text of the base or of that
  adapter's merged model; both replicas take work; /v1/models lists the adapters with the
  base as parent; /metrics sums the replicas and shows each one's load.
"""

import asyncio
import signal
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve_lora import make_adapter  # noqa: E402
from test_serve_server import free_port, start_server  # noqa: E402

from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import ModelConfig  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402

CFG = ModelConfig(name="served-par", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1,
                  tie_embeddings=True)
PROMPTS = ["Hello", "ROMEO:", "To be, or not", "a", "The quick brown fox", "JULIET: O",
           "Once upon", "xyz"]


def greedy_text(model, prompt: str, max_tokens: int) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (out,) = Engine(model, num_blocks=64).generate(
            [list(prompt.encode())], SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:
        torch.set_num_threads(threads)
    return bytes(t for t in out.token_ids if t < 256).decode("utf-8", errors="replace")


def test_tp2_server_answers_as_one_device(tmp_path):
    model = build_model(CFG, seed=9).eval()
    save_hf(model, CFG, tmp_path / "m")
    port = free_port()
    proc, base = start_server(["--hf", str(tmp_path / "m"), "--tokenizer", "byte", "--port",
                               str(port), "--served-model-name", "m", "--kv-cache-gib",
                               "0.01", "--tp", "2"], start_s=120)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                               timeout=60)

        def ask(prompt):
            return client.completions.create(model="m", prompt=prompt, max_tokens=16,
                                             temperature=0).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(ask, PROMPTS))
        assert texts == [greedy_text(model, p, 16) for p in PROMPTS]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "tp 2" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _args(directory, adapters) -> Namespace:
    from fivefold.serve.openai.api_server import build_parser

    argv = ["--hf", str(directory), "--tokenizer", "byte", "--device", "cpu", "--kv-cache-gib",
            "0.01", "--dp", "2"]
    for name, path in adapters:
        argv += ["--lora", f"{name}={path}"]
    return build_parser().parse_args(argv)


def test_dp2_with_three_adapters(tmp_path, one_thread):
    from fivefold.serve.openai.api_server import build_app, plain_chat_prompt
    from fivefold.serve.openai.backends import start
    from fivefold.serve.openai.serving import OpenAIServing

    base_model = build_model(CFG, seed=9).eval()
    save_hf(base_model, CFG, tmp_path / "m")
    names, expected = ["alpha", "beta", "gamma"], {}
    for seed, (name, targets) in enumerate(zip(names, ("q_proj,v_proj", "all-linear",
                                                       "k_proj,down_proj"), strict=True)):
        merged = make_adapter(base_model, tmp_path / name, seed, 4, 8, targets, False)
        expected[name] = [greedy_text(merged, p, 10) for p in PROMPTS[:4]]
    expected["m"] = [greedy_text(base_model, p, 10) for p in PROMPTS[:4]]
    backend = start(_args(tmp_path / "m", [(n, tmp_path / n) for n in names]))
    serving = OpenAIServing(backend.loop, "m", lambda text: list(text.encode()),
                            plain_chat_prompt, backend.max_model_len, backend.adapters)
    app = build_app(serving, backend.loop)
    backend.loop.start()

    async def drive():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none",
                                        http_client=http, max_retries=0)
            models = await client.models.list()
            jobs = [(m, i) for i in range(4) for m in expected]
            outs = await asyncio.gather(*[
                client.completions.create(model=m, prompt=PROMPTS[i], max_tokens=10,
                                          temperature=0) for m, i in jobs])
            metrics = (await http.get("/metrics")).text
        return models, jobs, outs, metrics

    try:
        models, jobs, outs, metrics = asyncio.run(drive())
    finally:
        backend.loop.stop()
        for loop in backend.loop.loops:
            loop.thread.join(timeout=5)
    listed = {m.id: getattr(m, "parent", None) for m in models.data}
    assert listed == {"m": None, "alpha": "m", "beta": "m", "gamma": "m"}
    for (m, i), out in zip(jobs, outs, strict=True):
        assert out.choices[0].text == expected[m][i], (m, i)
        assert out.model == m
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    routed = [values[f'fivefold_replica_requests_routed{{replica="{r}"}}'] for r in (0, 1)]
    assert sum(routed) == len(jobs) and min(routed) > 0  # both replicas took work
    per_replica = [values[f'fivefold_replica_generated_tokens{{replica="{r}"}}'] for r in (0, 1)]
    assert values["fivefold_generated_tokens"] == sum(per_replica) == 10 * len(jobs)
    assert values["fivefold_kv_blocks_total"] == 2 * backend.num_blocks
