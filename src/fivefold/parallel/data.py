"""Data parallelism's gradient side: bucketed reduction, overlapped with backward.

Gradients live in flat buffers cut into buckets (`buffers.FlatLayout`). A hook on each
parameter (`register_post_accumulate_grad_hook`, torch >= 2.1) counts the gradients a
bucket still waits for; when the last arrives, the bucket's collective is launched at once,
asynchronously, while backward goes on computing earlier layers (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", §3.2.3). Buckets are
launched strictly in layout order, so every rank issues the same collectives in the same
order even if a parameter got no gradient (its bucket then goes out in `finish`).

    stage 0 (DP)   .grad of each parameter is a view of the full flat gradient buffer (as
                   DDP's gradient_as_bucket_view, Megatron's grad buffer): autograd adds into
                   it in place, nothing is copied; each bucket is all-reduced in place.
    stage 1        the same buffer; each bucket is reduce-scattered in place: this rank's
                   owned range receives the sum, the rest is left stale and never read.
    stage 2, 3     no full buffer: on the final micro-batch each gradient is copied into its
                   bucket's staging buffer and dropped; the full bucket exists only until its
                   reduce-scatter into the persistent gradient shard (Rajbhandari et al. 2020,
                   "ZeRO", §5.2) has finished. At most `buckets_in_flight` (k) buckets
                   are alive at once, the one filling and k-1 launched: before a new one is
                   allocated, the oldest launched reductions are waited for and their
                   staging freed (reductions complete in launch order), so a rank holds its
                   shard plus k buckets, never the whole gradient. Two are enough to keep
                   the overlap: one bucket fills while the one before it is on the wire.
                   A bucket that fills across others (ZeRO-3's rest unit, embedding and
                   head, from backward's first gradient to its last) is not one of the k:
                   counted, it would leave no room for a reduction on the wire, and every
                   block's reduction would be waited for as soon as it was launched.

Every reduction is a plain SUM: the loss of each micro-batch is divided by the number of
target tokens of the whole global batch, so the summed gradient is the single-device one.
On non-final micro-batches of gradient accumulation nothing is sent: gradients accumulate
locally (in the buffer for stages 0-1, in `.grad` for stages 2-3) and go out once.

`grad_sync = "microbatch"` (stages 2, 3): every micro-batch is treated as the final one —
each gradient is staged into its bucket and dropped, each bucket reduce-scattered as it
fills — so no full gradient is held between micro-batches either (DeepSpeed ZeRO-2's
`reduce_scatter` per micro-batch; FSDP2 with gradient sync on). The shard accumulates
without a second buffer: before launching a bucket, a rank adds its shard's running sum
into its *own* range of the bucket, the only range whose reduced sum comes back to it, so
the reduce-scatter returns running sum + this micro-batch's sum straight into the shard.
Before the next micro-batch starts, the buckets backward did not launch go out (zeros for
parameters that got no gradient, so every rank issues the same collectives) and every
reduction is waited for: no bucket stays alive into the next forward. Per step: m
reduce-scatters of every bucket instead of one, and no `grad_buffer` at all.
"""

from __future__ import annotations

import torch

from fivefold.parallel import comm, peak
from fivefold.parallel.buffers import FlatLayout

BUCKETS_IN_FLIGHT = 2  # the default of parallel.buckets_in_flight


