"""Tensor-parallel serving: one scheduler on rank 0, the model's shards on every rank.

The model is sharded by the training engine's own tensor parallelism (parallel/tensor.py:
q/k/v and gate/up column-parallel by heads and rows, o/down row-parallel, the embedding and
the head split over the vocabulary), so each rank holds 1/tp of every linear and the keys and
values of its own kv heads (max(1, kv_heads / tp) of them, vLLM's `get_num_kv_heads`) in a
paged pool with the same block ids as every other rank. Only the worker loop is new.

Following vLLM v1 (`SchedulerOutput`, `MultiprocExecutor`), rank 0 owns the scheduler and
sends each step to the others once: a request the workers have not seen goes in full (its
tokens and block table), one they know goes as a diff (tokens appended since, blocks
appended since, or its whole table again when a block was swapped: copy-on-write or a
preemption that reallocated it), plus the block copies and the ids of finished requests to
forget. Every rank then runs the same forward (two all-reduces per layer inside it, as in
training) and the vocabulary shards of the sampled positions' logits are all-gathered, so
rank 0 samples from the full logits exactly as a single device does.

A step that fails on rank 0 before its message goes out fails its requests and serving goes
on; one that fails after it (rank 0's forward, a worker gone) ends the server with exit 1,
/health 503 in the meantime: the ranks can no longer be known to be in step.

The control messages (pickled, two broadcasts: length then bytes) go over a gloo group of
their own, so on CUDA the model's NCCL group carries only tensors; the group waits without
a deadline, as a worker of an idle server waits for the next step.

    fivefold serve --checkpoint runs/default/checkpoints --tp 2      # serve spawns rank 1
    fivefold launch --nproc-per-node 2 serve --checkpoint ... --tp 2 # ranks from torchrun
"""

from __future__ import annotations

import os
import pickle
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from fivefold.parallel import comm
from fivefold.parallel.comm import Group
from fivefold.serve.kv_cache import PagedKVCache
from fivefold.serve.runner import ModelRunner, StepLogits
from fivefold.serve.scheduler import SchedulerOutput

# An idle server sends nothing for as long as no request comes: the control group's waits
# must outlast any idle spell (gloo takes a timeout per group; a week stands for "none").
IDLE_TIMEOUT = timedelta(days=7)


@dataclass
class StepRequest:
    request_id: str
    new_token_ids: list[int]  # tokens appended since the last message (all, for a new one)
    block_ids: list[int]  # blocks appended since, or the whole table when `replace`
    replace: bool
    num_computed_tokens: int
    num_new: int
    adapter: int = -1  # the LoRA adapter's index (serve/lora_batch.py), -1: the base


@dataclass
class StepMessage:
    requests: list[StepRequest] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)


