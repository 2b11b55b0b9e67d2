"""Paged K/V tensors and the attention that reads them through block tables.

Each layer's keys (and values) are one pool of `num_blocks · block_size` slots of
(kv_heads, head_dim); a token at position p of a sequence lives in slot
`block_table[p // block_size] · block_size + p % block_size` (PagedAttention, Kwon et al.
2023, section 4.1). A serving step runs the model once over a batch flattened into one row
(b = 1, one position per scheduled token) and hands it a `PagedBatch`: the slot of every new
token and, per sequence, the slots of its whole context.

`attend` (called by the model's attention, models/llama.py) first writes the step's keys and
values into their slots (all sequences, before any attention, so a sequence may read a
shared prefix block another sequence fills in the same step), then:

- decoding sequences (one new token each), in groups, one SDPA call a group: one
  `index_select` per pool gathers the group's block tables, padded to the longest with each
  sequence's own last block, and one SDPA call attends every sequence to its own keys,
  those past its length masked by an additive bias (0 or -inf, built once a step; when
  the lengths are equal the keys are cut there and nothing is masked). The `rep` query
  heads that share a KV head are folded into `rep` queries of that head, so the call needs
  no GQA support and no repeated K/V, and on CUDA in fp32 it can run the memory-efficient
  kernel, which takes a bias. On CUDA a group is every decoding sequence: a step launches a
  few kernels a layer, whatever the batch (one gather and one SDPA per sequence and layer
  was launch-bound on an H100: 197 ms a step for 16 sequences of a 30-layer model,
  bench/gpu_profile.py). On CPU a group holds as many sequences as keep its gathered K/V
  within about an L2 cache (`DECODE_GROUP_BYTES_CPU`), so SDPA reads them while they are
  still there: one padded call over every sequence gathers more than the caches hold, and
  made a decode step of llama-25m (8 KV heads) 1.2x slower than one call per sequence
  (bench/serve/serve.py --step-only). A long context goes alone, unpadded and unmasked (for a
  model without GQA, the dense cache's very call). Otherwise the result is not the dense
  cache's bit for bit: SDPA reduces over the padded length and the folded queries in
  another order, which moves the output by a few fp32 ulps (reordering a softmax-weighted
  sum of L values: ~sqrt(L)·u relative); the tests compare greedy tokens, on models whose
  choices are not near-ties. Keys past a sequence's length are read and masked: each
  one is a slot of the sequence's own last block (its tail, or that block again as padding),
  either its own token's or unwritten. An unwritten slot may hold anything (a reused
  block's stale K/V, a NaN a failed step left), and a mask does not stop a NaN: q · k with
  a NaN key is NaN before the bias adds -inf, and a masked value's weight 0 times NaN is
  NaN. So before the step the runner zeroes those tails in every layer (`clear_slots`: a
  few slots a sequence, once a step; the last block is the sequence's alone, since a write
  to a shared one copies it first), and nothing the pool held before can reach the output;
- each prefill (or prefill chunk) alone: a fresh prompt attends to its own new keys with the
  causal mask (the very call the dense cache makes); a chunk after a cached or computed
  prefix gathers its context and masks keys after each query's position.

Both are `scaled_dot_product_attention` with grouped-query heads shared, so the same code
runs on CPU and on CUDA (where SDPA picks its fused kernels); no custom kernel.

FP8 (`kv_cache_dtype=torch.float8_e4m3fn`, `--kv-cache-dtype fp8`): the pools hold one byte
an element, x / scale rounded to e4m3 (saturated at +-448), with one fp32 scale per layer and
KV head for keys and one for values; reads multiply back (vLLM's quantized KV cache, per-head
scales). Half the bytes of bf16, so twice the blocks in a budget. The scales are given
(calibrated: `KVScaleObserver` records each layer's and head's largest |k| and |v| over
sample text, scale = amax / 448), or set on the fly by the first step that writes a layer:
amax / 200 for keys and amax / 100 for values, vLLM's constants (K_SCALE_CONSTANT and
V_SCALE_CONSTANT in vllm/envs.py, `Attention.calc_kv_scales`), which leave 2.2x and 4.5x of
headroom for later tokens. A fresh prompt attends to its own keys and values as stored (the
rounded ones), so every attention reads what the cache holds, whatever the batching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fivefold.models.llama import SDPA_GQA

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value (OCP 8-bit floating point spec)
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0  # on-the-fly scale = amax / these (vLLM)
DECODE_GROUP_BYTES_CPU = 2**20  # gathered K/V per decode SDPA call on CPU (about an L2)


@dataclass
class Prefill:
    """A run of `end - begin` query tokens in the row, at positions start, start + 1, ...,
    whose context (positions 0 .. start + end - begin - 1) lies in the blocks
    `context_blocks`."""

    begin: int
    end: int
    start: int
    context_blocks: torch.Tensor | None  # None: no earlier tokens, attend to the new keys only


@dataclass
class DecodeGroup:
    """Decoding sequences that attend in one SDPA call."""

    rows: torch.Tensor  # (g,) their row positions
    span: tuple[int, int] | None  # (first, end) when those rows are one run: a slice
    lens: torch.Tensor  # (g,) their context lengths (the new token included)
    tables: torch.Tensor  # (g, nb) their block tables, padded with each one's last block
    length: int  # the longest context
    uniform: bool  # every length the same: keys cut at it, no mask
    bias: torch.Tensor | None = None  # (g, 1, 1, nb · block_size): 0 or -inf, set by layer 0


@dataclass
class PagedBatch:
    slot_mapping: torch.Tensor | None  # (T,) where each new token's K/V goes
    # the unwritten slots of masked decodes' last blocks, zeroed before the step (clear_slots)
    stale_slots: torch.Tensor | None = None
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[Prefill] = field(default_factory=list)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       element_size: int) -> int:
    """Keys and values of one token in every layer: 2 · layers · kv_heads · head_dim · bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def sdpa(q, k, v, mask=None, causal: bool = False):
    """SDPA with kv heads shared among query heads (repeated on torch < 2.5)."""
    rep = q.shape[1] // k.shape[1]
    kwargs = {}
    if rep > 1 and SDPA_GQA:
        kwargs["enable_gqa"] = True
    elif rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **kwargs)


