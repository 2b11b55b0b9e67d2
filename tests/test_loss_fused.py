"""The GPU path of the head + loss (models/loss.py `_fused`, models/loss_kernel.py): the same
numbers as the chunked path, its Triton kernel in the interpreter, and its traffic on the
8B-shaped step as a trace counts it (fivefold.trace) against the ideal derived here."""

import textwrap

import pytest
import torch
from common import run_interpreted

from fivefold.models import loss as loss_module
from fivefold.models import loss_chunks
from fivefold.models.init import build_model
from fivefold.models.presets import preset

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_fused_path_is_bit_equal_to_the_chunked_path(monkeypatch, dtype, chunks):
    """On a CPU the fused path's kernel is the chunked path's own arithmetic (`_rows_loss`
    on an fp32 copy), and with the same rows per chunk every GEMM and sum is the same: loss
    and every gradient of a Llama (nano: vocabulary 64, hidden 32; 30 tokens, ignored
    targets included) equal bit for bit. 3 chunks: the weight's gradient accumulates over
    chunks (fp32 addmm in fp32, bf16 parts added into fp32 in bf16)."""
    rows = -(-30 // chunks)
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_ELEMENTS", rows * 64)
    cfg = preset("nano")
    model = build_model(cfg, seed=3, dtype=dtype)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (3, 10))
    targets = torch.randint(0, cfg.vocab_size, (3, 10))
    targets[1, 4:] = -100

    def run(fused: bool):
        model.zero_grad()
        with monkeypatch.context() as m:
            if fused:  # the GPU path on CPU tensors, chunked by a device memory of `rows`
                m.setattr(loss_module, "fused_path", lambda *a: True)
                m.setattr(loss_module, "device_memory",
                          lambda d: rows * 64 * dtype.itemsize * loss_chunks.DEVICE_MEMORY_SHARE)
            loss = model(tokens, targets)
            loss.backward()
            with torch.no_grad():
                evaluated = model(tokens, targets)
        return loss.detach(), evaluated, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_c, eval_c, grads_c = run(False)
    loss_f, eval_f, grads_f = run(True)
    assert torch.equal(loss_f, loss_c)
    assert torch.equal(eval_f, eval_c)
    for name in grads_c:
        assert torch.equal(grads_f[name], grads_c[name]), name


def test_chunk_rows_follow_the_device_memory():
    """A CPU's chunk is fixed (2^24 logits); a GPU's is 1/32 of its memory in compute-dtype
    logits: at 8192 tokens and Llama 3's 128,256 vocabulary one chunk on an 80 GiB card,
    three on a 24 GiB one, 64 on a CPU."""
    v = 128256
    assert loss_chunks.num_chunks(8192, v) == 64
    assert loss_chunks.num_chunks(8192, v, 80 * 2**30, 2) == 1
    assert loss_chunks.num_chunks(8192, v, 24 * 2**30, 2) == 3
    assert loss_chunks.chunk_rows(8192, v) == loss_module.chunk_rows(8192, v)


KERNEL_CHECK = textwrap.dedent("""
    import json, sys, torch
    from fivefold.models import loss_kernel as K
    out = {}
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        rows, vocab, num_valid, start = 6, 300, 290, 5
        logits = (torch.randn(rows, vocab) * 3).to(dtype)
        targets = torch.randint(start, start + num_valid, (rows,))
        targets[1] = -100      # ignored
        targets[2] = 2         # another rank's word (below vocab_start)
        ref = logits.clone()
        ref_loss = K._reference(ref, targets, start, num_valid, True)
        got = logits.clone()
        got_loss = K._launch(got, targets, start, num_valid, True, block=64)
        nograd = logits.clone()
        K._launch(nograd, targets, start, num_valid, False, block=64)
        out[str(dtype)] = {
            "loss": float((got_loss - ref_loss).abs().max() / ref_loss.abs().max()),
            "grad": float((got.float() - ref.float()).abs().max()),
            "padding_zero": bool((got[:, num_valid:] == 0).all()),
            "untouched_without_grads": bool(torch.equal(nograd, logits))}
    print(json.dumps(out))
""")