class GradReducer:
    def __init__(self, layout: FlatLayout, group: comm.Group, stage: int, dtype: torch.dtype,
                 device: torch.device, watchdog, order: list[int] | None = None,
                 buckets_in_flight: int = BUCKETS_IN_FLIGHT, grad_sync: str = "step"):
        self.layout, self.group, self.stage, self.watchdog = layout, group, stage, watchdog
        self.buckets_in_flight = buckets_in_flight
        # The order in which segments are expected to complete in backward, and are launched.
        self.order = order if order is not None else list(range(len(layout.segments)))
        self.rank = group.rank if layout.shards > 1 else 0
        self.keep_full = stage <= 1
        # Reduce-scatter every micro-batch into the shard (stages 2-3 only: stages 0-1 keep
        # the whole buffer anyway, so syncing early would only add communication).
        self.per_microbatch = grad_sync == "microbatch" and not self.keep_full
        self.accumulate = False  # the shard holds earlier micro-batches' sum: add to it
        self.backward_started = False
        nseg = len(layout.segments)
        if self.keep_full:
            self.grad_buffer = torch.zeros(layout.total, dtype=dtype, device=device)
            self.grad_shard = None
        else:
            self.grad_buffer = None
            self.grad_shard = torch.zeros(layout.total // layout.shards, dtype=dtype,
                                          device=device)
        self.dtype, self.device = dtype, device
        self.staging: dict[int, torch.Tensor] = {}
        self.counts = [0] * nseg
        self.ready = [False] * nseg
        self.launched = 0
        self.handles: list = []  # (segment, work) launched and not yet waited for, in order
        self.final = True
        self.segment_done = []  # callbacks(segment index), on every micro-batch (ZeRO-3 frees)
        self.launch_log: list[int] = []  # segments in launch order (for tests and debugging)
        self._hooks = [slot.param.register_post_accumulate_grad_hook(self._hook(i))
                       for i, slot in enumerate(layout.params)]
        self.zero_grad()

    # --- per step -------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.keep_full:
            self.grad_buffer.zero_()
            for i, slot in enumerate(self.layout.params):
                slot.param.grad = self.layout.view(self.grad_buffer, i)
        else:
            for slot in self.layout.params:
                slot.param.grad = None
        self.ready = [False] * len(self.ready)
        self.launched = 0
        self.launch_log.clear()
        self.accumulate = self.backward_started = False

    def prepare_backward(self, final_microbatch: bool) -> None:
        peak.sample("before a micro-batch's backward")  # = the end of the previous one's
        if self.per_microbatch and self.backward_started:
            self._flush()  # the previous micro-batch's buckets: launched and reduced
            self.ready = [False] * len(self.ready)
            self.launched = 0
            self.accumulate = True
        self.backward_started = True
        self.final = final_microbatch or self.per_microbatch
        self.counts = [0] * len(self.counts)

    def _hook(self, index: int):
        def on_grad_ready(param: torch.Tensor) -> None:
            self._grad_ready(index, param)
        return on_grad_ready

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        slot = self.layout.params[index]
        seg = slot.segment
        if self.final and not self.keep_full:
            staging = self._staging(seg)
            start = slot.start - self.layout.segments[seg].start
            staging[start:start + slot.numel].copy_(param.grad.view(-1))
            param.grad = None  # the full gradient is not kept beyond its bucket
            peak.sample("gradient staged")
        self.counts[seg] += 1
        if self.counts[seg] == len(self.layout.segments[seg].params):
            for callback in self.segment_done:
                callback(seg)
            if self.final:
                self.ready[seg] = True
                self._launch_ready()

    def _staging(self, seg: int) -> torch.Tensor:
        if seg not in self.staging:
            # Make room first: wait for the oldest reductions until fewer than the allowed
            # number of launched buckets are alive, so that with this one filling there are
            # at most that many. A bucket still filling (in `staging`, not in `handles`)
            # cannot be waited for and is not counted.
            while len(self.handles) >= self.buckets_in_flight:
                self._wait_oldest()
            size = self.layout.segments[seg].size
            self.staging[seg] = torch.zeros(size, dtype=self.dtype, device=self.device)
        return self.staging[seg]

    def _launch_ready(self) -> None:
        while self.launched < len(self.order) and self.ready[self.order[self.launched]]:
            self._launch(self.order[self.launched])
            self.launched += 1

    def _launch(self, index: int) -> None:
        seg = self.layout.segments[index]
        if self.stage == 0:
            full = self.grad_buffer[seg.start:seg.start + seg.size]
            handle = comm.all_reduce(full, self.group, async_op=True)
        elif self.keep_full:
            full = self.grad_buffer[seg.start:seg.start + seg.size]
            lo, hi = seg.owned(self.rank, self.layout.shards)
            handle = comm.reduce_scatter(self.grad_buffer[lo:hi], full, self.group,
                                         async_op=True)
        else:
            out = self.layout.segment_shard(self.grad_shard, seg)
            staging = self._staging(index)
            if self.accumulate:  # our range comes back to us alone: it carries the sum so far
                lo, hi = seg.owned(self.rank, self.layout.shards)
                staging[lo - seg.start:hi - seg.start].add_(out)
            handle = comm.reduce_scatter(out, staging, self.group, async_op=True)
        self.launch_log.append(index)
        self.handles.append((index, handle))
        peak.sample("bucket launched")

    def _wait_oldest(self) -> None:
        index, handle = self.handles.pop(0)
        self.watchdog.wait(handle, f"gradient {self.group.name} reduction of bucket {index}")
        self.staging.pop(index, None)  # its reduce-scatter has read it: free it now

    def finish(self) -> None:
        """Launch what backward did not (buckets of parameters without a gradient), wait."""
        self._flush()
        self.backward_started = False

    def _flush(self) -> None:
        peak.sample("end of backward")
        if self.final:
            # A gradient still in .grad was never staged (its hook ran on a non-final pass, or
            # not at all): stage and launch bucket by bucket, in launch order, so that the
            # bound on buckets alive holds here too.
            leftover: dict[int, list[int]] = {}
            if not self.keep_full:
                for i, slot in enumerate(self.layout.params):
                    if slot.param.grad is not None and not self.ready[slot.segment]:
                        leftover.setdefault(slot.segment, []).append(i)
            for seg in self.order[self.launched:]:
                for i in leftover.get(seg, []):
                    self._stage_leftover(i)
                self.ready[seg] = True
                self._launch_ready()
        while self.handles:
            self._wait_oldest()
        self.staging.clear()

    def _stage_leftover(self, index: int) -> None:
        slot = self.layout.params[index]
        start = slot.start - self.layout.segments[slot.segment].start
        self._staging(slot.segment)[start:start + slot.numel].copy_(slot.param.grad.view(-1))
        slot.param.grad = None
        peak.sample("gradient staged")

    # --- the optimizer's view of the reduced gradients -----------------------------------
    def owned_grads(self, pieces) -> list[torch.Tensor]:
        """The reduced gradient of each of this rank's pieces (flat views, no copy)."""
        if self.keep_full:
            return [self.grad_buffer[p.flat:p.flat + p.hi - p.lo] for p in pieces]
        return [self.grad_shard[p.shard:p.shard + p.hi - p.lo] for p in pieces]

    def tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor this rank holds now (for memory accounting)."""
        out = [self.grad_buffer, self.grad_shard, *self.staging.values()]
        if not self.keep_full:
            out += [slot.param.grad for slot in self.layout.params]
        return [t for t in out if t is not None]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
