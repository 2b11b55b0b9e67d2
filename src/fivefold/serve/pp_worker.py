"""Pipeline-parallel serving: the layers in stages on pp ranks, each holding its layers' K/V.

    fivefold serve --checkpoint runs/default/checkpoints --pp 2

Rank 0 runs HTTP, the scheduler and the first stage (the embedding and its layers); rank s
runs layers `stage_bounds(cfg, pp)[s]` (runs of layers balanced by the weights a decode step
reads), the last one also the final norm and the head. Every rank keeps a paged pool of
the same block ids for its own layers only, sized from the budget for the largest stage
(what `fivefold plan --serve --pp` counts, plan/serve.py).

Each step goes to the workers once, as under tensor parallelism (serve/tp_worker.py: the
same diff of tokens and block tables, on a gloo group of its own), with how the step's
sequences are cut into micro-batches: up to pp runs of consecutive sequences, balanced by
tokens. Then each rank runs its stage on micro-batch 0, 1, ... in turn, receiving each
micro-batch's hidden states from the rank before and sending them on (isend: it goes on to
the next micro-batch at once), so while stage 1 runs micro-batch 0, stage 0 already runs
micro-batch 1: the stages overlap within a step, as vLLM's virtual engines overlap theirs.
The last stage sends the sampling positions' fp32 logits to rank 0, which samples exactly
as a single device does. Layer by layer the arithmetic is a single device's on a smaller
batch; greedy tokens equal `--pp 1`'s (tests/test_serve_pp.py, through the HTTP server).

With --tp M each stage is a tensor-parallel group of M ranks (pp · M in all, laid out as
training lays them, parallel/mesh.py: tp fastest, stage s on ranks s·M .. s·M + M − 1):
every rank of a stage holds 1/M of its layers' linears (parallel/tensor.py, as --tp alone)
and its kv heads' share of its layers' blocks. Rank t of stage s sends its hidden states to
rank t of stage s + 1 (after a row-parallel linear every rank of a stage has them whole);
the last stage gathers the vocabulary shards of the logits and its first rank sends them
to rank 0.

With --lora each stage holds its own layers' adapter factors (the head's on the last
stage): rank 0 puts each step's sequences in adapter order (as serve/lora_batch.py does),
the step message carries each one's adapter, and every stage groups the rows of each
micro-batch by adapter for its layers. Not with --tp as well (adapters are not sharded).

Each rank loads the whole model (or its tp shard), then frees the weights its stage never
runs (`release_others`): it holds its layers, the first stage the embedding, the last the
final norm and the head.

Not (yet) with --dp: one line, exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fivefold.errors import ConfigError
from fivefold.parallel.comm import Group
from fivefold.plan.serve import pp_stage_bounds
from fivefold.serve.fused import FusedLlama, fusable
from fivefold.serve.kv_cache import PagedKVCache
from fivefold.serve.runner import ModelRunner, StepLogits
from fivefold.serve.scheduler import SchedulerOutput
from fivefold.serve.tp_worker import (
    IDLE_TIMEOUT,
    MirrorTables,
    RanksOutOfStep,
    TPDriverRunner,
    TPWorker,
    gather_vocab,
    kv_heads_per_rank,
    receive_object,
    send_object,
)


def stage_bounds(cfg, pp: int) -> list[tuple[int, int]]:
    """(first, end) layers of each stage: balanced by the weights a decode step reads, the
    head counted on the last stage (plan/serve.py's `pp_stage_bounds`, which the planner's
    block count uses too)."""
    return pp_stage_bounds(cfg, pp)


def check_pp(pp: int, tp: int = 1, dp: int = 1, num_layers: int | None = None) -> None:
    """--pp against the other options, and (once the model is loaded) its layers."""
    if pp < 1:
        raise ConfigError(f"--pp {pp} must be >= 1")
    if num_layers is not None and pp > num_layers:
        raise ConfigError(f"--pp {pp} is more stages than the model's {num_layers} layers; "
                          f"use --pp {num_layers} or fewer")
    if pp > 1 and dp > 1:
        raise ConfigError("--pp with --dp is not supported yet; use one of them")


def micro_batches(num_tokens: list[int], pp: int) -> list[int]:
    """Sizes (in sequences) of up to pp runs of consecutive sequences, each about an equal
    share of the tokens, none empty."""
    n = len(num_tokens)
    parts = min(pp, n)
    if parts <= 1:
        return [n] if n else []
    total, sizes, count, acc = sum(num_tokens), [], 0, 0
    for i, t in enumerate(num_tokens):
        count, acc = count + 1, acc + t
        left = n - i - 1  # sequences after this one
        need = parts - len(sizes) - 1  # runs still to open after this one
        if need and (acc * parts >= total * (len(sizes) + 1) or left == need):
            sizes.append(count)
            count = 0
    sizes.append(count) if count else None
    return sizes


class StageForward:
    """One stage of the model: the fused forward's layers where the model fuses (serve/
    fused.py), else the modules'."""

    def __init__(self, model: nn.Module, first: int, end: int, stage: int, stages: int):
        self.model, self.first, self.end = model, first, end
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.fused = FusedLlama(model) if fusable(model) is None else None

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, cache, positions, logits_index) -> torch.Tensor:
        """x: (1, T) ids on the first stage, else (T, hidden) from the stage before; returns
        (T, hidden), or on the last stage the (n, V) logits of `logits_index`."""
        m, f = self.model, self.fused
        if f is not None:
            h = f.embed_tokens(x) if self.is_first else x
            h = f.layers_forward(h, positions, cache, self.first, self.end)
            return f.logits(h, logits_index)[0] if self.is_last else h
        h = m.embed_tokens(x) if self.is_first else x[None]
        cos, sin = m.rotary(positions, h.dtype)
        for j, i in enumerate(range(self.first, self.end)):
            h = m.layers[i](h, cos, sin, cache, j, 0)
        return m.logits(h[:, logits_index])[0] if self.is_last else h[0]