class KVScaleObserver:
    """A stand-in cache for one plain forward that records, per layer and KV head, the
    largest |k| and |v| (after RoPE), and attends causally as the dense model does.
    `scales()` gives the calibrated FP8 scales (amax / 448)."""

    def __init__(self, num_layers: int, num_kv_heads: int):
        self.k_amax = torch.zeros(num_layers, num_kv_heads)
        self.v_amax = torch.zeros(num_layers, num_kv_heads)

    def attend(self, layer: int, q, k, v):
        for amax, x in ((self.k_amax, k), (self.v_amax, v)):  # x (b, kv_heads, T, d)
            amax[layer] = torch.maximum(amax[layer], x.detach().abs().amax((0, 2, 3)).float().cpu())
        return sdpa(q, k, v, causal=True)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_amax / FP8_MAX, self.v_amax / FP8_MAX


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device,
                 kv_cache_dtype: torch.dtype | None = None,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`dtype`: the model's; `kv_cache_dtype`: what the pools hold (default `dtype`;
        FP8 for the e4m3 cache); `kv_scales`: calibrated (k, v) scales (layers, kv_heads)."""
        store = kv_cache_dtype or dtype
        # one block past the pool in every layer: its first slot is where the padding rows
        # of a CUDA graph's fixed-size batch write their K/V (serve/cuda_graphs.py); not
        # part of the pool. Keys and values are one tensor (2, layers, slots, kv_heads, d),
        # so that a decode step's layer writes both with one index_copy_ and gathers the
        # blocks of both with one index_select (`block_rows`, serve/fused.py)
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.kv_ext = torch.zeros((2, *shape), dtype=store, device=device)
        self.k_ext, self.v_ext = self.kv_ext.unbind(0)
        self.kv_layers = self.kv_ext.unbind(1)  # each layer's (2, slots, kv_heads, d), made once
        self.trash_slot = num_blocks * block_size
        self.k, self.v = self.k_ext[:, :-block_size], self.v_ext[:, :-block_size]
        self.num_blocks, self.block_size = num_blocks, block_size
        # decoding sequences per SDPA call: on CPU as many as leave their gathered K/V in
        # the L2 cache, so SDPA reads it from there (contexts of 0.5 MiB and up go alone); on
        # CUDA all of them, since there the launches, not the reads, cost a step its time
        self.decode_group_bytes = DECODE_GROUP_BYTES_CPU if torch.device(device).type == \
            "cpu" else None
        self.bytes_per_token = 2 * num_kv_heads * head_dim * dtype.itemsize  # K and V, read
        self.batch: PagedBatch | None = None
        self.fp8 = store == FP8
        if self.fp8:  # 0: not set yet (on the fly, by the first write of the layer)
            # which layers' scales are set, kept on the host: no device sync per layer
            self.scale_set = {w: [kv_scales is not None] * num_layers for w in "kv"}
            self.k_scale = torch.zeros(num_layers, num_kv_heads, device=device)
            self.v_scale = torch.zeros(num_layers, num_kv_heads, device=device)
            if kv_scales is not None:
                self.k_scale.copy_(kv_scales[0].clamp_min(torch.finfo(torch.float32).tiny))
                self.v_scale.copy_(kv_scales[1].clamp_min(torch.finfo(torch.float32).tiny))
        elif kv_scales is not None:
            raise ValueError("kv_scales are for an FP8 KV cache")

    def block_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block of K and V as a row (2 · layers · (num_blocks + 1), block's elements)
        and the row offsets (layers, 2, 1) of each layer's K and V blocks: the rows of
        blocks `b` of layer l are `b + offsets[l]` (one index_select gathers both)."""
        if getattr(self, "_block_rows", None) is None:
            layers, per = self.kv_ext.shape[1], self.num_blocks + 1
            rows = self.kv_ext.view(2 * layers * per, -1)
            offsets = torch.arange(2 * layers, device=rows.device).view(2, layers).t() * per
            self._block_rows = rows, offsets[:, :, None].contiguous()
        return self._block_rows

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @staticmethod
    def blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int,
                          head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Whole blocks that fit in `budget_bytes` of K/V storage (the FP8 scales, 8 bytes a
        layer and head, are not counted, as the planner does not count them)."""
        element = dtype.itemsize
        per_block = block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, element)
        return int(budget_bytes // per_block)

    def decode_groups(self, lengths: list[int]) -> list[int]:
        """Split decoding sequences (in row order) into groups for one SDPA call each:
        the sizes, each group's padded K/V within `decode_group_bytes` (or one group)."""
        if self.decode_group_bytes is None:
            return [len(lengths)] if lengths else []
        sizes, longest = [], 0
        for length in lengths:
            longest = max(longest, length)
            if sizes and (sizes[-1] + 1) * longest * self.bytes_per_token <= \
                    self.decode_group_bytes:
                sizes[-1] += 1
            else:
                sizes.append(1)
                longest = length
        return sizes

    def block_slots(self, block_ids: list[int], num_tokens: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(num_tokens)]

    def _raw(self, pool: torch.Tensor) -> torch.Tensor:
        """The pool as stored; FP8 as bytes, since CPU kernels lack fp8 index_copy_."""
        return pool.view(torch.uint8) if self.fp8 else pool

    def _read(self, rows: torch.Tensor, scale: torch.Tensor | None, dtype) -> torch.Tensor:
        """Stored rows (..., kv_heads, d) in `dtype`; FP8 bytes times their head's scale."""
        if not self.fp8:
            return rows.to(dtype)
        return (rows.view(FP8).to(torch.float32) * scale[:, None]).to(dtype)

    def _write(self, layer: int, which: str, x: torch.Tensor, constant: float) -> torch.Tensor:
        """Store x (T, kv_heads, d) at the step's slots; returns x as stored (rounded)."""
        slots, pool = self.batch.slot_mapping, getattr(self, which)
        if not self.fp8:
            pool[layer].index_copy_(0, slots, x.to(pool.dtype))
            return x
        scale = getattr(self, f"{which}_scale")
        if not self.scale_set[which][layer]:  # on the fly: the layer's first write sets it
            self.scale_set[which][layer] = True
            scale[layer] = (x.detach().abs().amax((0, 2)).float() / constant).clamp_min(
                torch.finfo(torch.float32).tiny)
        s = scale[layer]
        q8 = (x.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        self._raw(pool)[layer].index_copy_(0, slots, q8.view(torch.uint8))
        return self._read(q8.view(torch.uint8), s, x.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at `slots` (..., L) -> (..., kv_heads, L, d), as read (FP8 times its scale)."""
        dtype = torch.float32 if self.fp8 else self.k.dtype
        return tuple(self._read(self._raw(pool)[layer][slots], self._scale(which, layer), dtype)
                     .transpose(-3, -2) for pool, which in ((self.k, "k"), (self.v, "v")))

    def gather_blocks(self, layer: int, tables: torch.Tensor, dtype) -> tuple[torch.Tensor, ...]:
        """K, V of whole blocks: tables (B, nb) -> (B, kv_heads, nb · block_size, d) in
        `dtype`. One index_select of block-sized rows copies ~4x faster than indexing slot by
        slot."""
        out = []
        for pool, scale in ((self.k, self._scale("k", layer)), (self.v, self._scale("v", layer))):
            raw = self._raw(pool)[layer]
            rows = raw.view(self.num_blocks, -1).index_select(0, tables.reshape(-1))
            rows = self._read(rows.view(-1, *raw.shape[1:]), scale, dtype)
            out.append(rows.view(tables.shape[0], -1, *raw.shape[1:]).transpose(1, 2))
        return tuple(out)

    def _scale(self, which: str, layer: int) -> torch.Tensor | None:
        return getattr(self, f"{which}_scale")[layer] if self.fp8 else None

    @torch.no_grad()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `dst` becomes a copy of block `src` in every layer."""
        bs = self.block_size
        k, v = self._raw(self.k), self._raw(self.v)
        for src, dst in copies:
            k[:, dst * bs:(dst + 1) * bs] = k[:, src * bs:(src + 1) * bs]
            v[:, dst * bs:(dst + 1) * bs] = v[:, src * bs:(src + 1) * bs]

    @torch.no_grad()
    def clear_slots(self, slots: torch.Tensor) -> None:
        """Zero `slots` in every layer: the unwritten tail of each masked decode's last block,
        which its padded table reads (see the module's docstring)."""
        for pool in (self.k, self.v):
            raw = self._raw(pool)
            raw.view(*raw.shape[:2], -1).index_fill_(1, slots, 0)

    @staticmethod
    def decode_bias(group: DecodeGroup, kb: torch.Tensor) -> torch.Tensor | None:
        """The additive mask (g, 1, 1, L) of a group's padded keys `kb` (g, kv_heads, L, d):
        None when the lengths are equal (the keys are cut instead); built by the first layer
        of a step, reused by the others."""
        if group.uniform:
            return None
        if group.bias is None or group.bias.dtype != kb.dtype:
            past = torch.arange(kb.shape[2], device=kb.device)[None, :] >= group.lens[:, None]
            bias = torch.zeros(past.shape, dtype=kb.dtype, device=kb.device)
            group.bias = bias.masked_fill_(past, float("-inf"))[:, None, None]
        return group.bias

    def _decode(self, layer: int, q: torch.Tensor, out: torch.Tensor,
                group: DecodeGroup) -> None:
        """A group of one-token sequences attends, each to its own context, in one call."""
        num_seqs, heads, d = group.tables.shape[0], q.shape[1], q.shape[3]
        kb, vb = self.gather_blocks(layer, group.tables, q.dtype)  # (g, kv_heads, L, d)
        self.decode_bias(group, kb)
        if group.uniform:  # every context as long: cut there, nothing to mask
            kb, vb = kb[:, :, :group.length], vb[:, :, :group.length]
        span = group.span
        rows = q[0, :, span[0]:span[1]] if span else q[0].index_select(1, group.rows)
        # query head h reads KV head h // rep: a KV head's rep query heads become rep queries
        qd = rows.transpose(0, 1).reshape(num_seqs, kb.shape[1], -1, d)
        o = F.scaled_dot_product_attention(qd, kb, vb, attn_mask=group.bias)
        o = o.reshape(num_seqs, heads, d).transpose(0, 1)  # (heads, g, d)
        if span:
            out[0, :, span[0]:span[1]] = o
        else:
            out[0].index_copy_(1, group.rows, o)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q (1, heads, T, d); k, v (1, kv_heads, T, d) of the row's T new tokens."""
        batch = self.batch
        k = self._write(layer, "k", k[0].transpose(0, 1), K_SCALE_CONSTANT).transpose(0, 1)[None]
        v = self._write(layer, "v", v[0].transpose(0, 1), V_SCALE_CONSTANT).transpose(0, 1)[None]
        out = torch.empty_like(q)
        for group in batch.decodes:
            self._decode(layer, q, out, group)
        for p in batch.prefills:
            qp = q[:, :, p.begin:p.end]
            if p.context_blocks is None:
                out[:, :, p.begin:p.end] = sdpa(qp, k[:, :, p.begin:p.end],
                                                v[:, :, p.begin:p.end], causal=True)
                continue
            # the context's keys, cut after the last query: the rest of its last block is
            # unwritten (a NaN there would pass the mask, as 0 · NaN does in the sum)
            context = p.start + p.end - p.begin
            kp, vp = (x[:, :, :context] for x in
                      self.gather_blocks(layer, p.context_blocks[None], q.dtype))
            qpos = torch.arange(p.start, context, device=q.device)
            mask = torch.arange(kp.shape[2], device=q.device)[None, :] <= qpos[:, None]
            out[:, :, p.begin:p.end] = sdpa(qp, kp, vp, mask)
        return out


@torch.no_grad()
def calibrate_kv_scales(model, token_rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrated FP8 scales (k, v), each (layers, kv_heads): amax / 448 over plain forwards
    of `token_rows` (sample text of the kind the server will see)."""
    cfg = model.cfg
    observer = KVScaleObserver(cfg.num_layers, cfg.num_kv_heads)
    device = next(model.parameters()).device
    for row in token_rows:
        model(torch.tensor([row], device=device), cache=observer)
    return observer.scales()
