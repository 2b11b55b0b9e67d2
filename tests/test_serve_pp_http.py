"""`fivefold serve --pp 2` (and `--pp 2 --tp 2`) as a real process (the other ranks spawned
by serve itself), driven by the openai client: concurrent greedy requests of mixed lengths
get the text of the one-device engine (`--pp 1`), requests for two LoRA adapters that of
each merged model, the server exits 0 after SIGTERM; `--pp` beyond the layers, with --dp,
with --tp and --lora, with a missing adapter or a --tp that does not divide the heads: one
line and exit 2 before anything starts."""

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve_lora import make_adapter  # noqa: E402
from test_serve_parallel_http import greedy_text  # noqa: E402
from test_serve_server import free_port, start_server  # noqa: E402

from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import ModelConfig  # noqa: E402

CFG = ModelConfig(name="served-pp", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1,
                  tie_embeddings=True)
PROMPTS = ["Hello", "ROMEO:", "To be, or not to be, that is the question", "a",
           "The quick brown fox jumps over the lazy dog", "JULIET: O", "Once upon", "xyz"]


@pytest.mark.parametrize("layout, adapters, says", [
    # two LoRA adapters beside the base, each stage holding its layers' factors
    (["--pp", "2"], ("alpha", "beta"), ", pp 2, adapters alpha beta)"),
    # four ranks spawned (stages of two tensor-parallel ranks): ~20 s on two shared cores
    pytest.param(["--pp", "2", "--tp", "2"], (), ", tp 2, pp 2)", marks=pytest.mark.slow),
], ids=["pp2-lora", "pp2-tp2"])
def test_pp_server_answers_as_one_device(tmp_path, layout, adapters, says):
    model = build_model(CFG, seed=9).eval()
    save_hf(model, CFG, tmp_path / "m")
    merged = {"m": model}
    for seed, (name, targets) in enumerate(zip(adapters, ("q_proj,v_proj", "all-linear"))):
        merged[name] = make_adapter(model, tmp_path / name, seed, 4, 8, targets, False)
        layout = [*layout, "--lora", f"{name}={tmp_path / name}"]
    port = free_port()
    proc, base = start_server(["--hf", str(tmp_path / "m"), "--tokenizer", "byte", "--port",
                               str(port), "--served-model-name", "m", "--kv-cache-gib",
                               "0.01", *layout], start_s=120)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                               timeout=60)

        def ask(job):
            name, prompt, max_tokens = job
            return client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0).choices[0].text

        jobs = [("m", p, 4 + 3 * i) for i, p in enumerate(PROMPTS)]
        jobs += [(name, p, 10) for name in adapters for p in PROMPTS[:4]]
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(ask, jobs))
        assert texts == [greedy_text(merged[n], p, m) for n, p, m in jobs]
        assert len({greedy_text(merged[n], PROMPTS[2], 10) for n in merged}) == len(merged)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert says in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_bad_pp_is_one_line_and_exit_2(tmp_path):
    model = build_model(CFG, seed=9).eval()
    save_hf(model, CFG, tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "fivefold.cli", "serve", "--hf",
                           str(tmp_path / "m"), "--tokenizer", "byte", "--port",
                           str(free_port()), "--pp", "4"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--pp 4 is more stages than the model's 3 layers" in lines[0]


@pytest.mark.parametrize("extra, message", [
    (["--pp", "2", "--dp", "2"], "--pp with --dp is not supported"),
    (["--pp", "2", "--tp", "2", "--lora", "a=b"], "--lora with --tp is not supported"),
    (["--pp", "2", "--lora", "a=no-such-dir"], "--lora a=no-such-dir: no such directory"),
    (["--pp", "2", "--tp", "3"], "--tp 3 does not divide the model's num_heads = 4"),
])
def test_bad_pp_options_are_one_line_before_any_rank_starts(tmp_path, monkeypatch, capsys,
                                                            extra, message):
    from fivefold.cli import main
    from fivefold.serve import tp_worker

    def started(*a, **k):  # in process, so the test can see that no rank was started
        raise AssertionError("ranks started")

    monkeypatch.setattr(tp_worker, "start_world", started)
    model = build_model(CFG, seed=9).eval()
    save_hf(model, CFG, tmp_path / "m")
    assert main(["serve", "--hf", str(tmp_path / "m"), "--tokenizer", "byte", "--port",
                 str(free_port()), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_more_ranks_than_gpus_is_one_line(tmp_path, monkeypatch, capsys):
    """On CUDA every rank serve spawns takes a GPU (NCCL refuses two ranks on one): --pp 2
    --tp 2 where one GPU is visible is one line before any rank starts (the GPU stood in
    for: this machine may have none)."""
    import torch

    from fivefold.cli import main
    from fivefold.serve import tp_worker
    from fivefold.serve.openai import backends

    def started(*a, **k):
        raise AssertionError("ranks started")

    monkeypatch.setattr(tp_worker, "start_world", started)
    monkeypatch.setattr(backends, "_backend_name", lambda args: "nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    save_hf(build_model(CFG, seed=9).eval(), CFG, tmp_path / "m")
    for layout, says in ((["--pp", "2", "--tp", "2"], "--pp 2 --tp 2 runs 4 ranks"),
                         (["--tp", "2"], "--tp 2 runs 2 ranks")):
        assert main(["serve", "--hf", str(tmp_path / "m"), "--tokenizer", "byte", "--device",
                     "cpu", "--port", str(free_port()), *layout]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "1 is visible" in lines[0], lines