def release_others(model: nn.Module, forward: StageForward) -> int:
    """Free the weights this stage never runs (other stages' layers, the embedding off the
    first stage, the final norm and the head off the last; a tied embedding stays where
    either runs): each keeps a zero-size tensor of its dtype. Returns the bytes freed."""
    keep = {id(p) for i in range(forward.first, forward.end)
            for p in model.layers[i].parameters()}
    if forward.is_first:
        keep.update(id(p) for p in model.embed_tokens.parameters())
    if forward.is_last:
        keep.update(id(p) for p in model.norm.parameters())
        keep.add(id(model.output_weight()))
    freed = 0
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in keep and p.numel():
                freed += p.numel() * p.element_size()
                p.data = p.data.new_empty(0)
    f = forward.fused
    if f is not None:  # its fused q/k/v and gate/up tensors go with the layers
        f.layers = [layer if forward.first <= i < forward.end else None
                    for i, layer in enumerate(f.layers)]
    return freed


class PPStageRunner(ModelRunner):
    """Any rank's stage over a step's micro-batches: receive, run, send on."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, kv, groups: PPGroups,
                 bounds: list[tuple[int, int]]):
        super().__init__(model, cache, kv)
        stage = groups.stage
        self.group, self.tp, self.stage, self.stages = groups.pipe, groups.tp, stage, len(bounds)
        self.forward = StageForward(model, *bounds[stage], stage, len(bounds))
        self.freed_bytes = release_others(model, self.forward)
        self.hidden, self.dtype = model.cfg.hidden_size, next(model.parameters()).dtype
        self.vocab_size = model.cfg.vocab_size
        # the rank that sends the logits to rank 0: the last stage's first tp rank
        self.sends_logits = self.forward.is_last and groups.tp_rank == 0
        # LoRA (serve/lora_batch.py): this stage's adapters, and each scheduled item's
        # adapter index (a worker's mirror carries it; rank 0 sets its own from the name)
        self.adapter_of = lambda item: item[0].adapter

    def run_stage(self, out: SchedulerOutput, sizes: list[int]) -> list[tuple[list[str],
                                                                              torch.Tensor]]:
        """This stage on each micro-batch; on the last stage, each one's logits."""
        if out.copies:
            self.cache.copy_blocks(out.copies)
        results, sends, first = [], [], 0
        prev, nxt = self.group.global_rank(self.stage - 1), None
        if self.stage + 1 < self.stages:
            nxt = self.group.global_rank(self.stage + 1)
        for size in sizes:
            part = SchedulerOutput(scheduled=out.scheduled[first:first + size])
            first += size
            step = self.prepare(part)
            if step.batch.stale_slots is not None:
                self.cache.clear_slots(step.batch.stale_slots)
            if self.forward.is_first:
                x = step.tokens
            else:
                x = torch.empty(step.positions.shape[0], self.hidden, dtype=self.dtype,
                                device=self.device)
                dist.recv(x, prev, group=self.group.pg)
            self.cache.batch = step.batch
            if self.adapters is not None:  # each adapter's rows in this micro-batch
                self.adapters.group_rows(part.scheduled, self.adapter_of)
            try:
                y = self.forward(x, self.cache, step.positions, step.sample_rows)
            finally:
                self.cache.batch = None
                if self.adapters is not None:
                    self.adapters.end_step()
            if nxt is not None:
                sends.append((dist.isend(y.contiguous(), nxt, group=self.group.pg), y))
            else:  # the vocabulary shards gathered in the stage's tp group
                if self.tp is not None:
                    y = gather_vocab(y, self.tp, self.vocab_size)
                results.append((step.sample_ids, y.float()))
        for handle, _ in sends:
            handle.wait()
        return results


