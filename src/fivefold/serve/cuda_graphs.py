"""Decode steps at fixed sizes from static buffers, captured as CUDA graphs.

A decode step of a small model on a GPU is all launches: hundreds of kernels of a few
microseconds, each costing the host more than the device. vLLM's answer, followed here:
capture the decode forward once per batch size of a ladder (1, 2, 4, then multiples of 8
up to --max-num-seqs), pad each step's batch to the next captured size, and replay: one
launch for the whole forward.

- Static input buffers (token ids, positions, slot mapping, block tables, lengths), sized
  for the largest batch; each step copies its inputs into their first rows and fills the
  rest with padding: token 0 at position 0, writing its K/V to the pool's trash slot (the
  first slot past the pool in every layer, serve/kv_cache.py), attending to one key of block 0.
- The attention reads K/V through full-width block tables (every sequence's row as wide as
  the longest context allowed), so shapes never change: on CUDA the paged kernel (serve/
  paged_attention.py), which reads only up to each length; elsewhere a gather of the full
  width and SDPA with a length mask (the same static path, run without capture: how the
  tests check it on CPU).
- All graphs share one memory pool; a size is captured the first time a batch needs it
  (after two warm-up runs on a side stream, as torch.cuda.graphs requires).
- Nothing inside syncs or allocates on the host: the forward is the fused one (serve/
  fused.py) with this module's attention; sampling happens after the replay, on the
  graph's output rows (one device-to-host copy per step: the sampled tokens).

On by default on CUDA where the fused forward and the paged kernel run; `--enforce-eager`
(Engine(cuda_graphs=False)) turns it off. Steps with prefills, LoRA adapters or more
sequences than the largest size run eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.errors import ConfigError
from fivefold.serve import paged_attention
from fivefold.serve.kv_cache_manager import cdiv


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then multiples of 8, up to max_num_seqs (itself included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class StaticDecode:
    def __init__(self, fused, cache, max_model_len: int, max_num_seqs: int,
                 capture: bool):
        sizes = capture_sizes(max_num_seqs)
        if sizes[-1] > cache.num_blocks:
            raise ConfigError(
                f"CUDA graphs for decode batches up to {sizes[-1]} sequences (--max-num-seqs) "
                f"but the KV cache holds {cache.num_blocks} blocks, fewer than one a sequence; "
                f"lower --max-num-seqs, give the cache more memory (--kv-cache-gib) or pass "
                f"--enforce-eager")
        self.fused, self.cache, self.sizes, self.capture = fused, cache, sizes, capture
        device, n = cache.k.device, sizes[-1]
        self.width = cdiv(max_model_len, cache.block_size)  # blocks of the longest context
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), cache.trash_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.long, device=device)
        self.lens = torch.ones(n, dtype=torch.long, device=device)
        self.kernel = paged_attention.available(device) and \
            cache.block_size & (cache.block_size - 1) == 0
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.num_replays = 0

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def run(self, tokens, positions, slots, tables, lens) -> torch.Tensor:
        """The (n, V) fp32 logits of n decoding sequences: inputs into the static buffers,
        padded to the next size, the forward replayed (or run, without capture)."""
        n = tokens.shape[0]
        size = self.size_for(n)
        self.ids[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.tables[:n, :tables.shape[1]].copy_(tables)
        self.lens[:n].copy_(lens)
        if size > n:  # padding rows: token 0 at position 0, K/V to the trash slot
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.cache.trash_slot)
            self.lens[n:size].fill_(1)
            self.tables[n:size].zero_()
        if not self.capture:
            return self.forward(size)[:n]
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]

    @torch.inference_mode()
    def forward(self, size: int) -> torch.Tensor:
        f = self.fused
        h = f.embed_tokens(self.ids[:size][None])
        h = f.layers_forward(h, self.positions[:size], self.cache, 0, len(f.layers),
                             attend=self._attention(size))
        return f.logits(h, None)[0].float()

    def _attention(self, size: int):
        cache, f = self.cache, self.fused
        H, KV, d, bs = f.heads, f.kv_heads, f.head_dim, cache.block_size
        slots, tables, lens = self.slots[:size], self.tables[:size], self.lens[:size]
        k_ext, v_ext = cache.k_ext, cache.v_ext
        if self.kernel:
            def attend(layer, q, k, v):
                k_ext[layer].index_copy_(0, slots, k)
                v_ext[layer].index_copy_(0, slots, v)
                return paged_attention.paged_decode(q, cache.k[layer], cache.v[layer],
                                                    tables, lens, bs).view(size, H * d)
            return attend
        # every row's full-width table, keys past its length masked (built once a step)
        past = torch.arange(self.width * bs, device=lens.device)[None, :] >= lens[:, None]
        bias = torch.zeros(past.shape, dtype=f.embed.dtype, device=lens.device)
        bias = bias.masked_fill_(past, float("-inf"))[:, None, None]
        flat = tables.reshape(-1)
        shape = (size, self.width * bs, KV, d)

        def attend(layer, q, k, v):
            k_ext[layer].index_copy_(0, slots, k)
            v_ext[layer].index_copy_(0, slots, v)
            kb = cache.k[layer].view(cache.num_blocks, -1).index_select(0, flat)
            vb = cache.v[layer].view(cache.num_blocks, -1).index_select(0, flat)
            kb, vb = kb.view(shape).transpose(1, 2), vb.view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.view(size, KV, H // KV, d), kb, vb,
                                               attn_mask=bias)
            return o.reshape(size, H * d)
        return attend

    def _capture(self, size: int) -> None:
        """Two warm-up runs on a side stream, then the capture into the shared pool."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of the server's other threads do not void the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[size] = self.forward(size)
        self.graphs[size] = graph
