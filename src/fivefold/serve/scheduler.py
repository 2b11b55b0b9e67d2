"""Continuous (iteration-level) batching: which requests run in the next forward, and how far.

Orca (Yu et al., OSDI 2022) schedules per iteration instead of per batch: a request joins as
soon as there is room and leaves the moment it finishes, so no one waits for the longest
sequence of a static batch. Each `schedule()` call, following vLLM v1's scheduler:

1. Running requests first, oldest first: each gets the tokens it still lacks K/V for (one
   for a decoding request; the rest of its prompt, or a chunk of it under chunked prefill),
   within `max_num_batched_tokens`. When the pool has no block for it, the newest running
   request is preempted (blocks freed, `num_computed_tokens` back to 0, first in the waiting
   queue, to be recomputed later) until it fits, so the oldest always make progress and
   nothing deadlocks.
2. Then, if nothing was preempted, waiting requests in arrival order while sequences
   (`max_num_seqs`), tokens and blocks last; a cached prefix counts as computed.

`update_from_output` advances each scheduled request, appends the token sampled where a
request reached its last token, and retires finished ones at once (EOS, stop token ids,
`max_tokens`, the model's context). Stop strings need text and are the engine's business
(`finish`). This module imports no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from fivefold.errors import ConfigError
from fivefold.serve.kv_cache_manager import KVCacheManager, cdiv
from fivefold.serve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one forward computes: (request, new tokens) in batch order, and block copies
    (copy-on-write) to perform before it."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    # A step scheduled ahead (serve/async_step.py): every row decodes the token the step
    # before sampled, which is on the device only: (that step's sampled ids, the index of
    # each row among them, or None when the rows are the same requests in the same order)
    input_ids: tuple[object, list[int] | None] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_model_len: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, chunked_prefill: bool = False,
                 eos_token_ids: Iterable[int] = ()):
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.max_num_batched_tokens = max_num_batched_tokens or max(2048, max_model_len)
        if not chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens = {self.max_num_batched_tokens} is below the context "
                f"of {max_model_len} tokens: a long prompt could never run; raise it or turn "
                f"on chunked prefill")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs = {max_num_seqs} must be >= 1")
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ConfigError(f"request id {request.request_id!r} is already in use")
        need = cdiv(min(request.num_tokens + request.params.max_tokens, self.max_model_len),
                    self.kv.block_size)
        if need > self.kv.num_blocks:
            raise ConfigError(f"the request needs up to {need} KV blocks but the cache holds "
                              f"{self.kv.num_blocks}; give the cache more memory or ask for "
                              f"fewer tokens")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.chunked_prefill and num_new < request.num_tokens - \
                    request.num_computed_tokens:
                break  # without chunking a request runs whole or waits for the next step
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # the newest; never one scheduled already
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            out.scheduled.append((request, num_new))
            budget -= num_new
            index += 1
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            hits, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.chunked_prefill:
                    break
                num_new = budget
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        out.copies = self.kv.take_copies()
        return out

    def _preempt(self, request: Request) -> None:
        """Recompute later: free the blocks and start over from the tokens so far."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           now: float | None = None) -> list[Request]:
        """Advance the scheduled requests; `sampled` maps a request id to the token drawn from
        its last position's logits (only for requests that reached their last token). Returns
        the requests that received a token or finished."""
        now = time.perf_counter() if now is None else now
        changed = []
        for request, num_new in out.scheduled:
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the forward ran
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk: no token yet
            request.append_token(token, now)
            status = self.stop_status(request, token)
            if status is not None:
                self.finish(request, status)
            changed.append(request)
        return changed

    def adopt(self, request: Request, after: Request) -> None:
        """Run a forked request (its blocks already shared) right after its parent."""
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.insert(self.running.index(after) + 1, request)

    def stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or \
                token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or \
                request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request now: its blocks return to the pool."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True
