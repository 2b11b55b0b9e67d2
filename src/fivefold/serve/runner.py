"""One serving step on the model: flatten the scheduled tokens, attend through the paged
cache, return the logits of the positions that sample.

The model is any module with the Llama forward signature (models/llama.py: tokens,
cache=, positions=, logits_index=) whose attention hands a cache with an `attend` method the
step's queries, keys and values: the dense and MoE Llamas, and models whose linear layers
were swapped (LoRA, quantised) since those keep the forward. Every scheduled sequence goes
into one row of the batch (b = 1): the linear layers and experts see all tokens of the step
at once, and only attention is per sequence (kv_cache.py).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.serve.kv_cache import PagedBatch, PagedKVCache, Prefill
from fivefold.serve.kv_cache_manager import KVCacheManager
from fivefold.serve.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, kv: KVCacheManager):
        self.model, self.cache, self.kv = model, cache, kv
        self.device = cache.k.device
        self.adapters = None  # many LoRA adapters in one batch (serve/lora_batch.py)

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def prepare(self, out: SchedulerOutput) -> tuple[list[int], list[int], PagedBatch,
                                                      list[tuple[str, int]]]:
        """(tokens, positions, batch, [(request id, row of its sampling position)])."""
        bs = self.cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_blocks: list[int] = []
        prefills, samplers = [], []
        batch = PagedBatch(slot_mapping=None)
        for request, num_new in out.scheduled:
            begin, start = len(tokens), request.num_computed_tokens
            table = self.kv.block_ids(request.request_id)
            tokens.extend(request.all_token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + num_new))
            if num_new == 1:
                batch.decode_rows.append(begin)
                batch.decode_lens.append(start + 1)
                decode_blocks.extend(table[:start // bs + 1])
            else:
                context = None if start == 0 else self._tensor(table)
                prefills.append(Prefill(begin, begin + num_new, start, context))
            if start + num_new == request.num_tokens:
                samplers.append((request.request_id, len(tokens) - 1))
        batch.slot_mapping, batch.prefills = self._tensor(slots), prefills
        if decode_blocks:
            batch.decode_blocks = self._tensor(decode_blocks)
        return tokens, positions, batch, samplers

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run the step; fp32 logits (V,) for each request that samples a token now."""
        if out.copies:
            self.cache.copy_blocks(out.copies)
        if self.adapters is not None:  # rows grouped by adapter, each adapter's rows found
            out = self.adapters.begin_step(out, self.device)
        tokens, positions, batch, samplers = self.prepare(out)
        self.cache.batch = batch
        try:
            rows = self._tensor([row for _, row in samplers])
            logits = self.model(self._tensor([tokens]), cache=self.cache,
                                positions=self._tensor(positions), logits_index=rows)
        finally:
            self.cache.batch = None
            if self.adapters is not None:
                self.adapters.end_step()
        logits = self.finish_logits(logits[0]).float()
        return {rid: logits[i] for i, (rid, _) in enumerate(samplers)}

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, V) logits of the sampled positions from the model's output rows; a tensor-
        parallel runner gathers the vocabulary shards here (serve/tp_worker.py)."""
        return logits
