"""One serving step on the model: flatten the scheduled tokens, attend through the paged
cache, return the logits of the positions that sample.

The model is any module with the Llama forward signature (models/llama.py: tokens,
cache=, positions=, logits_index=) whose attention hands a cache with an `attend` method the
step's queries, keys and values: the dense and MoE Llamas, and models whose linear layers
were swapped (LoRA, quantised) since those keep the forward. Every scheduled sequence goes
into one row of the batch (b = 1): the linear layers and experts see all tokens of the step
at once, and so does the decode attention (one padded call, kv_cache.py); only prefills
attend one sequence at a time.

The host work of a step is built once, here: every index the layers read (tokens,
positions, slots, the decode rows, lengths and padded block tables, the unwritten slots
those tables read past a length, the prefills' tables, the sampling rows) goes into one
host tensor and reaches the device in one copy, so a layer launches its few kernels
without building anything.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.serve.fused import FusedLlama, fusable
from fivefold.serve.kv_cache import DecodeGroup, PagedBatch, PagedKVCache, Prefill
from fivefold.serve.kv_cache_manager import KVCacheManager
from fivefold.serve.scheduler import SchedulerOutput


class StepLogits:
    """The fp32 logits (n, V) of a step's sampling positions, row i for request `ids[i]`;
    `step_logits[request_id]` is one request's row."""

    def __init__(self, ids: list[str], rows: torch.Tensor):
        self.ids, self.rows = ids, rows
        self.index = {rid: i for i, rid in enumerate(ids)}

    def __getitem__(self, request_id: str) -> torch.Tensor:
        return self.rows[self.index[request_id]]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.index

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class StepInputs:
    tokens: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (T,)
    batch: PagedBatch
    sample_rows: torch.Tensor  # (n,) the row of each sampling position
    sample_ids: list[str]  # whose position each is


class ModelRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, kv: KVCacheManager,
                 fuse: bool = False):
        self.model, self.cache, self.kv = model, cache, kv
        self.device = cache.k.device
        self.adapters = None  # many LoRA adapters in one batch (serve/lora_batch.py)
        # fuse: the lean forward of serve/fused.py where the model allows it (not while
        # LoRA adapters wrap its linears: those steps run the model itself)
        self.fused = FusedLlama(model) if fuse and fusable(model) is None else None
        self.static = None  # decode at fixed sizes, CUDA graphs (serve/cuda_graphs.py)

    def _upload(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """Integer lists as tensors on the device: one host tensor, one copy. On CUDA from
        pinned memory, asynchronously: a copy from pageable memory would wait for the steps
        still running (which a step scheduled ahead must not, serve/async_step.py)."""
        flat = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.long)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        else:
            flat = flat.to(self.device)
        return list(flat.split([len(p) for p in parts]))

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's inputs on the device. A step scheduled ahead (`out.input_ids`): every
        row decodes one token whose id only the device has, at position
        `num_computed_tokens`, and samples."""
        bs = self.cache.block_size
        ahead = out.input_ids is not None
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows, lens, tables, prefills = [], [], [], []
        sample_rows, sample_ids = [], []
        for request, num_new in out.scheduled:
            begin, start = len(tokens), request.num_computed_tokens
            end = start + num_new
            table = self.kv.block_ids(request.request_id)
            prompt = len(getattr(request, "prompt_token_ids", ()))
            if ahead:
                tokens.append(0)  # a stand-in: the id comes from the device below
            elif prompt and start >= prompt:  # a decode: no copy of the whole sequence (a
                # tensor-parallel worker's mirror has all_token_ids alone)
                tokens.extend(request.output_token_ids[start - prompt:end - prompt])
            else:
                tokens.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if num_new == 1:
                rows.append(begin)
                lens.append(end)
                tables.append(table[:start // bs + 1])
            else:  # a fresh prompt needs no table: it attends to its own new keys
                prefills.append((begin, begin + num_new, start, list(table) if start else []))
            if ahead or end == request.num_tokens:
                sample_rows.append(len(tokens) - 1)
                sample_ids.append(request.request_id)
        sizes = self.cache.decode_groups(lens)
        groups, first = [], 0
        stale: list[int] = []  # unwritten slots a masked decode reads: zeroed (kv_cache.py)
        for size in sizes:  # each group's tables padded to its longest (own last block)
            group_tables, group_lens = tables[first:first + size], lens[first:first + size]
            width = max(map(len, group_tables))
            if min(group_lens) != max(group_lens):
                for table, length in zip(group_tables, group_lens):
                    stale.extend(range(table[-1] * bs + (length - 1) % bs + 1,
                                       (table[-1] + 1) * bs))
            groups.append((first, size, width,
                           [b for t in group_tables for b in t + t[-1:] * (width - len(t))]))
            first += size
        sampled, order = out.input_ids if ahead else (None, None)
        tokens_t, positions_t, slots_t, sample_t, rows_t, lens_t, stale_t, order_t, *rest = \
            self._upload([tokens, positions, slots, sample_rows, rows, lens, stale, order or [],
                          *(padded for *_, padded in groups),
                          *(table for *_, table in prefills)])
        if ahead:  # the ids the step before sampled, on the device: no host sync
            tokens_t = sampled if order is None else sampled.index_select(0, order_t)
        batch = PagedBatch(slot_mapping=slots_t, stale_slots=stale_t if stale else None)
        for (first, size, width, _), tables_t in zip(groups, rest):
            last = first + size - 1
            span = (rows[first], rows[last] + 1) if rows[last] - rows[first] == size - 1 \
                else None  # one run of rows: a slice, no gather
            group_lens = lens[first:first + size]
            batch.decodes.append(DecodeGroup(
                rows_t[first:first + size], span, lens_t[first:first + size],
                tables_t.view(size, width), max(group_lens),
                min(group_lens) == max(group_lens)))
        contexts = rest[len(groups):]
        batch.prefills = [Prefill(begin, end, start, context if start else None)
                          for (begin, end, start, _), context in zip(prefills, contexts)]
        return StepInputs(tokens_t[None], positions_t, batch, sample_t, sample_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        """Run the step; the fp32 logits of each request that samples a token now."""
        if out.copies:
            self.cache.copy_blocks(out.copies)
        if self.adapters is not None:  # rows grouped by adapter, each adapter's rows found
            out = self.adapters.begin_step(out, self.device)
        step = self.prepare(out)
        if step.batch.stale_slots is not None:
            self.cache.clear_slots(step.batch.stale_slots)
        static = self.static
        if static is not None and self.adapters is None and not step.batch.prefills and \
                len(step.batch.decodes) == 1 and len(step.sample_ids) == len(out.scheduled) \
                and static.size_for(len(out.scheduled)) is not None:
            group = step.batch.decodes[0]  # every row decodes and samples, in order
            rows = static.run(step.tokens[0], step.positions, step.batch.slot_mapping,
                              group.tables, group.lens)
            return StepLogits(step.sample_ids, rows)
        self.cache.batch = step.batch
        forward = self.fused if self.fused is not None and self.adapters is None else self.model
        try:
            logits = forward(step.tokens, cache=self.cache, positions=step.positions,
                                logits_index=step.sample_rows)
        finally:
            self.cache.batch = None
            if self.adapters is not None:
                self.adapters.end_step()
        return StepLogits(step.sample_ids, self.finish_logits(logits[0]).float())

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, V) logits of the sampled positions from the model's output rows; a tensor-
        parallel runner gathers the vocabulary shards here (serve/tp_worker.py)."""
        return logits
