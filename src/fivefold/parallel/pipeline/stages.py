"""Cut the plain model into pipeline stages that keep their logical parameter names.

A model of L blocks becomes S = pp · v stages (v chunks per rank; DualPipeV always has 2).
Stage s holds a contiguous run of blocks; the embedding lives on stage 0, the final norm,
the head and the loss on stage S-1. Each stage is a `PipelineStage` module whose parameters
are named as in the unsplit model (`layers.5.self_attn.q_proj.weight` via an `nn.ModuleDict`
keyed by the block's original index, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`),
so `models.init.materialize` draws the same initial values a single device would, and
checkpoints stay layout-independent without any renaming.

Which stages a rank holds comes from the schedule itself (`Schedule.stage_of`), so the
"loop" layout (stage s on rank s % pp) and DualPipeV's "v" layout (rank r holds stages r
and 2pp-1-r) need no special cases here.

Tied embeddings (lm_head is embed_tokens): the first and the last stage each hold a copy
named `embed_tokens.weight`. Both are drawn from that one name, so they start equal; the
runner sums their gradients over the two ranks before the optimizer step (Megatron-LM's
embedding group, Narayanan et al. 2021 sec. 3), so they stay equal; and they are tagged
`_pp_replicas = 2` so the global gradient norm counts the tensor once
(`train.optim.norm_share`). Under DualPipeV the first and last stage are both on rank 0:
the two chunks then share the one module and nothing needs syncing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.parallel.pipeline.schedules import Schedule, build_schedule
from fivefold.plan.split import split_costs, stage_layer_counts


def chunks_per_rank(cfg) -> int:
    """Model chunks per pipeline rank: DualPipeV's V has two, interleaving has v."""
    par = cfg.parallel
    if par.schedule == "dualpipev":
        return 2
    return par.virtual_stages if par.schedule == "interleaved" else 1


def schedule_for(cfg, num_microbatches: int) -> Schedule:
    return build_schedule(
        cfg.parallel.schedule, cfg.parallel.pp, num_microbatches, chunks_per_rank(cfg)
    )


def layer_ranges(num_layers: int, num_stages: int,
                 counts: tuple[int, ...] | None = None) -> list[range]:
    """Contiguous runs of blocks, `counts` per stage or the even split: floor or ceil of
    L / S each, the spare blocks on the middle stages (the first also runs the embedding,
    the last the head and the loss). The split itself is `plan.split.stage_layer_counts`,
    which the planner calls too."""
    counts = counts or stage_layer_counts(num_layers, num_stages)
    ranges, start = [], 0
    for size in counts:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_counts(cfg, num_layers: int) -> tuple[int, ...]:
    """Layers per stage under `parallel.pp_split` / `parallel.pp_layers`."""
    par = cfg.parallel
    stages = par.pp * chunks_per_rank(cfg)
    model = cfg.model.resolve()
    return stage_layer_counts(num_layers, stages, par.pp_split, tuple(par.pp_layers),
                              *split_costs(model))


