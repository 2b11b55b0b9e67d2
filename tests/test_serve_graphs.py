"""Decode at fixed batch sizes from static buffers (serve/cuda_graphs.py), run on CPU
without capture ("static"): every decode step padded to the next size of the ladder, its
padding rows writing to the trash slot; greedy tokens identical to the eager engine and
the dense path; a ladder above the KV cache's capacity is one ConfigError, and through
`fivefold serve` one line and exit 2 before anything is served."""

import pytest
import torch

from fivefold.errors import ConfigError
from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.serve.cuda_graphs import StaticDecode, capture_sizes
from fivefold.serve.engine import Engine
from fivefold.serve.sampling_params import SamplingParams
from fivefold.train.generate import generate

CFG = ModelConfig(name="graphs", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=160, init_std=0.1)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_capture_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))


def test_static_decode_gives_the_eager_and_dense_greedy_tokens(monkeypatch):
    model = build_model(CFG, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(torch.randint(1, 90, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(14)]
    params = [SamplingParams(max_tokens=int(torch.randint(1, 30, (1,), generator=g)),
                             temperature=0) for _ in prompts]
    dense = [generate(model, p, sp.max_tokens, greedy=True) for p, sp in zip(prompts, params)]
    sizes = []
    real = StaticDecode.run
    monkeypatch.setattr(StaticDecode, "run",
                        lambda self, tokens, *a: sizes.append(len(tokens)) or
                        real(self, tokens, *a))
    engine = Engine(model, num_blocks=120, max_num_seqs=11, cuda_graphs="static")
    assert engine.runner.static.sizes == [1, 2, 4, 8, 11]
    static = engine.generate(prompts, params)
    eager = Engine(model, num_blocks=120, max_num_seqs=11, cuda_graphs=False)
    assert eager.runner.static is None
    assert [o.token_ids for o in static] == dense
    assert [o.token_ids for o in eager.generate(prompts, params)] == dense
    padded = [n for n in sizes if n not in engine.runner.static.sizes]
    assert len(sizes) > 20 and padded  # many decode steps ran static, some of them padded
    # the padding rows wrote only to the trash slot, the first slot past the pool
    assert engine.cache.trash_slot == engine.num_blocks * 16 == engine.cache.k.shape[1]
    assert engine.cache.k_ext[:, engine.cache.trash_slot].abs().sum() > 0


def test_a_ladder_above_the_caches_capacity_is_one_line():
    model = build_model(CFG.replace(max_seq_len=64), seed=3).eval()
    with pytest.raises(ConfigError, match="up to 32 sequences .* holds 20 blocks"):
        Engine(model, num_blocks=20, max_num_seqs=32, cuda_graphs="static")
    Engine(model, num_blocks=20, max_num_seqs=32, cuda_graphs=False)  # eager: no ladder


def test_enforce_eager_reaches_the_engine():
    from fivefold.serve.openai.api_server import build_parser
    from fivefold.serve.openai.backends import engine_kwargs

    codec = type("Codec", (), {"eos_id": None, "decode": staticmethod(lambda ids: "")})()
    for argv, graphs in (([], True), (["--enforce-eager"], False)):
        args = build_parser().parse_args(["--checkpoint", "x", *argv])
        assert engine_kwargs(args, codec)["cuda_graphs"] is graphs


def test_serve_with_a_ladder_above_the_cache_is_one_line_and_exit_2(tmp_path, monkeypatch,
                                                                       capsys):
    """`fivefold serve` where decode is captured (CUDA; here the same static path, run
    without capture, as on CPU): --max-num-seqs 32 over a cache of 20 blocks is one line
    and exit 2 before anything is served; with --enforce-eager the same settings start."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from test_serve_server import free_port

    from fivefold.cli import main
    from fivefold.models.hf import save_hf
    from fivefold.serve.openai import api_server, backends

    cfg = CFG.replace(max_seq_len=64)
    save_hf(build_model(cfg, seed=3), cfg, tmp_path / "m")
    real = backends.engine_kwargs

    def static_where_captured(args, codec):
        kw = real(args, codec)
        return {**kw, "cuda_graphs": "static" if kw["cuda_graphs"] else False}

    began = []

    def served(*a, **k):  # stands in for the HTTP app: past every check, serving begins
        began.append(True)
        raise RuntimeError("serving began")

    monkeypatch.setattr(backends, "engine_kwargs", static_where_captured)
    monkeypatch.setattr(api_server, "build_app", served)
    per_block = 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_per_head * 4  # fp32
    argv = ["serve", "--hf", str(tmp_path / "m"), "--tokenizer", "byte", "--port",
            str(free_port()), "--kv-cache-gib", repr(20 * per_block / 2**30),
            "--max-num-seqs", "32"]
    assert main(argv) == 2 and not began
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "up to 32 sequences" in lines[0], lines
    assert "holds 20 blocks" in lines[0] and "--enforce-eager" in lines[0]
    capsys.readouterr()
    assert main(argv + ["--enforce-eager"]) != 2 and began  # eager: no ladder to check