class PPDriverRunner(TPDriverRunner):
    """Rank 0: sends the step (and its micro-batches) to the workers, runs stage 0, and
    receives every micro-batch's logits from the last stage."""

    def __init__(self, stage: PPStageRunner, control: Group, scheduler):
        ModelRunner.__init__(self, stage.model, stage.cache, stage.kv)
        self.stage_runner, self.control, self.scheduler = stage, control, scheduler
        self._sent = {}
        self.broken: str | None = None  # why the ranks are out of step (as under --tp)

    def execute(self, out: SchedulerOutput) -> StepLogits:
        """As under --tp: a failure before the message goes out fails the step's requests
        (no rank has seen it); one after it (this stage, a worker gone, the logits not
        coming) may leave the workers waiting for hidden states rank 0 never sends:
        `RanksOutOfStep` then ends the server."""
        if self.broken is not None:
            raise RanksOutOfStep(self.broken)
        adapters = self.stage_runner.adapters
        if adapters is not None:  # each adapter's sequences one run (a stable sort, as
            # lora_batch.py's begin_step): in every micro-batch its rows are one slice
            out = SchedulerOutput(sorted(out.scheduled, key=adapters.key), out.preempted,
                                  out.copies)
        sizes = micro_batches([n for _, n in out.scheduled], self.stage_runner.stages)
        cache = self.stage_runner.cache
        if cache.fp8 and not all(cache.scale_set["k"]):
            # FP8 scales set on the fly by a layer's first write (serve/kv_cache.py): on one
            # device from the whole first step's tokens, so here too (every stage writes
            # all its layers in every step: one step sets them all)
            sizes = [len(out.scheduled)]
        msg = self.encode(out)
        if adapters is not None:
            for item, scheduled in zip(msg.requests, out.scheduled, strict=True):
                item.adapter = adapters.key(scheduled)
        try:
            send_object((msg, sizes), self.control)
            return self._run(out, sizes)
        except Exception as e:
            self.broken = (f"a pipeline-parallel step failed after it reached the workers, "
                           f"so the ranks are out of step ({type(e).__name__}: {e})")
            raise RanksOutOfStep(self.broken) from e

    def _run(self, out: SchedulerOutput, sizes: list[int]) -> StepLogits:
        self.stage_runner.run_stage(out, sizes)
        ids, rows, first = [], [], 0
        last = self.stage_runner.group.global_rank(self.stage_runner.stages - 1)
        for size in sizes:  # the last stage's logits, micro-batch by micro-batch
            part = out.scheduled[first:first + size]
            first += size
            sample = [r.request_id for r, n in part if r.num_computed_tokens + n ==
                      r.num_tokens]
            if sample:
                x = torch.empty(len(sample), self.stage_runner.vocab_size,
                                device=self.device)
                dist.recv(x, last, group=self.stage_runner.group.pg)
                ids += sample
                rows.append(x)
        return StepLogits(ids, torch.cat(rows) if rows else
                          torch.zeros(0, self.stage_runner.vocab_size, device=self.device))


