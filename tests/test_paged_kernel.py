"""The Triton paged decode kernel (serve/paged_attention.py) in the interpreter
(TRITON_INTERPRET=1) against the gather + SDPA path, fp32 and fp16, and inside the engine
(the fused decode path takes it where it can run): the same greedy tokens.

The interpreter must be on before triton is first imported (its standard library's jitted
functions are built then), and the test process may have imported triton already: so the
cases run in one child process started with TRITON_INTERPRET=1, which reports what it
measured as JSON, and the tests judge that.

Tolerance (tests/tolerances.py's model): the output is a softmax-weighted mean of L values
(Σp = 1), so reordering its sum moves an entry by ≤ λ·√L·u·max|v|; a score q·k/√d moves by
λ·√d·u·|q||k|/√d, which moves the weights relatively by as much, hence the output by that
times max|v|; two runs √2 apart. fp16: both results are rounded to fp16 from fp32 values
that close, so they differ by at most one fp16 ulp of the output on top.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.tolerances import LAMBDA, U32

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
SHAPES = [(2, 2, 16), (1, 3, 8), (4, 1, 64), (3, 2, 24)]


def case(dtype, rep, kv_heads, d, lens, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in lens) + 4
    k = torch.randn(blocks * block_size, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(blocks * block_size, kv_heads, d, generator=g).to(dtype)
    width = max(-(-n // block_size) for n in lens)
    order = torch.randperm(blocks, generator=g)  # blocks scattered over the pool
    tables, used = torch.zeros(len(lens), width, dtype=torch.long), 0
    for i, n in enumerate(lens):
        own = -(-n // block_size)
        tables[i, :own] = order[used:used + own]
        tables[i, own:] = order[used + own - 1]  # padded with its last block, as the engine
        used += own
    q = torch.randn(len(lens), rep * kv_heads, d, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens)


def bound(q, k, v, lens, dtype) -> torch.Tensor:
    """Per sequence: the largest difference the error model allows (module docstring)."""
    d = q.shape[-1]
    scores = q.float().norm(dim=-1).amax(-1) * k.float().norm(dim=-1).max() / math.sqrt(d)
    fp32 = math.sqrt(2) * LAMBDA * U32 * (lens.float().sqrt() + math.sqrt(d) * scores)
    fp32 = fp32 * v.float().abs().max()
    if dtype == torch.float16:
        fp32 = fp32 + 2.0**-10 * v.float().abs().max()  # one fp16 ulp of |out| <= max|v|
    return fp32


def child() -> dict:
    """Every case, in a process started with TRITON_INTERPRET=1."""
    from fivefold.models.init import build_model
    from fivefold.models.presets import ModelConfig
    from fivefold.serve import paged_attention
    from fivefold.serve.engine import Engine
    from fivefold.serve.sampling_params import SamplingParams

    torch.set_num_threads(1)
    result = {"available": paged_attention.available(torch.device("cpu")), "cases": {}}
    lens = [1, 17, 33, 5, 48, 16]
    for name, dtype in DTYPES.items():
        for rep, kv_heads, d in SHAPES:
            q, k, v, tables, lens_t = case(dtype, rep, kv_heads, d, lens)
            out = paged_attention.paged_decode(q, k, v, tables, lens_t, 16)
            ref = paged_attention.paged_decode_reference(q, k, v, tables, lens_t, 16)
            err = (out.float() - ref.float()).abs().amax((1, 2))
            allowed = bound(q, k, v, lens_t, dtype)
            # keys past a length are never read: NaN there changes nothing
            k[tables[0, 0] * 16 + 1:(tables[0, 0] + 1) * 16] = float("nan")
            again = paged_attention.paged_decode(q, k, v, tables, lens_t, 16)
            result["cases"][f"{name}-{rep}-{kv_heads}-{d}"] = {
                "dtype": str(out.dtype), "err": err.tolist(),
                "bound": allowed.tolist(),
                "nan_past_length_ignored": bool(torch.equal(again[0], out[0]))}
    # strided queries (the fused GEMM's rows) into a slice of a larger output
    q, k, v, tables, lens_t = case(torch.float32, 2, 2, 16, [9, 40, 3])
    wide = torch.zeros(3, 8, 16)
    wide[:, :4] = q
    out = torch.full((5, 4, 16), 7.0)
    paged_attention.paged_decode(wide[:, :4], k, v, tables, lens_t, 16, out[1:4])
    ref = paged_attention.paged_decode_reference(q, k, v, tables, lens_t, 16)
    result["strided"] = {"err": float((out[1:4] - ref).abs().max()),
                         "bound": float(bound(q, k, v, lens_t, torch.float32).min()),
                         "untouched": bool((out[0] == 7).all() and (out[4] == 7).all())}
    # the engine: the fused decode path calls the kernel, greedy tokens as without it
    cfg = ModelConfig(name="kernel", vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128,
                      init_std=0.1)
    model = build_model(cfg, seed=2).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 19, 33)]
    params = SamplingParams(max_tokens=4, temperature=0)
    calls = []
    real = paged_attention.paged_decode

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    paged_attention.paged_decode = counted
    with_kernel = Engine(model, num_blocks=32).generate(prompts, params)
    kernel_calls = len(calls)
    os.environ["FIVEFOLD_PAGED_KERNEL"] = "0"
    without = Engine(model, num_blocks=32).generate(prompts, params)
    result["engine"] = {"kernel_calls": kernel_calls, "calls_when_off": len(calls) - kernel_calls,
                        "with": [o.token_ids for o in with_kernel],
                        "without": [o.token_ids for o in without]}
    return result


@pytest.fixture(scope="module")
def measured():
    from common import run_interpreted

    return run_interpreted(["-m", "tests.test_paged_kernel"], cwd=ROOT,
                           unset=("FIVEFOLD_PAGED_KERNEL",))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rep, kv_heads, d", SHAPES)
def test_kernel_matches_gather_and_sdpa(measured, dtype, rep, kv_heads, d):
    assert measured["available"]
    c = measured["cases"][f"{dtype}-{rep}-{kv_heads}-{d}"]
    assert c["dtype"] == str(DTYPES[dtype])
    assert all(e <= b for e, b in zip(c["err"], c["bound"], strict=True)), c
    assert c["nan_past_length_ignored"]


def test_strided_queries_and_an_output_slice(measured):
    s = measured["strided"]
    assert s["err"] <= s["bound"] and s["untouched"], s


def test_engine_with_the_kernel_gives_the_same_greedy_tokens(measured):
    e = measured["engine"]
    assert e["kernel_calls"] == 3 * 2  # 3 decode steps x 2 layers (token 1: the prefill)
    assert e["calls_when_off"] == 0  # FIVEFOLD_PAGED_KERNEL=0: the gather + SDPA path
    assert e["with"] == e["without"]


if __name__ == "__main__":
    print(json.dumps(child()))
