"""Async scheduling: the host builds and launches step N+1 while the device runs step N.

A synchronous step ends by reading its sampled tokens back to the host (a device-to-host
copy, which waits for the whole forward), and only then schedules the next one: the device
idles while the host schedules, builds the next step's inputs and launches its kernels.
vLLM v1's async scheduling and SGLang's overlap scheduler hide that host time by running
one step ahead; so does this module, for the steps where that is exact:

1. Step N's forward and its greedy argmax are launched; the sampled ids stay on the device.
2. The host schedules step N+1 assuming every running request goes on by one token: each
   gets the slot of its next position (a block if it needs one), and its input id is read
   on the device from step N's sampled ids (`SchedulerOutput.input_ids`, runner.py), so
   nothing waits for the device. Step N+1 is launched.
3. Only then are step N's ids read (the one device-to-host copy of the step), appended,
   and the stops applied (EOS, stop token ids, max_tokens, stop strings); the outputs go
   out. A request that stopped at step N had one more token computed by step N+1: it is
   dropped, and the request's blocks (that slot's too) return to the pool at once.

`Engine.step` runs one such round and returns step N's outputs, so a caller sees the same
sequence of outputs as without it, each one step earlier on the device.

Which steps: a step runs ahead only when every running request is a plain greedy one (no
logit_bias, n = 1, no LoRA adapter) that sampled at step N on the device, nobody is
waiting who could be admitted now (a request waiting while max_num_seqs are running is
admitted once one of them ends, a step later than without the overlap, as in vLLM), no
block is shared copy-on-write and the pool has the blocks. A request that is certain to
stop at step N (max_tokens, the context) gets no row in step N+1. Anything else (a
prompt's chunk, sampling with a generator, logit_bias, n > 1, preemption, a request
joining) drains the pipeline: step N's ids are read first and the next step runs as the
synchronous engine runs it (`Engine.run_step`). An abort needs no drain: the aborted
request's rows are dropped when read. Stop strings need the text, which is made after the
ids are read, like EOS: the request ends there and its extra token is dropped.

The greedy id is `argmax` of the same fp32 logits the synchronous step reads (ties: the
first), so the tokens are the synchronous engine's. On a CPU the device is the host and
nothing overlaps; the path runs there (Engine(async_scheduling="on")) for the tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fivefold.serve.kv_cache_manager import cdiv
from fivefold.serve.request import Request, RequestStatus
from fivefold.serve.runner import ModelRunner
from fivefold.serve.scheduler import SchedulerOutput


@dataclass
class Launched:
    """A step whose forward and argmax are queued on the device, its ids not read yet."""

    requests: list[Request]  # one a row, in the order of `tokens`
    tokens: torch.Tensor  # (rows,) the greedy ids, on the device
    index: dict[str, int] = field(default_factory=dict)  # request id -> row

    def __post_init__(self):
        self.index = {r.request_id: i for i, r in enumerate(self.requests)}

    def live(self) -> bool:
        return any(r.status == RequestStatus.RUNNING for r in self.requests)


class Overlap:
    """The engine's steps run one ahead; `pending` is the step launched and not yet read."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: Launched | None = None
        self.num_ahead = 0  # steps scheduled and launched before the step before was read
        self.num_drained = 0  # steps read with nothing launched behind them

    def applies(self) -> bool:
        """The engine's own runner and no LoRA: a tensor- or pipeline-parallel runner sends
        each step's token ids to its workers, which would need them on the host."""
        e = self.engine
        return e.adapters is None and type(e.runner) is ModelRunner

    @staticmethod
    def plain(request: Request) -> bool:
        p = request.params
        return p.greedy and not p.logit_bias and p.n == 1 and p.adapter is None

    def step(self) -> list:
        e = self.engine
        current, self.pending = self.pending, None
        if current is not None and not current.live():
            current = None  # every row was aborted while it ran
        if current is None:
            out = e.scheduler.schedule()
            if not out.scheduled:
                return []
            if not all(self.plain(r) and r.num_computed_tokens + n == r.num_tokens
                       for r, n in out.scheduled):
                return e.run_step(out)  # it needs the host's sampling: synchronous
            try:
                current = self._launch(out)
            except Exception as error:  # as run_step: no one can tell whose tokens broke it
                return e._finish_step([e._fail(r, error) for r, _ in out.scheduled])
        ahead, error, launched = self._schedule_ahead(current), None, None
        if ahead is not None:
            try:
                launched = self._launch(ahead)
                self.num_ahead += 1
            except Exception as e_:  # noqa: BLE001  ends step N+1's requests after N's read
                error = e_
        else:
            self.num_drained += 1
        outputs = self._read(current, ahead if error is not None else None, error)
        if launched is not None and launched.live():
            self.pending = launched
        return outputs

    def _launch(self, out: SchedulerOutput) -> Launched:
        """Queue the forward and the argmax; the rows' K/V count as computed from now on."""
        logits = self.engine.runner.execute(out)
        tokens = logits.rows.argmax(-1)  # ties: the first, as sample_token and run_step
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
        by_id = {r.request_id: r for r, _ in out.scheduled}
        return Launched([by_id[rid] for rid in logits.ids], tokens)

    def _schedule_ahead(self, current: Launched) -> SchedulerOutput | None:
        """Step N+1 for the requests running step N, or None where it must wait for N's ids
        (module docstring). Nothing is allocated unless all of it fits."""
        e = self.engine
        s, kv = e.scheduler, e.kv
        if any(r.request_id not in current.index for r in s.running):
            return None  # someone did not sample at step N on the device
        rows = [r for r in s.running if not self._stops_for_sure(r)]
        if s.waiting and len(rows) < s.max_num_seqs:
            return None  # room for a waiting request once step N is read: admit it then
        if not rows or len(rows) > s.max_num_batched_tokens:
            return None
        bs, need = kv.block_size, 0
        for r in rows:  # as KVCacheManager.allocate_slots for one token at this position
            blocks, position = kv.req_blocks.get(r.request_id, []), r.num_computed_tokens
            if position % bs and position // bs < len(blocks) and \
                    blocks[position // bs].ref_cnt > 1:
                return None  # a shared block to copy first: the scheduler's business
            need += max(cdiv(position + 1, bs) - len(blocks), 0)
        if need > kv.pool.num_free:
            return None  # the scheduler preempts
        for r in rows:  # the newest id is not known yet: its blocks are named once it is
            if kv.allocate_slots(r, 1, register=False) is None:
                raise RuntimeError(f"request {r.request_id} got no slot although "
                                   f"{kv.pool.num_free} blocks were free")
        order = [current.index[r.request_id] for r in rows]
        same = order == list(range(len(current.requests)))
        return SchedulerOutput(scheduled=[(r, 1) for r in rows], copies=kv.take_copies(),
                               input_ids=(current.tokens, None if same else order))

    def _stops_for_sure(self, request: Request) -> bool:
        """Step N's token (not read yet) is the request's last: max_tokens or the context."""
        return (request.num_output_tokens + 1 >= request.params.max_tokens
                or request.num_tokens + 1 >= self.engine.scheduler.max_model_len)

    def _read(self, current: Launched, failed_ahead: SchedulerOutput | None,
              error: BaseException | None) -> list:
        """Step N's ids to the host (one copy), appended, stops applied, outputs made."""
        e = self.engine
        s = e.scheduler
        live = [i for i, r in enumerate(current.requests) if r.status == RequestStatus.RUNNING]
        try:
            tokens = current.tokens.tolist() if live else []  # the step's one copy to the host
        except Exception as err:  # the device failed while running step N
            return e._finish_step([e._fail(current.requests[i], err) for i in live])
        now = time.perf_counter()
        changed = []
        for i in live:
            request, token = current.requests[i], tokens[i]
            request.append_token(token, now)
            status = s.stop_status(request, token)
            if status is not None:
                s.finish(request, status)
            else:  # now the id is known: the blocks filled through it can be found by prefix
                e.kv.register_full_blocks(request, request.num_computed_tokens)
            changed.append(request)
        e.num_steps += 1
        e.num_generated_tokens += len(changed)
        if failed_ahead is not None:  # step N+1's forward raised: its requests end (each
            for r, _ in failed_ahead.scheduled:  # got step N's token above, so is in changed)
                if r.status == RequestStatus.RUNNING:
                    e._fail(r, error)
        return e._finish_step(changed)