class PPWorker:
    """Ranks 1..pp-1: mirror each step (as a tensor-parallel worker does) and run the
    stage; the last stage sends the logits to rank 0."""

    apply = TPWorker.apply

    def __init__(self, stage: PPStageRunner, control: Group):
        self.tables, self.requests = stage.kv, {}
        self.stage, self.control, self.num_steps = stage, control, 0

    def run(self) -> None:
        while (msg := receive_object(self.control)) is not None:
            step, sizes = msg
            results = self.stage.run_stage(self.apply(step), sizes)
            for ids, logits in results:
                if ids and self.stage.sends_logits:
                    dist.send(logits.contiguous(), 0, group=self.stage.group.pg)
            self.num_steps += 1


@dataclass
class PPGroups:
    pipe: Group  # this rank's pipeline: one rank of each stage (hidden states, logits)
    control: Group  # gloo, every rank: the step messages
    tp: Group | None  # this rank's stage as a tensor-parallel group (None without --tp)
    dims: object  # the ParallelDims of the world (tp_worker.shard_model shards by it)
    stage: int
    tp_rank: int

    @property
    def world_size(self) -> int:
        return self.dims.world_size


def pp_groups(pp: int, tp: int = 1) -> PPGroups:
    """The groups of a pp · tp serving world (call on every rank of an initialised world,
    in the same order): ranks laid out as training lays them (parallel/mesh.py)."""
    from fivefold.parallel.mesh import ParallelDims

    dims = ParallelDims(tp=tp, pp=pp, rank=dist.get_rank())
    dims.build_groups()
    ranks = list(range(pp * tp))
    control = Group("pp_control", ranks, dist.new_group(ranks, backend="gloo",
                                                        timeout=IDLE_TIMEOUT), dims.ledger)
    return PPGroups(dims["pp"], control, dims["tp"] if tp > 1 else None, dims,
                    dims.pp_rank, dims.tp_rank)


def _tp_size(groups: PPGroups) -> int:
    return 1 if groups.tp is None else groups.tp.size


