"""The pipeline executor: runs a rank's action list (schedules.py) with torch.

It follows the execution contract in `schedules.py`, relaxed only where that cannot add a
wait: the list runs in order, and a maximal run of communication actions is one batch,
posted at its place with one batched isend/irecv through `comm.batch_p2p`, but not waited
there. A receive is waited just before the compute that reads its tensor, and a send at the
end of the step (a delivered one lets go of its tensor earlier). So a rank never idles on a
transfer its next compute does not need, nor until a peer reaches the matching receive, as
in torch.distributed.pipelining's and DualPipe's executors. Every op is still posted where
the contract puts it and every wait comes at or after that point, so each rank gets at
least as far as under the contract's worst case: a schedule the checker proves deadlock-free
stays so. The k-th send to a peer pairs with the k-th receive there, so no tags are needed;
a stage whose neighbour is on this rank (DualPipeV's V bottom) hands its tensor over in
memory.

Per (micro-batch, chunk) the runner keeps the stage's input (a leaf that requires grad) and
its output (or, on the last stage, the scaled loss: summed cross-entropy · loss_scale /
target tokens of the global batch, as the single-device trainer). Gradients accumulate in
`.grad` over the micro-batches; the optimizer's `prepare_backward(final)` runs before every
action that accumulates weight gradients (B, or W when the backward is split), with
final=True on the last one, so the DP/ZeRO reduction overlaps this rank's last backward.

Split backward (ZB-H1, DualPipeV; Qi et al. 2023, "Zero Bubble Pipeline Parallelism"):
  B  `torch.autograd.grad` of the output w.r.t. the stage input *and* w.r.t. the output of
     every weight use (each leaf module holding parameters, plus the head's F.linear),
     keeping the graph. Autograd computes only the edges those need, so no weight gradient
     is formed, and the gradient arriving at each weight use is kept.
  W  for each weight use, `torch.autograd.backward(use_output, kept_grad, inputs=its
     params)`: one node back (the matmul's x^T·dy), not the whole chain again. One call per
     use, because a single call from every use would reach earlier weights both directly
     and through the chain and count them twice. This is how torch.distributed.pipelining
     splits `stage_backward_input`/`stage_backward_weight`, done with module hooks instead
     of a graph walk. Between B and W the kept gradients (one activation-sized tensor per
     weight use) and the graph stay alive: ZB's memory cost, counted below.
  Where a W directly follows its own B in the compute order (DualPipeV's full backwards,
  ZB's drain), the B runs one full backward and the W is empty: same gradients, fewer calls.

Stored activations are measured, not assumed: every tensor autograd saves during a forward
is wrapped (`saved_tensors_hooks`) in a holder that counts itself per (micro-batch, chunk)
while alive. A pair counts as stored while any of its holders lives, i.e. until its B
(full backward) or its W (split) freed the graph. `peak_stored` is the most pairs stored at
once in the last step: the checker's `peak_inflight` for this rank when the executor frees
what it should.

Tied embeddings across ranks (stages.py): ranks holding a copy cannot finish the DP
reduction inside their last backward, because the copy's gradient is incomplete until the
other rank's share is added. They run every backward with final=False, all-reduce the
copies' gradients over the two holders, then mark the step final, so `finish_grad_sync`
launches the reduction of the summed gradients (plain sums commute; with ZeRO-1 the two
ranks' shard boundaries differ, so summing after the reduce-scatter would be wrong).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from fivefold.parallel import comm, peak
from fivefold.parallel.pipeline.check import fused_backwards
from fivefold.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WEIGHT,
    Action,
    Schedule,
)
from fivefold.parallel.pipeline.stages import embedding_group, schedule_for, tied_across_ranks


class _Held:
    """A tensor saved for backward, counted per (micro-batch, chunk) while it is alive."""

    __slots__ = ("counts", "key", "tensor", "__weakref__")

    def __init__(self, tensor, counts, key):
        # Detached: a saved *output* holding its own grad_fn would be a reference cycle
        # that outlives the graph (autograd ignores the metadata on unpack anyway).
        self.tensor, self.counts, self.key = tensor.detach(), counts, key
        counts[key] += 1

    def __del__(self):
        self.counts[self.key] -= 1


class _Batch:
    """The handles of one coalesced batch (NCCL), waited as one."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()

    def is_completed(self) -> bool:
        return all(handle.is_completed() for handle in self.handles)