def test_triton_kernel_in_the_interpreter():
    """The Triton kernel under TRITON_INTERPRET=1 (fp32 and fp16; bf16 is broken in the
    interpreter) against the reference: 6 rows of 300 logits, 10 of them padding, a
    vocabulary slice starting at 5, an ignored target and one outside the slice, in blocks
    of 64 so the online max and sum cross five blocks. Error model: the kernel sums the
    exponentials in another order (online rescaling), so the loss is within a few fp32 ulps
    of the row's log-sum (1e-6 relative); a gradient element is written in the logits'
    dtype, so within one rounding of it (fp32: 1e-6 of 1; fp16: 2^-11 of a value below 1)."""
    result = run_interpreted(["-c", KERNEL_CHECK], timeout=300)
    bounds = {"torch.float32": 1e-6, "torch.float16": 2.0**-11}
    for dtype, r in result.items():
        assert r["loss"] <= 1e-6, (dtype, r)
        assert r["grad"] <= bounds[dtype], (dtype, r)
        assert r["padding_zero"] and r["untouched_without_grads"], (dtype, r)


BLOCKS_8B = ["--model.preset", "llama-3.1-8b", "--model.num_layers", "2", "--data.tokenizer",
             "byte", "--train.seq_len", "8192", "--train.gbs", "1", "--parallel.mbs", "1"]


def ideal_loss_bytes(tokens: int, hidden: int, vocab: int, b: int = 2) -> int:
    """The head + loss's least traffic with the logits in HBM: three GEMMs each reading its
    operands and writing its result once (logits = x·Wᵀ; grad_x = g·W; grad_W = gᵀ·x), and
    one read and one write of the logits between them (loss and gradient in place)."""
    x, w, logits = tokens * hidden * b, vocab * hidden * b, tokens * vocab * b
    return (x + w + logits) + 2 * logits + (logits + w + x) + (logits + x + w)


def test_loss_traffic_on_the_8b_blocks_is_within_1_5x_of_the_ideal(monkeypatch):
    """The trace of the 8B-shaped 2-block step at 8192 tokens (bf16, an H100): the head and
    loss's bytes within 1.5x the ideal (13.9 GB), in a handful of kernels. The chunked path
    of rev 05aa091 moved 607 GB there in 1,922 kernels (64 chunks of 130 rows); at rev
    24463d9 it also launched 31,563 adds: this budget fails on either."""
    from fivefold.trace import trace_step

    trace = trace_step(list(BLOCKS_8B), gpu="h100", planner=False)
    loss = trace.part("loss")
    ideal = ideal_loss_bytes(8192, 4096, 128256)
    assert loss.bytes <= 1.5 * ideal, (loss.bytes / 1e9, ideal / 1e9)
    assert loss.kernels <= 8, loss.ops
    monkeypatch.setattr(loss_module, "FUSED_ON_DEVICE", False)
    before = trace_step(list(BLOCKS_8B), gpu="h100", planner=False).part("loss")
    assert before.bytes > 20 * ideal and before.kernels > 1000  # the budget can fail


def test_loss_kernels_grow_with_chunks_only():
    """On a GPU with less memory the fused loss takes more chunks: five kernels each (the
    logits' GEMM, the kernel, two gradient GEMMs, the weight gradient's add) and a fixed
    few, whatever the number of tokens per chunk."""
    from fivefold.trace import trace_step

    small = trace_step([*BLOCKS_8B, "--model.num_layers", "1"], gpu="h100", planner=False)
    chunks = loss_chunks.num_chunks(8192, 128256, 4 * 2**30, 2)
    assert chunks == 16
    import fivefold.trace.step as step_mod

    real = step_mod.device_for

    def small_gpu(gpu, *a, **k):
        dev, hw, assume = real(gpu, *a, **k)
        import dataclasses
        return dataclasses.replace(dev, memory_gib=4.0), hw, assume

    step_mod.device_for = small_gpu
    try:
        many = trace_step([*BLOCKS_8B, "--model.num_layers", "1"], gpu="h100", planner=False)
    finally:
        step_mod.device_for = real
    assert small.part("loss").kernels <= 8
    assert many.part("loss").kernels <= 5 * chunks + 8, many.part("loss").ops
