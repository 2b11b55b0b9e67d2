"""`fivefold trace`: the counts of known ops, where backward ops go, syncs, the roofline, the
CLI's bad inputs, and the loss's kernels not growing with the weight (the 31k adds)."""

import json

import pytest
import torch

from fivefold.cli import main
from fivefold.trace import device_for, simulate, trace_callable, trace_step
from fivefold.trace.roofline import kernel_seconds

# One block of the tiny model, the byte tokenizer; a trace of it takes ~1 s.
TINY = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--model.num_layers", "1",
        "--train.seq_len", "64", "--train.gbs", "2", "--parallel.mbs", "1"]


def _linear_step(tokens=128, d_in=64, d_out=32, dtype=torch.bfloat16):
    lin = torch.nn.Linear(d_in, d_out, bias=False, device="meta", dtype=dtype)
    x = torch.empty(tokens, d_in, device="meta", dtype=dtype, requires_grad=True)
    g = torch.empty(tokens, d_out, device="meta", dtype=dtype)

    def step():
        lin(x).backward(g)
    return step, lin


def test_one_linear_forward_backward_is_three_gemms():
    step, lin = _linear_step()
    t = trace_callable(step, modules=[("proj", lin)], gpu=None)
    # y = x W^T; dx = g W; dW = g^T x: three mm, the transposes are views
    assert t.kernels == 3 and dict(t.ops) == {"aten.mm": 3}
    assert t.flops == 3 * 2 * 128 * 64 * 32
    assert t.syncs == 0
    fwd = next(e for e in t.events if e.kind == "kernel")
    assert (fwd.bytes_read, fwd.bytes_written) == ((128 * 64 + 32 * 64) * 2, 128 * 32 * 2)
    assert fwd.dtype == "bf16"
    # backward ops belong to the module whose backward they are
    assert set(t.parts) == {"proj"} and t.part("proj").kernels == 3


