"""The ring's block kernels (parallel/context/kernels.py): the portable one (matmuls and the
log-sum-exp) against the fused CPU op it stands in for on other devices, block by block and
through the merge, and the whole ring on the portable kernel against float64 attention.

Tolerances: fp32 ≤ 1e-5 relative (‖a − b‖ / ‖b‖), bf16 ≤ 1e-2; against float64 math
attention ≤ 1e-5 (fp32 inputs). The CUDA flash path is not exercised here (no GPU).
"""

import math

import pytest
import torch
from harness import run_ranks

from fivefold import config
from fivefold.parallel.context import ContextAttentionCore, kernels, shard_sequence
from fivefold.parallel.context.attention import _Accumulator
from fivefold.parallel.mesh import ParallelDims


def rel(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def reference(q, k, v, causal=True):
    """Softmax attention in float64 (kv heads shared by their query group)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def tensors(dtype, heads=4, kv_heads=2, n=24, m=24, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, n, d, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, m, d, generator=gen).to(dtype)
    v = torch.randn(2, kv_heads, m, d, generator=gen).to(dtype)
    grad = torch.randn(2, heads, n, d, generator=gen).to(dtype)
    return q, k, v, grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["diagonal", "full"])
def test_portable_block_matches_the_fused_cpu_op(dtype, tol, causal):
    """One block, grouped-query heads (4 over 2): out, LSE and the backward's dQ/dK/dV."""
    q, k, v, grad = tensors(dtype)
    scale = q.shape[-1] ** -0.5
    fused = kernels.fused_cpu_forward(q, k, v, causal, scale)
    portable = kernels.portable_forward(q, k, v, causal, scale)
    assert portable[0].dtype == dtype and portable[1].dtype == torch.float32
    assert portable[1].shape == fused[1].shape == q.shape[:3]
    assert rel(portable[0], fused[0]) <= tol and rel(portable[1], fused[1]) <= tol
    out, lse = fused
    got = kernels.portable_backward(grad, q, k, v, out, lse, causal, scale)
    want = kernels.fused_cpu_backward(grad, q, k, v, out, lse, causal, scale)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel(a, b) <= tol, (name, rel(a, b))


@pytest.mark.parametrize("kernel", ["portable", "fused"])
def test_blocks_merged_by_their_lse_give_full_attention_and_its_gradient(kernel):
    """Keys cut in three blocks (a diagonal one and two full ones before it), outputs merged
    by LSE as the ring does, and each block's backward taken with the merged output and LSE:
    the sum is the full causal attention's gradient (fp32 against float64, ≤ 1e-5)."""
    forward, backward = kernels.IMPLEMENTATIONS[kernel]
    n = 8
    q, k, v, grad = tensors(torch.float32, n=n, m=3 * n)
    scale = q.shape[-1] ** -0.5
    # The queries are the last n positions of 3n: causal over all 3n keys.
    blocks = [(slice(0, n), False), (slice(n, 2 * n), False), (slice(2 * n, 3 * n), True)]
    acc = _Accumulator(q)
    for keys, causal in blocks:
        acc.add(slice(0, n), *forward(q, k[:, :, keys], v[:, :, keys], causal, scale))
    out = acc.out.to(q.dtype)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    scores = qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    mask = torch.ones(n, 3 * n, dtype=torch.bool).tril(2 * n)
    want = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vd.repeat_interleave(rep, 1)
    want.backward(grad.double())
    assert rel(out, want) <= 1e-5
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for keys, causal in blocks:
        g_q, g_k, g_v = backward(grad, q, k[:, :, keys], v[:, :, keys], out, acc.lse, causal,
                                 scale)
        dq += g_q
        dk[:, :, keys] += g_k
        dv[:, :, keys] += g_v
    for name, a, b in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dv, vd.grad)):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_kernel_choice():
    """auto takes the fused op on CPU; a named kernel is taken as named."""
    q = torch.zeros(1, 2, 4, 8)
    assert kernels.choose(q) == "fused"
    assert kernels.choose(q, "portable") == "portable"
    assert set(kernels.IMPLEMENTATIONS) == set(kernels.KERNELS) - {"auto"}


def portable_ring(rank, world):
    torch.manual_seed(0)
    seq, heads, kv_heads = 8 * world, 4, 2
    q = torch.randn(2, heads, seq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, heads, seq, 8, dtype=torch.float64)
    reference(q, k, v).backward(grad)
    want = reference(q, k, v).detach()
    dims = ParallelDims(cp=world, rank=rank)
    dims.build_groups()
    errors = {}
    for scheme in ("ring", "allgather"):
        for layout in ("zigzag", "contiguous"):

            def local(t, layout=layout):
                return shard_sequence(t.detach().transpose(1, 2), layout, world,
                                      rank).transpose(1, 2).float()

            ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
            out = ContextAttentionCore(dims["cp"], layout, scheme, kernel="portable")(ql, kl, vl)
            out.backward(local(grad))
            errors[(scheme, layout)] = {"out": rel(out, local(want)),
                                        "dq": rel(ql.grad, local(q.grad)),
                                        "dk": rel(kl.grad, local(k.grad)),
                                        "dv": rel(vl.grad, local(v.grad))}
    return errors


def test_the_ring_on_the_portable_kernel_matches_attention():
    """cp 2, ring and all-gather, zig-zag and contiguous: output and gradients of every
    rank's tokens against float64 attention of the whole sequence (≤ 1e-5)."""
    for rank, errors in enumerate(run_ranks(portable_ring, 2)):
        for case, errs in errors.items():
            for name, err in errs.items():
                assert err <= 1e-5, (rank, case, name, err)


def test_cp_on_cuda_is_no_longer_refused():
    """The layout checks accept cp > 1 with train.device = 'cuda' (they refused it while
    the block kernel was CPU-only)."""
    cfg = config.Config()
    cfg.model.preset = "tiny"
    cfg.parallel.cp, cfg.parallel.dp = 2, 1
    cfg.train.device, cfg.train.seq_len, cfg.train.gbs = "cuda", 128, 4
    assert config.engine_refusal(cfg) is None
