"""A float32 decode step of the fused forward (serve/fused.py) in as few host operations as
the arithmetic allows: the CPU path of `FusedLlama.layers_forward` when every row decodes.

On a narrow model each aten op costs the host a few microseconds whatever its size, and so
does each Python-level view. What the general loop rebuilds a layer, this one builds once a
step and reuses in all layers:

- **The norms.** `rms_norm` is one call but about a dozen aten ops on a CPU (pow, mean, add,
  rsqrt, two muls, casts). Here the residual stream carries one more column, constant
  c = √(n·ε) (n = hidden), which nothing writes: then ‖[h, c]‖₂ = √(Σh² + n·ε) = √n ·
  rms(h) in one `vector_norm` kernel, and the norm is `mul(h, √n·g, out=x).div_(r)`: three
  ops. The column is outside the GEMMs' views (they read and add into the first n columns).
- **Fixed buffers and their views.** The QKV, gate/up and activation GEMMs write into one
  buffer each (`out=`), so q (as (T, kv_heads, rep, d): the grouped-query view SDPA takes),
  the (2, T, kv_heads, d) pair of K and V (one `index_copy_` into the pool), the q/k heads
  RoPE turns and gate/up are views made once a step. Likewise each decode group's gathered
  blocks: one buffer, its keys and values (cut at the length, or masked) made once.
- **RoPE** is `x·cos + flip(x)·sin±` with the product added by `addcmul_` (one rounding
  fewer than mul then add: a difference of at most one ulp of each element).
- The index of each layer's blocks is a view of one (layers, rows) tensor made once a step.

Its results are `layers_forward`'s within the float32 error model: the norm rounds in another
order (a few ulps of each normalised element) and the FMA above; greedy tokens are the same
(tests/test_serve_fused.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fivefold.serve import paged_attention


def applies(fused, h: torch.Tensor, cache) -> bool:
    """Whether this step runs here: float32, every row a decode of a group whose rows are
    one run (a slice), the K/V in float32 (not FP8) on the CPU, and not the paged kernel's
    step (serve/fused.py takes it where the kernel is available)."""
    batch = cache.batch
    if h.dtype != torch.float32 or cache.fp8 or batch is None or batch.prefills or \
            not batch.decodes or not fused.same_ffn:
        return False
    if cache.k.dtype != torch.float32 or cache.k.device.type != "cpu":
        return False
    bs = cache.block_size
    if paged_attention.available(cache.k.device) and bs & (bs - 1) == 0:
        return False  # the paged kernel's path (Triton's interpreter on a CPU)
    groups = batch.decodes
    return all(g.span is not None for g in groups) and \
        sum(g.span[1] - g.span[0] for g in groups) == h.shape[0]


def norm_scales(fused) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's two norm weights times √hidden (made once: the norms' weights are
    fixed while the engine serves, as the fused GEMM weights are)."""
    root = math.sqrt(fused.cfg.hidden_size)
    return [(layer.norm1 * root, layer.norm2 * root) for layer in fused.layers]


class _Group:
    __slots__ = ("buf", "index", "q", "kb", "vb", "bias", "out")


def decode_layers(fused, h: torch.Tensor, positions: torch.Tensor, cache, first: int,
                  end: int) -> torch.Tensor:
    """Layers first..end-1 of a decode step on h (T, hidden); returns the result, a view."""
    T, n = h.shape
    H, KV, d = fused.heads, fused.kv_heads, fused.head_dim
    rep, half, W = H // KV, d // 2, (H + 2 * KV) * d
    ffn = fused.layers[first].ffn
    cos, sin = fused._rope_tables(positions, h.dtype)
    # the residual stream and its constant column (module docstring)
    hx = torch.cat((h, fused.norm_column.expand(T, 1)), 1)
    hv = hx.narrow(1, 0, n)
    x = h.new_empty(T, n)
    qkv = h.new_empty(T, W)
    base = qkv.storage_offset()
    qk = qkv.as_strided((T, H + KV, d), (W, d, 1), base)
    qk4 = qkv.as_strided((T, H + KV, 2, half), (W, d, half, 1), base)
    kv = qkv.as_strided((2, T, KV, d), (KV * d, W, d, 1), base + H * d)
    # rotate_half without its signs (they are in sin±): the halves swapped by two copies
    rot = h.new_empty(T, H + KV, d)
    swaps = ((rot[..., :half], qk4.select(2, 1)), (rot[..., half:], qk4.select(2, 0)))
    gate_up = h.new_empty(T, 2 * ffn)
    gate, up = gate_up.chunk(2, 1)
    act = h.new_empty(T, ffn)
    batch = cache.batch
    slots, kv_layers, bs = batch.slot_mapping, cache.kv_layers, cache.block_size
    rows, offsets = cache.block_rows()
    groups = []
    single = len(batch.decodes) == 1
    attn = None if single else h.new_empty(T, H * d)
    for group in batch.decodes:
        g = _Group()
        lo, hi = group.span
        nb = group.tables.shape[1]
        g.index = (group.tables.view(1, 1, -1) + offsets).flatten(1).unbind(0)
        g.buf = rows.new_empty(2 * (hi - lo) * nb, rows.shape[1])
        kb, vb = g.buf.view(2, hi - lo, nb * bs, KV, d).unbind(0)
        kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)
        g.bias = cache.decode_bias(group, kb)
        if group.uniform:
            kb, vb = kb.narrow(2, 0, group.length), vb.narrow(2, 0, group.length)
        g.kb, g.vb = kb, vb
        g.q = qkv.as_strided((hi - lo, KV, rep, d), (W, rep * d, d, 1), base + lo * W)
        g.out = None if single else attn[lo:hi].view(hi - lo, KV, rep, d)
        groups.append(g)
    scales = fused.norm_scales
    vector_norm, mul, mm, index_select = torch.linalg.vector_norm, torch.mul, torch.mm, \
        torch.index_select
    sdpa, silu = F.scaled_dot_product_attention, torch._C._nn.silu
    for i in range(first, end):
        layer, j = fused.layers[i], i - first
        g1, g2 = scales[i]
        mul(hv, g1, out=x).div_(vector_norm(hx, 2, 1, True))
        if layer.qkv_b is None:
            mm(x, layer.qkv_t, out=qkv)
        else:
            torch.addmm(layer.qkv_b, x, layer.qkv_t, out=qkv)
        for dst, src in swaps:
            dst.copy_(src)
        qk.mul_(cos).addcmul_(rot, sin)
        kv_layers[j].index_copy_(1, slots, kv)
        for g in groups:
            index_select(rows, 0, g.index[j], out=g.buf)
            o = sdpa(g.q, g.kb, g.vb, attn_mask=g.bias)
            if single:
                attn = o.view(T, H * d)
            else:
                g.out.copy_(o)
        hv.addmm_(attn, layer.o_t)
        mul(hv, g2, out=x).div_(vector_norm(hx, 2, 1, True))
        mm(x, layer.gate_up_t, out=gate_up)
        silu(gate, out=act).mul_(up)
        hv.addmm_(act, layer.down_t)
    return hv