def test_fp8_linear_is_traceable():
    """The FP8 budgets' entry: one FP8 linear, forward + backward, on the GPU's GEMM
    (blockwise recipe with kernel scaled_mm): its three GEMMs are FP8 FLOPs, no sync."""
    import dataclasses

    from fivefold.lowp.linear import FP8Recipe, fp8_linear

    tokens, k, n = 256, 128, 256
    recipe = dataclasses.replace(FP8Recipe.from_name("blockwise"), kernel="scaled_mm")
    x = torch.empty(tokens, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(n, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(tokens, n, device="meta", dtype=torch.bfloat16)
    t = trace_callable(lambda: fp8_linear(x, w, None, recipe).backward(g), gpu="h100")
    gemms = [e for e in t.events if e.kind == "kernel" and "_scaled_mm" in e.name]
    assert len(gemms) == 3 and {e.dtype for e in gemms} == {"fp8"}
    assert t.flops == sum(e.flops for e in gemms) == 3 * 2 * tokens * k * n
    assert t.syncs == 0 and t.kernels > 3  # the casts and scales around them


@pytest.mark.parametrize("gpu,gemm", [("h100", "fivefold.fp8_blockwise_scaled_mm"),
                                      ("b200", "fivefold.fp8_blockwise_emulated_mm")])
def test_fp8_step_takes_the_gpus_blockwise_kernel(gpu, gemm):
    """An sm90 GPU runs blockwise FP8 on cuBLASLt's `_scaled_mm`; a B200 (10.0) the
    emulated GEMMs, as the engine's kernel_support decides on each."""
    t = trace_step(["--model.preset", "llama-3.1-8b", "--model.num_layers", "1",
                    "--data.tokenizer", "byte", "--train.seq_len", "128", "--train.gbs", "1",
                    "--parallel.mbs", "1", "--train.precision", "fp8"], gpu=gpu, steps=1,
                   planner=False)
    mlp = t.part("layers.0.mlp").ops
    assert mlp[gemm] >= 9  # gate, up, down: forward and two backward GEMMs each
    scaled = [op for op in mlp if "_scaled_mm" in op]
    assert (scaled and "aten.mm" not in mlp) if gpu == "h100" else not scaled


def test_a_gather_reads_the_rows_it_picks():
    """An embedding's forward reads the rows its ids pick (and the ids), not the table:
    8 ids of a 1,000-row table read 8 rows."""
    emb = torch.nn.Embedding(1000, 64, device="meta", dtype=torch.bfloat16)
    ids = torch.zeros(8, dtype=torch.long, device="meta")
    t = trace_callable(lambda: emb(ids), gpu=None)
    (e,) = [e for e in t.events if e.kind == "kernel"]
    assert e.bytes_written == 8 * 64 * 2
    assert e.bytes_read == 8 * 64 * 2 + 8 * 8  # rows + int64 ids


def test_gemm_roofline_on_h100():
    tokens, d = 8192, 4096
    step, _ = _linear_step(tokens, d, d)
    t = trace_callable(step, gpu="h100")
    dev, hw, assume = device_for("h100")
    fwd = next(e for e in t.events if e.kind == "kernel")
    flops, nbytes = 2 * tokens * d * d, (2 * tokens * d + d * d) * 2
    assert (fwd.flops, fwd.bytes_read + fwd.bytes_written) == (flops, nbytes)
    compute = flops / (hw.bf16_tflops * 1e12 * hw.matmul_efficiency)
    memory = nbytes / (hw.hbm_tbps * 1e12 * assume.hbm_efficiency)
    assert compute > memory  # a large GEMM is compute-bound
    assert kernel_seconds(fwd, dev) == pytest.approx(compute, rel=1e-12)
    assert t.timeline.bound == "device"
    first = next(i for i, e in enumerate(t.events) if e.kind == "kernel")
    start = sum(dev.view_s for e in t.events[:first] if e.kind in ("view", "host"))
    assert t.timeline.step_s == pytest.approx(start + dev.launch_s + 3 * compute, rel=1e-9)


def test_syncs_and_host_work():
    x = torch.empty(1000, device="meta")
    t = trace_callable(lambda: (x.sum().item(), x.cpu(), torch.nonzero(x > 0),
                                torch.ones(3).sum().item()), gpu=None)
    assert t.syncs_by_kind() == {"item": 1, "d2h": 1, "h2d": 0, "dynamic_shape": 1}
    # the host's own tensors are host work: no kernel, no sync
    assert sum(e.kind == "host" for e in t.events) >= 2
    assert dict(t.ops) == {"aten.sum": 1, "aten._to_copy": 1, "aten.gt": 1, "aten.nonzero": 1}


def test_item_gives_a_clean_step():
    x = torch.empty(8, device="meta")
    seen = {}

    def step():
        seen["finite"] = bool(torch.isfinite(x.norm()))
        seen["nan"] = bool(torch.isnan(x).any())
        seen["loss"] = float(x.sum())
    trace_callable(step, gpu=None)
    assert seen == {"finite": True, "nan": False, "loss": 1.0}


def test_view_ops_and_noop_copies_are_no_kernels():
    w = torch.empty(64, 16, device="meta")
    part = torch.empty(64, 16, device="meta", dtype=torch.bfloat16)

    def step():
        for i in range(0, 64, 16):  # the loop of the 31k adds, 4 blocks
            w[i:i + 16] += part[i:i + 16]
        w.view(-1).view(16, 64).t()
    t = trace_callable(step, gpu=None)
    assert dict(t.ops) == {"aten.add_": 4}
    assert sum(e.name.startswith("aten.copy_") for e in t.events) == 4  # each a no-op


def test_step_parts_forward_and_backward():
    t = trace_step(TINY, steps=1, planner=False)
    mb = 2  # micro-batches: gbs 2, mbs 1
    # q, k, v, o: forward 4 GEMMs, backward 8; gate, up, down: 3 and 6
    assert t.part("layers.0.attention").ops["aten.mm"] == 12 * mb
    assert t.part("layers.0.mlp").ops["aten.mm"] == 9 * mb
    attn = t.part("layers.0.attention").ops
    assert attn["aten._scaled_dot_product_flash_attention"] == mb  # the GPU's kernel, bf16
    assert attn["aten._scaled_dot_product_flash_attention_backward"] == mb
    assert t.part("embedding").ops["aten.embedding_dense_backward"] == mb
    assert t.part("optimizer").ops["fivefold.adamw_mixed_"] >= 1  # one pass, as on CUDA
    assert t.part("loss").kernels > 0 and t.part("layers.0.norms").kernels > 0
    assert t.matching("layers.0").kernels == sum(
        p.kernels for n, p in t.parts.items() if n.startswith("layers.0"))
    assert t.kernels == sum(1 for e in t.events if e.kind == "kernel")


def test_kernels_per_layer_budget():
    """Eager, on the GPU's paths, one block is 41 kernels per micro-batch, forward +
    backward; every block the same. The budget per part (each a ceiling the engine holds):
    attention 18 = 12 GEMMs (q, k, v, o: 4 forward, 8 backward) + flash forward and
    backward + RoPE of q and k, one kernel each way (models/block_kernels.py) + 2 adds of the
    input's gradient; MLP 15 = 9 GEMMs + SiLU and its backward + 3 products + 1 add; norms
    6 = one kernel each way for each of the two (models/block_kernels.py) + the residual
    gradient's 2 adds; the block's 2 residual adds. Written in torch ops the norms were 50
    (25 each: fp32 casts, pow, mean, rsqrt, scale, backward's reductions) and RoPE 20: 105 a
    block. Compiled, the same block is 12 fused kernels beside its 23 library calls
    (tests/test_speed_paths.py)."""
    t = trace_step([*TINY[:-6], "--model.num_layers", "2", "--train.seq_len", "64",
                    "--train.gbs", "1", "--parallel.mbs", "1"], steps=1, planner=False)
    budget = {"attention": 18, "mlp": 15, "norms": 6, "": 2}
    for layer in (0, 1):
        for part, most in budget.items():
            name = f"layers.{layer}" + (f".{part}" if part else "")
            assert 0 < t.part(name).kernels <= most, (name, t.part(name).kernels)
        assert t.matching(f"layers.{layer}").kernels <= sum(budget.values()) == 41
    assert t.part("layers.0.attention").ops["aten.mm"] == 12  # nothing lost to the budget


def test_moe_step_traces_without_syncs():
    """Routing counts tokens per expert at a fixed length (models/moe.py `expert_counts`;
    `bincount`, whose length depends on the data, was a sync on a GPU and the experts'
    part's one sync); the step runs on meta, and the grouped experts wait on nothing."""
    t = trace_step(["--model.preset", "tiny-moe", "--model.num_layers", "1",
                    "--train.seq_len", "32", "--train.gbs", "1", "--parallel.mbs", "1"],
                   steps=1, planner=False)
    mlp = t.part("layers.0.mlp")
    assert mlp.ops["aten._grouped_mm"] > 0 or mlp.ops["aten.mm"] > 0
    assert mlp.syncs == 0, mlp.sync_ops


def test_loss_kernels_do_not_grow_with_the_weight():
    """The 31,563 adds of rev 24463d9: grad_W was added a 2^20-element block at a time,
    V·h/2^20 launches per token chunk after the first. The loss's kernels must not depend on
    the hidden size. (At 24463d9, 512 tokens are 4 chunks of a 128k vocabulary, and this
    counts 8 and 63 adds per later chunk and micro-batch: 616 loss kernels against 286.)"""
    counts = []
    for hidden in (64, 512):  # a 128k vocabulary: W of 8.2M and 65.7M elements
        t = trace_step([*TINY, "--model.vocab_size", "128256", "--model.hidden_size",
                        str(hidden), "--model.intermediate_size", "128", "--train.seq_len",
                        "512"], steps=1, planner=False)
        counts.append(t.part("loss").kernels)
    assert counts[0] == counts[1] > 0


def run_cli(args, capsys):
    code = main(["trace", *args])
    return code, capsys.readouterr()


@pytest.mark.parametrize("args,words", [
    (["--gpu", "h900"], "unknown GPU 'h900'"),
    (["--parallel.dp", "2"], "trace covers one rank"),
    (["--train.compile", "true"], "train.compile"),
    (["--model.preset", "llama-3.1-8b", "--train.seq_len", "8192", "--data.tokenizer", "byte",
      "--parallel.mbs", "1", "--train.gbs", "1", "--gpu", "l40s"], "does not fit one l40s"),
    (["--steps", "0"], "--steps"),
])
def test_cli_bad_input(args, words, capsys):
    code, out = run_cli(args, capsys)
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("error:")
    assert out.out == ""


def test_cli_table_and_json(tmp_path, capsys):
    path = tmp_path / "t.json"
    code, out = run_cli([*TINY, "--json", str(path)], capsys)
    assert code == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "trace" and record["gpu"] == "h100-sxm"
    totals = record["totals"]
    assert totals["kernels"] == sum(p["kernels"] for p in record["parts"].values())
    assert f"{totals['kernels']:,}" in out.out.split("total")[1].splitlines()[0]
    assert record["planner"]["step_time_s"] > 0 and record["time"]["step_s"] > 0
    assert "step 2/2" in out.err  # progress


def test_host_bound_step():
    x = torch.empty(16, device="meta")

    def step():
        for _ in range(100):
            x.add_(1)
    t = trace_callable(step, gpu="h100")
    dev, _, _ = device_for("h100")
    assert t.timeline.bound == "host"
    assert t.timeline.step_s == pytest.approx(100 * dev.launch_s, rel=1e-6)
    assert simulate(t.events, dev).step_s == t.timeline.step_s
