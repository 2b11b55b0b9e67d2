"""A paged decode attention kernel (Triton): each query reads its keys and values through
its block table, with no gathered copy.

The gather + SDPA path (serve/kv_cache.py) first copies every decoding sequence's blocks,
padded to the longest, into one dense tensor per layer, then attends. This kernel does what
PagedAttention's decode kernel does (Kwon et al. 2023, section 4.1): one program per
(sequence, KV head) walks the sequence's blocks in order, block ids read from its table
row, and keeps a running softmax (the online softmax of Milakov & Gimelshein 2018: a
running maximum m, a running sum l, the output rescaled by exp(m_old - m_new) whenever m
grows), so keys past the sequence's length are never read and nothing is masked or
padded. The `rep` query heads that share a KV head are one program's rows, so each key
and value is loaded once for all of them.

Arithmetic in fp32 whatever the pool's dtype (fp32, fp16, bf16), the output in the query's
dtype. Tested against the gather + SDPA path under TRITON_INTERPRET=1 in fp32 and fp16 (the
interpreter runs bf16 wrongly, and that path is the GPU's to check). The engine uses it on
CUDA when triton imports (serve/fused.py), the gather + SDPA path elsewhere;
FIVEFOLD_PAGED_KERNEL=0 turns it off (a before/after switch for bench/gpu_serve.py).
"""

from __future__ import annotations

import functools
import os

import torch

triton = tl = None  # imported on first use (0.4 s), where the kernel can run


def _import_triton() -> bool:
    global triton, tl
    if triton is None:
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError:
            return False
        triton, tl = _triton, _tl
    return True


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: the device is CUDA, or TRITON_INTERPRET=1
    runs kernels on CPU tensors (tests), and triton imports."""
    if os.environ.get("FIVEFOLD_PAGED_KERNEL", "1") == "0":
        return False
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _import_triton()


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel; built on first use, once per mode (triton.jit reads
    TRITON_INTERPRET when it wraps the function)."""

    @triton.jit
    def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                            q_row, q_head, k_slot, k_head, table_row, out_row, out_head,
                            REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr,
                            D_P: tl.constexpr, BS: tl.constexpr):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.arange(0, REP_P)
        t = tl.arange(0, BS)
        d = tl.arange(0, D_P)
        r_ok = r < REP
        d_ok = d < D
        heads = kvh * REP + r
        q = tl.load(q_ptr + seq * q_row + heads[:, None] * q_head + d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        length = tl.load(lens_ptr + seq)
        m = tl.full((REP_P,), float("-inf"), tl.float32)
        l_sum = tl.zeros((REP_P,), tl.float32)
        acc = tl.zeros((REP_P, D_P), tl.float32)
        for j in range(0, tl.cdiv(length, BS)):
            block = tl.load(tables_ptr + seq * table_row + j).to(tl.int64)
            pos = j * BS + t
            t_ok = pos < length
            offs = (block * BS + t)[:, None] * k_slot + kvh * k_head + d[None, :]
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (REP_P, BS)
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / l_sum[:, None]
        tl.store(out_ptr + seq * out_row + heads[:, None] * out_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])

    return paged_decode_kernel


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence to its context in a paged pool.

    q (g, heads, d), any row stride, last dim contiguous; k_pool, v_pool (slots, kv_heads,
    d) of one layer (slot = block · block_size + offset); tables (g, nb) int block ids
    (entries past a sequence's blocks are not read); lens (g,) context lengths, the new
    token included (>= 1). Returns (g, heads, d) in q's dtype (into `out` if given)."""
    g, heads, d = q.shape
    kv_heads = k_pool.shape[1]
    rep = heads // kv_heads
    if out is None:
        out = torch.empty(g, heads, d, dtype=q.dtype, device=q.device)
    if g == 0:
        return out
    assert q.stride(2) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
    assert tables.stride(1) == 1 and out.stride(2) == 1
    if not _import_triton():
        raise RuntimeError("the paged decode kernel needs triton (pip install triton)")
    kernel = _kernel(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(g, kv_heads)](
        q, k_pool, v_pool, tables, lens, out, d ** -0.5,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), tables.stride(0),
        out.stride(0), out.stride(1),
        REP=rep, REP_P=triton.next_power_of_2(rep), D=d, D_P=triton.next_power_of_2(d),
        BS=block_size)
    return out


def paged_decode_reference(q, k_pool, v_pool, tables, lens, block_size):
    """The same attention by gathering each sequence's context and calling SDPA (the
    engine's path without the kernel), one sequence at a time."""
    g, heads, d = q.shape
    rep = heads // k_pool.shape[1]
    out = torch.empty_like(q)
    for i in range(g):
        n = int(lens[i])
        slots = torch.arange(n, device=q.device)
        slots = tables[i, slots // block_size].long() * block_size + slots % block_size
        k = k_pool[slots].transpose(0, 1).repeat_interleave(rep, 0)  # (heads, n, d)
        v = v_pool[slots].transpose(0, 1).repeat_interleave(rep, 0)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None].float(), k.float(), v.float())
        out[i] = o[:, 0].to(q.dtype)
    return out