def driver_engine(model: nn.Module, pp: int, groups: PPGroups, adapters=None,
                  **engine_kwargs):
    """Rank 0's Engine: blocks counted for the largest stage (this rank's kv heads' share
    of them under --tp), then its own stage's pool; the block count goes to the workers
    first (None if the engine cannot be built). Afterwards `model` holds the first stage's
    weights alone (`release_others`), as each worker's holds its stage's. `adapters`: the
    AdapterSet of stage 0's LoRA factors (`stage_model`), whose names requests may give."""
    from fivefold.serve.engine import Engine

    control = groups.control
    bounds = stage_bounds(model.cfg, pp)
    largest = max(end - first for first, end in bounds)
    heads = kv_heads_per_rank(model.cfg.num_kv_heads, _tp_size(groups))
    try:
        engine = Engine(model, num_layers=largest, num_kv_heads=heads,
                        **{**engine_kwargs, "prepack": False, "fuse": False})
    except BaseException:
        send_object(None, control)
        raise
    cache = engine.cache
    first, end = bounds[0]
    if end - first != largest:
        cache = engine.cache = PagedKVCache(
            end - first, cache.k.shape[2], cache.k.shape[3], engine.num_blocks,
            cache.block_size, next(model.parameters()).dtype, engine.device, cache.k.dtype)
    send_object((engine.num_blocks, cache.block_size, cache.k.dtype), control)
    stage = PPStageRunner(model, cache, engine.kv, groups, bounds)
    if adapters is not None:
        engine.adapters = stage.adapters = adapters
        stage.adapter_of = adapters.key
    engine.runner = PPDriverRunner(stage, control, engine.scheduler)
    return engine


def run_worker(model: nn.Module, pp: int, groups: PPGroups, adapters=None) -> int:
    """Every rank but 0: serve steps until rank 0 says stop; returns the steps run."""
    setup = receive_object(groups.control)
    if setup is None:
        return 0
    num_blocks, block_size, store = setup
    bounds = stage_bounds(model.cfg, pp)
    first, end = bounds[groups.stage]
    cfg, param = model.cfg, next(model.parameters())
    cache = PagedKVCache(end - first, kv_heads_per_rank(cfg.num_kv_heads, _tp_size(groups)),
                         cfg.dim_per_head, num_blocks, block_size, param.dtype, param.device,
                         store)
    tables = MirrorTables()
    stage = PPStageRunner(model, cache, tables, groups, bounds)
    stage.adapters = adapters
    worker = PPWorker(stage, groups.control)
    worker.run()
    return worker.num_steps


# --- a worker rank of the server (serve/openai/backends.py `_start_pp` starts them) -----
def stage_adapters(model: nn.Module, pp: int, groups: PPGroups, adapters):
    """Wrap this stage's linears with its share of the adapters (lora_batch.py
    `stage_adapter`: its layers' factors, the head's on the last stage); their AdapterSet."""
    from fivefold.serve.lora_batch import apply_adapters, check_adapters, stage_adapter

    check_adapters(model, adapters)  # the whole model's fit, on every rank alike
    first, end = stage_bounds(model.cfg, pp)[groups.stage]
    last = groups.stage == pp - 1
    return apply_adapters(model, [stage_adapter(a, first, end, last) for a in adapters])


def load_adapters(args) -> list:
    from fivefold.serve.lora_batch import load_adapter

    return [load_adapter(*spec.split("=", 1)) for spec in args.lora]


def stage_model(args, loaded=None, adapters=None):
    """(this rank's model: the whole one, or its tp shard under --tp; codec; groups; its
    stage's AdapterSet or None), after the checks rank 0 makes too (a ConfigError here is
    one line on rank 0)."""
    from fivefold.serve.tp_worker import check_tp, shard_model
    from fivefold.train.generate import load_for_generation

    model, codec = loaded or load_for_generation(args)
    check_pp(args.pp, args.tp, args.dp, model.cfg.num_layers)
    if args.tp > 1:
        check_tp(model.cfg, args.tp)
    if args.lora and adapters is None:
        adapters = load_adapters(args)
    groups = pp_groups(args.pp, args.tp)
    model = shard_model(model, groups) if args.tp > 1 else model.eval()
    staged = stage_adapters(model, args.pp, groups, adapters) if adapters else None
    return model, codec, groups, staged


def _worker(rank: int, args) -> None:
    import signal

    from fivefold.serve.tp_worker import threads_per_rank

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads_per_rank(args.pp * args.tp))
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        model, _, groups, adapters = stage_model(args)
    except ConfigError:
        raise SystemExit(2) from None  # rank 0 checks the same and says it in one line
    run_worker(model, args.pp, groups, adapters)