class _Step:
    """What one step keeps between actions, keyed by (micro-batch, chunk)."""

    def __init__(self, micro_batches, num_tokens: int, loss_scale: float, train: bool):
        self.micro_batches, self.train = micro_batches, train
        self.loss_factor = loss_scale / num_tokens
        self.inputs: dict = {}  # stage input (received, handed over, or token ids)
        self.outputs: dict = {}  # stage output, or the scaled loss on the last stage
        self.grad_outputs: dict = {}  # gradient of the output (received or handed over)
        self.grad_inputs: dict = {}  # gradient of the input, waiting for its SEND_B
        self.uses: dict = {}  # split backward: [(weight-use output, params)]
        self.use_grads: dict = {}  # split backward: the gradients B kept for W
        self.arriving: dict = {}  # (RECV_F | RECV_B, key) -> the handle of its receive
        self.loss = None
        self.fused: set = set()  # (micro-batch, chunk) whose B runs the full backward


def _early_receives(items: list) -> list:
    """The same list with each batch's receives posted with the batch before it.

    A receive only names a buffer, so it can be posted as soon as the previous transfers
    are: the data then flows while this rank computes, instead of starting when the compute
    that needs it is reached. The receives from a peer keep their order, so the k-th still
    pairs with the peer's k-th send."""
    out: list = []
    previous = None  # index in `out` of the last batch
    for item in items:
        if not isinstance(item, tuple):
            out.append(item)
            continue
        receives = tuple(a for a in item if a.kind in (RECV_F, RECV_B))
        sends = tuple(a for a in item if a.kind not in (RECV_F, RECV_B))
        if previous is None:
            out.insert(0, receives)  # the first receives open the step
            previous = 0
        else:
            out[previous] = out[previous] + receives
        out.append(sends)
        previous = len(out) - 1
    return [item for item in out if item != ()]


def _accumulates(action: Action, schedule: Schedule, fused: set) -> bool:
    """Whether `action` adds weight gradients (the optimizer's prepare_backward goes first)."""
    if not schedule.split_backward or (action.microbatch, action.chunk) in fused:
        return action.kind == BACKWARD
    return action.kind == WEIGHT