class PipelineStage(nn.Module):
    """A run of blocks of the plain model; the first also embeds, the last also scores.

    forward(x, targets): x is token ids on the first stage and hidden states elsewhere.
    The last stage returns the summed fp32 loss (as `Llama.forward`) when given targets,
    else the logits; the others return hidden states.
    """

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        self.layer_ids = list(layers)
        self.rotary = model.rotary
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        tied = model.lm_head is None
        if first or (last and tied):
            self.embed_tokens = model.embed_tokens
        if last:
            self.norm = model.norm
            if not tied:
                self.lm_head = model.lm_head
            self.loss_fn = model.loss_fn
        # Set by the runner under a split backward: called with (tensor, params) for each
        # weight use that is not a module call (the head's F.linear), see runtime.py.
        self.record = None
        # Set by the runner for a forward whose backward is split (B now, W later).
        self.split_weight_pass = False

    def output_weight(self) -> torch.Tensor:
        head = getattr(self, "lm_head", None)
        return self.embed_tokens.weight if head is None else head.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(x) if self.first else x
        # Positions 0..s-1 of the full sequence (tensor parallelism's sequence split is
        # undone inside the attention region, which is where the rotary tables are used).
        positions = torch.arange(x.shape[1] * self._seq_split(), device=x.device)
        cos, sin = self.rotary(positions, h.dtype)
        for i in self.layer_ids:
            h = self.layers[str(i)](h, cos, sin, None, i, 0)
        if not self.last:
            return h
        weight = self.output_weight()
        if targets is not None and not self.split_weight_pass:  # as Llama.forward: chunked
            return self.loss_fn(self.norm(h), weight, targets)
        # A split backward defers the head's weight gradient to its W pass, which needs the
        # logits' gradient: there the logits are materialised.
        logits = F.linear(self.norm(h), weight)  # as Llama.logits
        if self.record is not None:
            self.record(logits, [weight])
        return logits if targets is None else self.loss_fn.from_logits(logits, targets)

    def _seq_split(self) -> int:
        # Token ids arrive whole on the first stage; hidden states between stages carry
        # 1/tp of the sequence under sequence parallelism.
        return 1 if self.first else getattr(self, "sequence_split", 1)


def split_stages(model: nn.Module, dims, cfg) -> list[nn.Module]:
    """This pipeline rank's chunks of a (meta-built, maybe tensor-parallel) model, in chunk
    order: chunk c is stage `schedule.stage_of(pp_rank, c)`."""
    pp, v = cfg.parallel.pp, chunks_per_rank(cfg)
    num_micro = cfg.train.gbs // (cfg.parallel.mbs * cfg.parallel.dp)
    schedule = schedule_for(cfg, num_micro)
    ranges = layer_ranges(len(model.layers), pp * v, stage_counts(cfg, len(model.layers)))
    last = pp * v - 1
    chunks = []
    for chunk in range(v):
        stage = schedule.stage_of(dims.pp_rank, chunk)
        module = PipelineStage(model, ranges[stage], stage == 0, stage == last)
        module.stage_index = stage
        module.sequence_split = cfg.parallel.tp if cfg.parallel.sp else 1
        chunks.append(module)
    return chunks


def tied_across_ranks(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """The embedding copies this rank holds for a tie that spans two ranks (else [])."""
    if not chunks[0].cfg.tie_embeddings:
        return []  # an untied first stage's embedding is its own, not half of a pair
    firsts = [c for c in chunks if c.first]
    lasts = [c for c in chunks if c.last and getattr(c, "lm_head", None) is None]
    if bool(firsts) == bool(lasts):  # neither end, or both on this rank (DualPipeV, pp 1)
        return []
    return [(firsts or lasts)[0].embed_tokens.weight]


def tag_replicas(chunks: list[nn.Module]) -> None:
    """Mark tied-embedding copies (after `materialize`, which makes new Parameters)."""
    for param in tied_across_ranks(chunks):
        param._pp_replicas = 2


def embedding_group(dims, tied: bool):
    """The group of this rank's two tied-embedding holders: the first and last pp rank with
    this rank's dp, cp and tp coordinates. Every rank creates every such group (new_group is
    collective); returns this rank's, or None when it holds no tied copy."""
    import torch.distributed as dist

    from fivefold.parallel.comm import Group

    if not tied or dims.pp == 1 or not dist.is_initialized():
        return None
    grid = dims.grid()
    mine = None
    for rest in grid[0].reshape(-1).tolist():
        coords = dims.coords(rest)
        ranks = [
            int(grid[0, coords["dp"], coords["cp"], coords["tp"]]),
            int(grid[-1, coords["dp"], coords["cp"], coords["tp"]]),
        ]
        pg = dist.new_group(ranks)
        if dims.rank in ranks:
            mine = Group("pp_embed", ranks, pg, dims.ledger)
    return mine