@dataclass(eq=False)
class MirrorRequest:
    """A worker's copy of what a request needs for the forward (cf. serve/request.py)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    adapter: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class MirrorTables:
    """The block tables as rank 0 last sent them: what ModelRunner reads of a KV manager."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def block_ids(self, request_id: str) -> list[int]:
        return self.tables[request_id]


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """kv heads split over tp, each replicated when there are fewer heads than ranks."""
    return max(num_kv_heads // tp, 1)


class RanksOutOfStep(BaseException):
    """A step failed on rank 0 after its message reached the workers. Not an Exception:
    the engine does not fail the step's requests and go on (the next step would meet the
    workers in another collective); the serving loop dies, every open request ends with an
    error, /health answers 503 and `fivefold serve` exits 1 (serve/openai/serving.py)."""


class TPModelRunner(ModelRunner):
    """The runner of every rank: the forward on this rank's shards, then the vocabulary
    shards of the sampled positions' logits gathered into the full (n, V) logits."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, kv, group: Group):
        super().__init__(model, cache, kv)
        self.group, self.vocab_size = group, model.cfg.vocab_size

    def finish_logits(self, local: torch.Tensor) -> torch.Tensor:
        return gather_vocab(local, self.group, self.vocab_size)


def gather_vocab(local: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
    """The full (n, V) logits from every rank's (n, V/tp) vocabulary shard."""
    rows, width = local.shape
    if rows == 0:  # a step of prefill chunks only (the same on every rank)
        return local.new_zeros(0, vocab_size)
    pieces = local.new_empty(group.size * rows * width)
    comm.all_gather(pieces, local.contiguous().view(-1), group)
    full = pieces.view(group.size, rows, width).transpose(0, 1).reshape(rows, -1)
    return full[:, :vocab_size]  # padding rows of the vocabulary split dropped


class TPDriverRunner(TPModelRunner):
    """Rank 0's runner: sends the step to the workers, then runs it as they do."""

    def __init__(self, model, cache, kv, group: Group, control: Group, scheduler):
        super().__init__(model, cache, kv, group)
        self.control, self.scheduler = control, scheduler
        self._sent: dict[str, list] = {}  # request id -> [tokens sent, block table sent]
        self.broken: str | None = None  # why the ranks are out of step; None while in step

    def encode(self, out: SchedulerOutput) -> StepMessage:
        """The step's message; what was sent is recorded only once the whole message is
        built (an error here leaves the record as the workers know it)."""
        msg = StepMessage(copies=list(out.copies))
        live = self.scheduler.requests
        msg.forget = [rid for rid in self._sent if rid not in live]
        sent_before = self._sent
        self._sent = {rid: v for rid, v in self._sent.items() if rid in live}
        try:
            self._encode_requests(out, msg)
        except BaseException:
            self._sent = sent_before
            raise
        return msg

    def _encode_requests(self, out: SchedulerOutput, msg: StepMessage) -> None:
        for request, num_new in out.scheduled:
            rid = request.request_id
            tokens, table = request.all_token_ids, list(self.kv.block_ids(rid))
            sent = self._sent.get(rid)
            if sent is None:
                msg.requests.append(StepRequest(rid, tokens, table, True,
                                                request.num_computed_tokens, num_new))
                self._sent[rid] = [len(tokens), table]
                continue
            known = sent[1]
            replace = table[:len(known)] != known
            blocks = table if replace else table[len(known):]
            msg.requests.append(StepRequest(rid, tokens[sent[0]:], blocks, replace,
                                            request.num_computed_tokens, num_new))
            self._sent[rid] = [len(tokens), table]

    def execute(self, out: SchedulerOutput) -> StepLogits:
        """A failure before the message goes out fails the step's requests (the engine
        goes on: no rank has seen the step). One after it may leave the workers inside a
        collective rank 0 never joins: `RanksOutOfStep` then ends the server."""
        if self.broken is not None:
            raise RanksOutOfStep(self.broken)
        msg = self.encode(out)
        try:
            send_object(msg, self.control)
            return super().execute(out)
        except Exception as e:
            self.broken = (f"a tensor-parallel step failed after it reached the workers, "
                           f"so the ranks are out of step ({type(e).__name__}: {e})")
            raise RanksOutOfStep(self.broken) from e

    def close(self) -> None:
        """Tell the workers to leave their loop (not once the ranks are out of step: they
        are not listening; they end with this process)."""
        if self.broken is None:
            send_object(None, self.control)


def send_object(obj, group: Group) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    comm.broadcast(torch.tensor([data.numel()], dtype=torch.long), 0, group)
    comm.broadcast(data, 0, group)


def receive_object(group: Group):
    size = torch.zeros(1, dtype=torch.long)
    comm.broadcast(size, 0, group)
    data = torch.empty(int(size), dtype=torch.uint8)
    comm.broadcast(data, 0, group)
    return pickle.loads(data.numpy().tobytes())


class TPWorker:
    """Ranks 1..tp-1: apply each step message to the mirrors and run the same forward."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, group: Group, control: Group):
        self.tables = MirrorTables()
        self.requests: dict[str, MirrorRequest] = {}
        self.runner = TPModelRunner(model, cache, self.tables, group)
        self.control = control
        self.num_steps = 0

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        for rid in msg.forget:
            self.requests.pop(rid, None)
            self.tables.tables.pop(rid, None)
        out = SchedulerOutput(copies=msg.copies)
        for item in msg.requests:
            request = self.requests.get(item.request_id)
            if request is None:
                request = self.requests[item.request_id] = MirrorRequest(item.request_id, [])
            request.all_token_ids.extend(item.new_token_ids)
            request.num_computed_tokens = item.num_computed_tokens
            request.adapter = item.adapter
            if item.replace:
                self.tables.tables[item.request_id] = list(item.block_ids)
            else:
                self.tables.tables[item.request_id].extend(item.block_ids)
            out.scheduled.append((request, item.num_new))
        return out

    def run(self) -> None:
        while (msg := receive_object(self.control)) is not None:
            self.runner.execute(self.apply(msg))
            self.num_steps += 1


@dataclass
class TPGroups:
    model: Group  # the tensor-parallel group of the model (gloo on CPU, NCCL on CUDA)
    control: Group  # gloo, for the step messages
    dims: object  # the ParallelDims the model was sharded with


def tp_groups(tp: int) -> TPGroups:
    """The groups of a tp-rank serving world (call on every rank, in an initialised world)."""
    from fivefold.parallel.mesh import ParallelDims

    dims = ParallelDims(tp=tp, rank=dist.get_rank())
    dims.build_groups()
    pg = dist.new_group(list(range(tp)), backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroups(dims["tp"], Group("tp_control", list(range(tp)), pg, dims.ledger), dims)


def check_tp(cfg, tp: int) -> None:
    """The splits parallel/tensor.py makes, checked before any rank starts (one line)."""
    from fivefold.errors import ConfigError

    for what, size in (("num_heads", cfg.num_heads), ("intermediate_size",
                                                      cfg.intermediate_size)):
        if size % tp:
            raise ConfigError(f"--tp {tp} does not divide the model's {what} = {size}; pick a "
                              f"--tp that divides it")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(f"--tp {tp} and the model's {cfg.num_kv_heads} kv heads: one must "
                          f"divide the other; pick another --tp")
    if -(-cfg.vocab_size // tp) * (tp - 1) >= cfg.vocab_size:
        raise ConfigError(f"--tp {tp} is too many for a vocabulary of {cfg.vocab_size}")


def shard_model(model: nn.Module, groups: TPGroups) -> nn.Module:
    """This rank's shard of a loaded model, by the training engine's tensor parallelism."""
    from fivefold.parallel.tensor import apply_tensor_parallel

    return apply_tensor_parallel(model, groups.dims, sp=False).eval()


def worker_cache(model: nn.Module, num_blocks: int, block_size: int, tp: int) -> PagedKVCache:
    cfg, param = model.cfg, next(model.parameters())
    return PagedKVCache(cfg.num_layers, kv_heads_per_rank(cfg.num_kv_heads, tp),
                        cfg.dim_per_head, num_blocks, block_size, param.dtype, param.device)


def driver_engine(model: nn.Module, groups: TPGroups, **engine_kwargs):
    """Rank 0: an `Engine` over this rank's shard whose steps reach every rank. The block
    count (from the budget, per rank: each holds its kv heads' share of every block) goes
    to the workers first; a bad setting ends them too before it is raised here."""
    from fivefold.serve.engine import Engine

    tp = groups.model.size
    try:
        engine = Engine(model, num_kv_heads=kv_heads_per_rank(model.cfg.num_kv_heads, tp),
                        **{**engine_kwargs, "prepack": False})
    except BaseException:
        send_object(None, groups.control)
        raise
    send_object((engine.num_blocks, engine.cache.block_size), groups.control)
    engine.runner = TPDriverRunner(model, engine.cache, engine.kv, groups.model,
                                   groups.control, engine.scheduler)
    return engine


def run_worker(model: nn.Module, groups: TPGroups) -> int:
    """Ranks 1..tp-1: serve steps until rank 0 says stop; returns the steps run."""
    setup = receive_object(groups.control)
    if setup is None:
        return 0
    cache = worker_cache(model, *setup, groups.model.size)
    worker = TPWorker(model, cache, groups.model, groups.control)
    worker.run()
    return worker.num_steps


# --- processes -------------------------------------------------------------------------
def start_world(tp: int, backend: str, worker_fn, worker_args: tuple):
    """Rank 0 is this process; ranks 1..tp-1 are spawned (a fresh interpreter each: safe
    with CUDA and with this process's threads) and meet it through a file:// rendezvous.
    Returns the worker processes."""
    import torch.multiprocessing as mp

    init_dir = tempfile.mkdtemp(prefix="fivefold-tp-")
    init = f"file://{os.path.join(init_dir, 'rendezvous')}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(rank, tp, backend, init, worker_fn,
                                                worker_args), daemon=True)
             for rank in range(1, tp)]
    for proc in procs:
        proc.start()
    dist.init_process_group(backend, init_method=init, rank=0, world_size=tp,
                            timeout=timedelta(seconds=600))
    return procs


def _die_with_parent() -> None:
    """Linux: end this worker when rank 0's process ends, however it ends (a worker blocked
    in a rendezvous would otherwise wait out its timeout as an orphan)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent ended before the line above
        os._exit(1)


def _spawned(rank, tp, backend, init, worker_fn, worker_args) -> None:
    _die_with_parent()
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp,
                            timeout=timedelta(seconds=600))
    worker_fn(rank, *worker_args)
    dist.destroy_process_group()


def threads_per_rank(tp: int) -> int:
    """The cores this process may use, shared among the ranks of one machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cores // tp))
