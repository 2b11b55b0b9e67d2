"""RMSNorm and RoPE as one kernel each way on a GPU (models/block_kernels.py): the Triton
kernels under the interpreter against the torch arithmetic they replace, and the trace of a
step taking them (a layer's norms 50 kernels -> 6, its RoPE 20 -> 2)."""

import textwrap

import torch
from common import run_interpreted

from fivefold.models import block_kernels

KERNEL_CHECK = textwrap.dedent("""
    import json, torch
    from fivefold.models import block_kernels as K
    torch.manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.float16):
        r = {}
        # rows past 512 give each backward program two rows, the last program one live row
        for rows, dim in ((5, 48), (1025, 40)):
            x = (torch.randn(rows, dim) * 2).to(dtype)
            w = (1 + 0.1 * torch.randn(dim)).to(dtype)
            g = torch.randn(rows, dim).to(dtype)
            y, rstd = K.rms_norm_forward(x, w, 1e-5)
            y_ref, rstd_ref = K.rms_norm_reference_forward(x, w, 1e-5)
            dx, dw = K.rms_norm_backward(g, x, w, rstd_ref)
            dx_ref, dw_ref = K.rms_norm_reference_backward(g, x, w, rstd_ref)
            rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())
            r[f"{rows}x{dim}"] = {"rstd": rel(rstd, rstd_ref), "y": rel(y, y_ref),
                                  "dx": rel(dx, dx_ref), "dw": rel(dw, dw_ref),
                                  "dtypes": [str(t.dtype) for t in (y, rstd, dx, dw)]}
        b, s, hq, hk, d = 2, 5, 4, 2, 8
        q, k = torch.randn(b, s, hq, d).to(dtype), torch.randn(b, s, hk, d).to(dtype)
        pos = torch.arange(s).float()[:, None] * (1 / 10000 ** (torch.arange(0, d, 2) / d))
        emb = torch.cat((pos, pos), -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        qo, ko = K.rope_forward(q, k, cos, sin)
        gq, gk = K.rope_backward(q, k, cos, sin)  # any gradient: q and k again
        r["rope"] = {
            "forward_equal": torch.equal(qo, K._rope_reference(q, cos, sin, False)) and
                             torch.equal(ko, K._rope_reference(k, cos, sin, False)),
            "backward_equal": torch.equal(gq, K._rope_reference(q, cos, sin, True)) and
                              torch.equal(gk, K._rope_reference(k, cos, sin, True))}
        out[str(dtype)] = r
    print(json.dumps(out))
""")


def test_kernels_in_the_interpreter():
    """Under TRITON_INTERPRET=1 (fp32 and fp16; bf16 is broken in the interpreter). Error
    model: the kernel sums a row's squares in its own order, so rstd is within a few fp32
    ulps of torch's (2e-7 relative at these widths, bound 1e-6); y and dx follow it (fp32:
    1e-6 of the largest value, dx's row sum of 48 products 4e-6; fp16: one rounding of the
    result, 2^-10 of the largest); dw adds up to 1,025 rows in another order (fp32 1e-5;
    fp16: one rounding, 2^-10). RoPE's products are rounded as torch's three ops round them:
    bit-equal in both dtypes, forward and backward."""
    result = run_interpreted(["-c", KERNEL_CHECK], timeout=300)
    for dtype, r in result.items():
        fp32 = dtype == "torch.float32"
        assert r["rope"] == {"forward_equal": True, "backward_equal": True}, (dtype, r)
        for shape, e in ((k, v) for k, v in r.items() if k != "rope"):
            assert e["rstd"] <= 1e-6, (dtype, shape, e)
            assert e["y"] <= (1e-6 if fp32 else 2.0**-10), (dtype, shape, e)
            assert e["dx"] <= (4e-6 if fp32 else 2.0**-10), (dtype, shape, e)
            assert e["dw"] <= (1e-5 if fp32 else 2.0**-10), (dtype, shape, e)
            assert e["dtypes"] == [dtype, "torch.float32", dtype, dtype], (dtype, shape, e)


def test_the_cpu_keeps_its_own_arithmetic():
    """A CPU never takes the kernels: its results stay bit for bit what they were."""
    x = torch.randn(3, 8)
    assert not block_kernels.fused_path(x)
    assert not block_kernels.rope_fused_path(torch.randn(1, 3, 2, 8), torch.randn(3, 8))


def test_a_step_traces_one_op_each_way():
    """On the GPU's paths (the meta device) a layer's two norms are 2 + 2 ops (and the
    residual gradient's 2 adds), its RoPE one op each way; the bytes of a norm are what
    one pass moves: forward x in, y out (and one fp32 statistic a row), backward grad and x in,
    dx out."""
    from fivefold.trace import trace_step

    tokens, hidden = 64, 128  # tiny's width
    t = trace_step(["--model.preset", "tiny", "--data.tokenizer", "byte", "--model.num_layers",
                    "1", "--train.seq_len", str(tokens), "--train.gbs", "1", "--parallel.mbs",
                    "1"], steps=1, planner=False)
    norms = t.part("layers.0.norms")
    assert norms.ops["fivefold.rms_norm_forward"] == norms.ops["fivefold.rms_norm_backward"] == 2
    attn = t.part("layers.0.attention").ops
    assert attn["fivefold.rope_forward"] == attn["fivefold.rope_backward"] == 1
    assert not any(k in attn for k in ("aten.neg", "aten.cat"))
    act = tokens * hidden * 2  # bf16 activations
    # per norm: forward 2 passes, backward 3; each residual-gradient add reads 2 and writes 1
    passes = 2 * (2 + 3) + 2 * 3
    moved = norms.bytes_read + norms.bytes_written
    assert passes * act <= moved <= passes * act * 1.05, (moved, passes * act)  # + w, rstd