class PipelineRunner:
    def __init__(self, model, dims, cfg, optimizer):
        self.chunks: list[nn.Module] = model.chunks
        self.dims, self.cfg, self.optimizer = dims, cfg, optimizer
        self.group, self.rank = dims["pp"], dims.pp_rank
        param = next(self.chunks[0].parameters())
        self.device, self.dtype = param.device, param.dtype
        self.hidden = cfg.model.resolve().hidden_size
        self.seq_split = cfg.parallel.tp if cfg.parallel.sp else 1
        self._schedules: dict[int, Schedule] = {}
        layout = self.schedule(cfg.train.gbs // (cfg.parallel.mbs * cfg.parallel.dp)).layout
        self.tied = tied_across_ranks(self.chunks)
        # Collective: every rank builds every embedding group, holder or not.
        group = embedding_group(dims, cfg.model.resolve().tie_embeddings and layout == "loop")
        self.embed_group = group if self.tied else None
        self.peak_stored = 0
        self.peak_kept_bytes = 0  # split backward: most bytes of output gradients kept for W
        # Counting stored activations (saved-tensor hooks) costs ~5-10% of a small stage's
        # step on CPU, so it is off in training; the tests turn it on (peak_stored stays 0).
        self.count_activations = False
        self._live: dict = defaultdict(int)
        self._recording: list | None = None
        self._sends: list = []  # (handle, tensor) of sends posted and not yet waited
        self._item_lists: dict = {}
        # One hook per module holding parameters (a tied embedding is in two chunks).
        owners = {
            id(m): m
            for chunk in self.chunks
            for m in chunk.modules()
            if any(True for _ in m.parameters(recurse=False))
        }
        self._hooks = [m.register_forward_hook(self._record_module) for m in owners.values()]
        for chunk in self.chunks:
            chunk.record = self._record

    # --- public -----------------------------------------------------------------------------
    def schedule(self, num_microbatches: int) -> Schedule:
        if num_microbatches not in self._schedules:
            self._schedules[num_microbatches] = schedule_for(self.cfg, num_microbatches)
        return self._schedules[num_microbatches]

    def _items(self, schedule: Schedule) -> list:
        """This rank's list. On gloo, receives are posted one batch early (_early_receives);
        NCCL runs a rank's p2p ops in order on one stream, where a receive posted ahead of
        the sends of its own batch could wait on a peer that waits the same way."""
        key = (id(schedule), self.device.type)
        if key not in self._item_lists:
            items = list(schedule.steps(self.rank))
            self._item_lists[key] = items if self.device.type == "cuda" else _early_receives(items)
        return self._item_lists[key]

    @property
    def loss_pp_rank(self) -> int:
        """The pp rank holding the last stage (pp-1, or 0 in DualPipeV's V)."""
        schedule = next(iter(self._schedules.values()))
        return schedule.rank_of(schedule.num_stages - 1)

    def run(self, micro_batches, num_tokens: int, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every micro-batch; this rank's summed loss (0 off the
        last stage). Gradients are left in `.grad` (or with the DP/ZeRO reducer)."""
        schedule = self.schedule(len(micro_batches))
        step = _Step(micro_batches, num_tokens, loss_scale, train=True)
        compute = schedule.compute_actions(self.rank)
        step.fused = fused_backwards(compute) if schedule.split_backward else set()
        accumulating = [_accumulates(a, schedule, step.fused) for a in compute]
        last = max(i for i, yes in enumerate(accumulating) if yes)
        self._live.clear()
        self.peak_stored = self.peak_kept_bytes = index = 0
        for item in self._items(schedule):
            if isinstance(item, tuple):
                self._communicate(item, step)
                continue
            if accumulating[index]:
                final = index == last and self.embed_group is None
                self.optimizer.prepare_backward(final_microbatch=final)
            {FORWARD: self._forward, BACKWARD: self._backward, WEIGHT: self._weight}[item.kind](
                item, step, schedule
            )
            peak.sample(f"after {item.kind}")
            self.peak_stored = max(self.peak_stored, sum(1 for c in self._live.values() if c))
            if self.count_activations:
                kept = sum(g.numel() * g.element_size() for grads in step.use_grads.values()
                           for g in grads if g is not None)
                self.peak_kept_bytes = max(self.peak_kept_bytes, kept)
            index += 1
        self._finish_sends()
        if self.embed_group is not None:
            for param in self.tied:  # the two copies' shares -> the full gradient on both
                if param.requires_grad:  # a frozen embedding (LoRA) has no gradient
                    comm.all_reduce(param.grad, self.embed_group)
            self.optimizer.prepare_backward(final_microbatch=True)
        return self._loss(step)

    @torch.no_grad()
    def forward_only(self, micro_batches) -> torch.Tensor:
        """Summed loss of every micro-batch (validation): a forward-only GPipe pass.

        Every rank walks (micro-batch, stage) in the same lexicographic order, receiving
        just before and sending just after each stage, so each transfer's two sides meet.
        """
        schedule = self.schedule(len(micro_batches))
        step = _Step(micro_batches, 1, 1.0, train=False)
        last_stage = schedule.num_stages - 1
        for mb in range(len(micro_batches)):
            for chunk, module in enumerate(self.chunks):
                stage = module.stage_index
                if stage > 0 and schedule.rank_of(stage - 1) != self.rank:
                    self._communicate(
                        (Action(RECV_F, mb, chunk, schedule.rank_of(stage - 1)),), step
                    )
                self._forward(Action(FORWARD, mb, chunk), step, schedule)
                if stage < last_stage and schedule.rank_of(stage + 1) != self.rank:
                    self._communicate(
                        (Action(SEND_F, mb, chunk, schedule.rank_of(stage + 1)),), step
                    )
                    step.outputs.pop((mb, chunk))
        self._finish_sends()
        return self._loss(step)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    # --- actions ------------------------------------------------------------------------------
    def _forward(self, action: Action, step: _Step, schedule: Schedule) -> None:
        key, module = (action.microbatch, action.chunk), self.chunks[action.chunk]
        tokens, targets = step.micro_batches[action.microbatch]
        if module.first:
            step.inputs[key] = tokens.to(self.device)
        self._await(step, RECV_F, key)
        x = step.inputs[key] if step.train else step.inputs.pop(key)
        split = step.train and schedule.split_backward and key not in step.fused
        uses = [] if split else None
        self._recording = uses
        module.split_weight_pass = split
        try:
            if self.count_activations:  # a peak tracker, if active, counts the same holders
                track = peak.track if peak.active() else (lambda held: held)
                saving = torch.autograd.graph.saved_tensors_hooks(
                    lambda t: track(_Held(t, self._live, key)), lambda held: held.tensor
                )
            else:
                saving = peak.saving()
            with saving:
                out = module(x, targets.to(self.device) if module.last else None)
        finally:
            self._recording = None
        if module.last:
            step.loss = out.detach() if step.loss is None else step.loss + out.detach()
            out = out * step.loss_factor
        handover = not module.last and schedule.rank_of(module.stage_index + 1) == self.rank
        if handover:  # the next stage is on this rank: its input is this output, cut off
            following = (action.microbatch, schedule.chunk_of(module.stage_index + 1))
            step.inputs[following] = out.detach().requires_grad_(step.train)
        if step.train:
            step.outputs[key] = out
            if uses is not None:
                step.uses[key] = uses
        elif not module.last and not handover:
            step.outputs[key] = out  # until its SEND_F

    def _backward(self, action: Action, step: _Step, schedule: Schedule) -> None:
        key, module = (action.microbatch, action.chunk), self.chunks[action.chunk]
        out, x = step.outputs.pop(key), step.inputs.pop(key)
        self._await(step, RECV_B, key)
        grad = None if module.last else step.grad_outputs.pop(key)
        wants_input = not module.first
        if schedule.split_backward and key not in step.fused:
            uses = step.uses[key]
            targets = ([x] if wants_input else []) + [use for use, _ in uses]
            grads = torch.autograd.grad(out, targets, grad, retain_graph=True, allow_unused=True)
            step.use_grads[key] = grads[1:] if wants_input else grads
            grad_in = grads[0] if wants_input else None
        else:
            torch.autograd.backward(out, grad)
            grad_in = x.grad if wants_input else None
        if wants_input:
            before = module.stage_index - 1
            if schedule.rank_of(before) == self.rank:  # handed over in memory
                step.grad_outputs[(action.microbatch, schedule.chunk_of(before))] = grad_in
            else:
                step.grad_inputs[key] = grad_in

    def _weight(self, action: Action, step: _Step, schedule: Schedule) -> None:
        key = (action.microbatch, action.chunk)
        if key in step.fused:
            return  # done by its B
        uses, grads = step.uses.pop(key), step.use_grads.pop(key)
        self.optimizer.before_weight_pass([p for (_, params), g in zip(uses, grads)
                                           if g is not None for p in params])
        for (use, params), grad in zip(uses, grads):
            if grad is not None:
                torch.autograd.backward(use, grad, inputs=params)
        # Dropping the uses frees the rest of the graph (and its saved activations).

    def _communicate(self, batch: tuple[Action, ...], step: _Step) -> None:
        ops, received = [], []
        for action in batch:
            key = (action.microbatch, action.chunk)
            if action.kind == SEND_F:
                ops.append(comm.P2P("send", step.outputs[key].detach(), action.peer))
            elif action.kind == SEND_B:
                ops.append(comm.P2P("send", step.grad_inputs.pop(key), action.peer))
            else:
                buffer = torch.empty(
                    self._boundary_shape(step, action.microbatch),
                    dtype=self.dtype,
                    device=self.device,
                )
                ops.append(comm.P2P("recv", buffer, action.peer))
                received.append((action.kind, key, buffer))
        # Sends already delivered let go of their tensors (a gradient sent back would
        # otherwise stay alive until the end of the step).
        self._sends = [(h, t) for h, t in self._sends if not h.is_completed()]
        handles = comm.batch_p2p(ops, self.group)
        # gloo gives one handle per op; NCCL one for the whole coalesced batch.
        per_op = handles if len(handles) == len(ops) else [_Batch(handles)] * len(ops)
        for op, handle in zip(ops, per_op):
            if op.kind == "send":
                self._sends.append((handle, op.tensor))
        recv_handles = [h for op, h in zip(ops, per_op) if op.kind == "recv"]
        for (kind, key, buffer), handle in zip(received, recv_handles):
            step.arriving[(kind, key)] = handle  # waited by the compute that reads it
            if kind == RECV_F:
                step.inputs[key] = buffer.requires_grad_(step.train)
            else:
                assert kind == RECV_B
                step.grad_outputs[key] = buffer

    @staticmethod
    def _await(step: _Step, kind: str, key: tuple[int, int]) -> None:
        """Wait for the receive of (kind, key), if its tensor came over the wire."""
        handle = step.arriving.pop((kind, key), None)
        if handle is not None:
            handle.wait()

    def _finish_sends(self) -> None:
        """Wait for the sends still in flight (their tensors were kept alive until now)."""
        for handle, _ in self._sends:
            handle.wait()
        self._sends.clear()

    # --- helpers ------------------------------------------------------------------------------
    def _boundary_shape(self, step: _Step, microbatch: int) -> tuple[int, int, int]:
        batch, seq = step.micro_batches[microbatch][0].shape
        return batch, seq // self.seq_split, self.hidden

    def _loss(self, step: _Step) -> torch.Tensor:
        if step.loss is None:
            return torch.zeros((), device=self.device)
        return step.loss.float()

    def _record(self, output: torch.Tensor, params: list) -> None:
        if self._recording is not None and output.requires_grad:
            self._recording.append((output, [p for p in params if p.requires_grad]))

    def _record_module(self, module: nn.Module, args, output) -> None:
        if isinstance(output, (tuple, list)) and output:
            # A module returning several tensors computes the others from its first (the MoE
            # router: logits, then scores and weights from them): the gradient at the first
            # gathers every path to its weight. Left out, the weight would get no gradient.
            output = output[0]
        if self._recording is not None and isinstance(output, torch.Tensor):
            self._record(output, list(module.parameters(recurse=False)))
