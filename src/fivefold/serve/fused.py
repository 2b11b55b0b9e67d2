"""The serving forward of a plain Llama with little host work: fused weights, no modules.

A decode step of a narrow model is all host work: each aten op costs a few microseconds to
dispatch whatever its size, and `nn.Module` calls add their own. `FusedLlama` runs the same
arithmetic as `Llama.forward` (models/llama.py) on the same weights with fewer ops a layer:

- q, k and v come from one GEMM, gate and up from another: the three (two) weight matrices
  become row blocks of one tensor, and the model's own linears keep *views* of those rows,
  so no weight is stored twice and the model stays usable (and exact) as it was;
- RMSNorm is one `rms_norm` call (fp32: bitwise the hand-written norm; the stats in fp32
  and the cast before the weight, as models/llama.py, otherwise);
- RoPE acts on q and k together, in place: `x·cos + rotate_half(x)·sin` as
  `x·cos + flip(x)·sin±` with sin± = (−sin, sin) on the two halves, which is the same
  product bit for bit (−(a·b) = (−a)·b in IEEE arithmetic);
- a step of decodes alone attends in one SDPA call a group on the (T, heads, d) rows as
  they leave the GEMM: a KV head's `rep` query heads are adjacent there, so the grouped
  queries are a view and the output is the o-projection's input without a copy; on CUDA
  with triton, the paged kernel (serve/paged_attention.py) instead reads K/V through the
  block tables, with no gathered copy. Any other step (prefills, FP8 caches) goes through
  `PagedKVCache.attend`, as the model does.

Which models: `fusable` says why not, or None: dense Llamas whose linears are exactly
`nn.Linear` (not LoRA-wrapped, quantised or prepacked), RMSNorm, SwiGLU, no q/k norm.
The engine uses it where it can and the model's own forward elsewhere (`fuse=False` turns
it off); the tests compare the greedy tokens of both with the dense path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models.llama import Llama, RMSNorm
from fivefold.models.mlp import MLP
from fivefold.serve import fused_decode, paged_attention

RMS_NORM = getattr(torch, "rms_norm", None)  # torch >= 2.4


def fusable(model: nn.Module) -> str | None:
    """None if `FusedLlama` can run this model, else why not."""
    if type(model) is not Llama:
        return f"{type(model).__name__} is not a plain Llama"
    if RMS_NORM is None:
        return "this torch has no rms_norm"
    cfg = model.cfg
    if cfg.norm != "rmsnorm" or cfg.mlp != "swiglu" or cfg.qk_norm:
        return "only RMSNorm, SwiGLU and no q/k norm are fused"
    for i, block in enumerate(model.layers):
        attn, mlp = block.self_attn, block.mlp
        if type(mlp) is not MLP:
            return f"layer {i}'s MLP is a {type(mlp).__name__}"
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
        if any(type(m) is not nn.Linear for m in linears):
            return f"layer {i} has linears that are not nn.Linear"
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None or \
                mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            return f"layer {i} has biases outside q, k, v"
        norms = (block.input_layernorm, block.post_attention_layernorm)
        if any(type(n) is not RMSNorm for n in norms):
            return f"layer {i}'s norms are not RMSNorm"
        if attn.num_heads != cfg.num_heads or attn.num_kv_heads != cfg.num_kv_heads:
            return f"layer {i} holds a share of the heads (tensor parallel)"
    if model.lm_head is not None and type(model.lm_head) is not nn.Linear:
        return "the head is not an nn.Linear"
    return None


def _fuse(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """One tensor holding the linears' weights (or biases) as row blocks; each linear's own
    parameter becomes a view of its block."""
    parts = [getattr(m, attr) for m in linears]
    if parts[0] is None:
        return None
    fused = torch.cat([p.detach() for p in parts])
    first = 0
    for m, p in zip(linears, parts, strict=True):
        getattr(m, attr).data = fused[first:first + p.shape[0]]
        first += p.shape[0]
    return fused


def _addmm_residual(h: torch.Tensor, a: torch.Tensor, w_t: torch.Tensor) -> None:
    h.addmm_(a, w_t)


def _add_residual(h: torch.Tensor, a: torch.Tensor, w_t: torch.Tensor) -> None:
    h.add_(a.mm(w_t))


class FusedLayer:
    __slots__ = ("qkv_w", "qkv_b", "o_w", "gate_up_w", "down_w", "norm1", "norm2", "ffn",
                 "qkv_t", "o_t", "gate_up_t", "down_t")

    def __init__(self, block):
        attn, mlp = block.self_attn, block.mlp
        self.qkv_w = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
        self.qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
        self.gate_up_w = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        self.o_w, self.down_w = attn.o_proj.weight, mlp.down_proj.weight
        self.norm1 = block.input_layernorm.weight
        self.norm2 = block.post_attention_layernorm.weight
        self.ffn = mlp.gate_proj.weight.shape[0]
        # (in, out) views for `mm`/`addmm`: what F.linear calls, without its dispatch and
        # transpose each call (a few microseconds a GEMM, four GEMMs a layer)
        self.qkv_t, self.o_t = self.qkv_w.t(), self.o_w.t()
        self.gate_up_t, self.down_t = self.gate_up_w.t(), self.down_w.t()


class FusedLlama:
    """Called as the model is by the serving runner: (tokens (1, T), cache=, positions=,
    logits_index=) -> logits (1, n, V)."""

    def __init__(self, model: Llama):
        why = fusable(model)
        if why is not None:
            raise ValueError(f"cannot fuse this model: {why}")
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, \
            cfg.dim_per_head
        self.eps = cfg.norm_eps
        self.layers = [FusedLayer(b) for b in model.layers]
        self.embed = model.embed_tokens.weight
        self.norm = model.norm.weight
        self.head = model.output_weight()
        self.inv_freq = model.rotary.inv_freq
        # the float32 decode step of serve/fused_decode.py (lean_decode False: this loop)
        self.lean_decode = True
        self.same_ffn = len({layer.ffn for layer in self.layers}) == 1
        self.norm_scales = fused_decode.norm_scales(self)
        self.norm_column = torch.full((1, 1), (cfg.hidden_size * self.eps) ** 0.5,
                                      dtype=torch.float32, device=self.embed.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return RMS_NORM(x, weight.shape, weight, self.eps)
        return RMS_NORM(x.float(), weight.shape, None, self.eps).to(x.dtype).mul_(weight)

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos (T, 1, d) and sin± (T, 1, d): (−sin, sin) on the halves (see the module's
        docstring); the same values as `Rotary` (models/llama.py) computes."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)
        s = freqs.sin()
        return cos[:, None], torch.cat((-s, s), dim=-1).to(dtype)[:, None]

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache=None, positions: torch.Tensor | None = None,
                 logits_index: torch.Tensor | None = None) -> torch.Tensor:
        h = self.layers_forward(self.embed_tokens(tokens), positions, cache, 0,
                                len(self.layers))
        return self.logits(h, logits_index)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """(1, T) ids -> (T, hidden): a fresh tensor, which the layers may update in place."""
        return F.embedding(tokens[0], self.embed)

    def logits(self, h: torch.Tensor, logits_index: torch.Tensor | None) -> torch.Tensor:
        if logits_index is not None:
            h = h.index_select(0, logits_index)
        return F.linear(self._norm(h, self.norm), self.head)[None]

    @torch.inference_mode()
    def layers_forward(self, h: torch.Tensor, positions: torch.Tensor, cache, first: int,
                       end: int, attend=None) -> torch.Tensor:
        """Layers first..end-1 on h (T, hidden), in place; the cache holds those layers'
        K/V as its layers 0, 1, ... (a pipeline stage's, serve/pp_worker.py). `attend`
        (layer, q, k, v) -> (T, heads · d): by default the step's (cache.batch). Returns
        the result: h itself, or (a float32 step of decodes, serve/fused_decode.py) a view
        of a new tensor."""
        if attend is None and self.lean_decode and fused_decode.applies(self, h, cache):
            return fused_decode.decode_layers(self, h, positions, cache, first, end)
        T = h.shape[0]
        cos, sin = self._rope_tables(positions, h.dtype)
        H, KV, d = self.heads, self.kv_heads, self.head_dim
        qk_end, sizes = (H + KV) * d, (H * d, KV * d, KV * d)
        attend = attend or self._attention_for(cache, T)
        half = d // 2
        # h += a · Wᵀ: in fp32 inside the GEMM (beta = 1, one op); in bf16/fp16 the product
        # rounded first, as the model's own forward does (addmm_ would round once)
        residual = _addmm_residual if h.dtype == torch.float32 else _add_residual
        for i in range(first, end):
            layer = self.layers[i]
            x = self._norm(h, layer.norm1)
            qkv = x.mm(layer.qkv_t) if layer.qkv_b is None else \
                torch.addmm(layer.qkv_b, x, layer.qkv_t)
            # views by one split each (a view op costs the host as much as a small kernel)
            q, k, v = qkv.split(sizes, 1)
            qk = qkv.narrow(1, 0, qk_end).view(T, H + KV, d)
            rot = qk.view(T, H + KV, 2, half).flip(2).view(T, H + KV, d).mul_(sin)
            qk.mul_(cos).add_(rot)
            residual(h, attend(i - first, q.view(T, H, d), k.view(T, KV, d),
                               v.view(T, KV, d)), layer.o_t)
            gate, up = self._norm(h, layer.norm2).mm(layer.gate_up_t).chunk(2, 1)
            residual(h, F.silu(gate).mul_(up), layer.down_t)
        return h

    def _attention_for(self, cache, T: int):
        """The attention of this step: the lean decode path where it applies (module's
        docstring), else the cache's general `attend`."""
        batch = cache.batch
        H, KV, d = self.heads, self.kv_heads, self.head_dim
        rep = H // KV
        groups = batch.decodes
        if cache.fp8 or batch.prefills or any(g.span is None for g in groups) or \
                sum(g.span[1] - g.span[0] for g in groups) != T:
            def general(layer, q, k, v):
                out = cache.attend(layer, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                   v.transpose(0, 1)[None])
                return out[0].transpose(0, 1).reshape(T, H * d)
            return general
        slots = batch.slot_mapping
        k_pool, v_pool = cache.k, cache.v
        bs = cache.block_size
        if paged_attention.available(k_pool.device) and bs & (bs - 1) == 0:
            def kernel(layer, q, k, v):  # the paged kernel reads K/V through the tables
                k_pool[layer].index_copy_(0, slots, k)
                v_pool[layer].index_copy_(0, slots, v)
                out = q.new_empty(T, H, d)
                for group in groups:
                    first, end = group.span
                    paged_attention.paged_decode(q[first:end], k_pool[layer], v_pool[layer],
                                                 group.tables, group.lens, bs, out[first:end])
                return out.view(T, H * d)
            return kernel
        rows, offsets = cache.block_rows()  # every block of K and V a row
        kv_layers = cache.kv_layers
        # each group: its rows, the rows of its K and V blocks in every layer (layers, 2 · n),
        # the gathered keys' shape
        plan = [(g.span[0], g.span[1], (g.tables.view(1, 1, -1) + offsets).flatten(1),
                 (2, g.tables.shape[0], g.tables.shape[1] * bs, KV, d), g) for g in groups]
        pair = (2, T, KV, d)

        def decode(layer, q, k, v):
            # k and v are adjacent columns of the QKV GEMM's rows: one (2, T, KV, d) view
            if v.storage_offset() - k.storage_offset() == KV * d and k.stride() == v.stride():
                kv_layers[layer].index_copy_(1, slots, k.as_strided(
                    pair, (KV * d, k.stride(0), d, 1)))
            else:
                k_pool[layer].index_copy_(0, slots, k)
                v_pool[layer].index_copy_(0, slots, v)
            out = None if len(plan) == 1 else q.new_empty(T, H * d)
            for first, end, index, shape, group in plan:
                # (g, kv_heads, L, d) views of the gathered blocks (PagedKVCache.gather_blocks)
                kb, vb = rows.index_select(0, index[layer]).view(shape).unbind(0)
                kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)
                bias = cache.decode_bias(group, kb)
                if group.uniform:
                    kb, vb = kb.narrow(2, 0, group.length), vb.narrow(2, 0, group.length)
                qd = (q if out is None else q[first:end]).view(end - first, KV, rep, d)
                o = F.scaled_dot_product_attention(qd, kb, vb, attn_mask=bias)
                if out is None:
                    return o.view(T, H * d)
                out[first:end] = o.view(end - first, H * d)
            return out
        return decode
