"""Pipeline placement: which layers and model chunks a pipeline rank holds, how many
micro-batches of activations (and of pending weight gradients) it keeps alive at its peak,
and the bubble of each schedule. Functions of a layout's pp, schedule, virtual stages and
split alone (they read no other field), so any module may ask them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from fivefold.models.presets import ModelConfig
from fivefold.parallel.pipeline.actions import BACKWARD, FORWARD
from fivefold.parallel.pipeline.schedules import interleaved_chunk, interleaved_warmup
from fivefold.plan.split import model_stage_layers, split_costs, stage_layer_counts

if TYPE_CHECKING:  # a layout is read, never built, here: layout.py imports this module
    from fivefold.plan.layout import Layout



def num_chunks(layout: Layout) -> int:
    """Model chunks along the pipeline: pp·v for interleaved, 2·pp for DualPipeV (V shape)."""
    return _num_chunks(layout.pp, layout.schedule, layout.virtual_stages)


def _num_chunks(pp: int, schedule: str, virtual_stages: int) -> int:
    if schedule == "dualpipev" and pp > 1:
        return 2 * pp
    if schedule == "interleaved":
        return pp * virtual_stages
    return pp


def chunk_layer_counts(model: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """Layers per model chunk, from the split the engine uses too (plan/split.py)."""
    return model_stage_layers(model, num_chunks(layout), layout.pp_split, layout.pp_layers)


def _split_key(model: ModelConfig, layout: Layout) -> tuple:
    """What the split depends on, hashable (the costs only matter to the balanced split)."""
    costs = (split_costs(model) if layout.pp_split != "even" and not layout.pp_layers
             else (1.0, 0.0, 0.0))
    return (model.num_layers, layout.pp, layout.schedule, layout.virtual_stages,
            layout.pp_split, layout.pp_layers, costs)


@functools.lru_cache(maxsize=65536)
def _stage(key: tuple, rank: int) -> tuple[int, bool, bool]:
    num_layers, pp, schedule, v, split, layers, costs = key
    counts = stage_layer_counts(num_layers, _num_chunks(pp, schedule, v), split, layers, *costs)
    mine = _rank_chunks(pp, schedule, v, rank)
    return sum(counts[c] for c in mine), 0 in mine, len(counts) - 1 in mine


@functools.lru_cache(maxsize=16384)
def _critical_ranks(key: tuple) -> tuple[int, ...]:
    pp = key[1]
    heaviest = max(range(pp), key=lambda r: _stage(key, r)[0])
    return tuple(sorted({0, pp - 1, heaviest}))


def rank_chunks(layout: Layout, rank: int) -> tuple[int, ...]:
    """Chunk indices pipeline rank `rank` holds (interleaved: r, r+p, …; DualPipeV: r, 2p-1-r)."""
    return _rank_chunks(layout.pp, layout.schedule, layout.virtual_stages, rank)


@functools.lru_cache(maxsize=65536)
def _rank_chunks(pp: int, schedule: str, virtual_stages: int, rank: int) -> tuple[int, ...]:
    if schedule == "dualpipev" and pp > 1:
        return (rank, 2 * pp - 1 - rank)
    per_rank = virtual_stages if schedule == "interleaved" else 1
    return tuple(rank + k * pp for k in range(per_rank))


def stage(model: ModelConfig, layout: Layout, rank: int) -> tuple[int, bool, bool]:
    """(layers, holds the embedding, holds the head) of one pipeline rank."""
    return _stage(_split_key(model, layout), rank)


def layers_on_rank(model: ModelConfig, layout: Layout, rank: int) -> int:
    return stage(model, layout, rank)[0]


def rank_layers(model: ModelConfig, layout: Layout, rank: int) -> list[int]:
    """Indices, in the unsplit model, of the layers pipeline rank `rank` holds."""
    counts = chunk_layer_counts(model, layout)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [i for c in rank_chunks(layout, rank) for i in range(starts[c], starts[c] + counts[c])]


def moe_layers_on_rank(model: ModelConfig, layout: Layout, rank: int) -> int:
    """How many of the rank's layers are mixture-of-experts layers (the rest are dense)."""
    if not model.num_experts:
        return 0
    return sum(model.is_moe_layer(i) for i in rank_layers(model, layout, rank))


def holds_embedding(layout: Layout, rank: int) -> bool:
    return 0 in rank_chunks(layout, rank)


def holds_head(layout: Layout, rank: int) -> bool:
    return num_chunks(layout) - 1 in rank_chunks(layout, rank)


def inflight_microbatches(layout: Layout, num_microbatches: int, rank: int) -> float:
    """Micro-batches' worth of this rank's activations alive at its peak (in units of all
    the rank's layers for one micro-batch).

    AFAB (GPipe) keeps all m; 1F1B keeps min(m, p − r) on rank r (Narayanan et al. 2021 §2.2);
    interleaved follows Megatron's warm-up count (p − r − 1)·2 + (v − 1)·p + 1
    chunk-micro-batches, which on rank 0 is p·(1 + (p − 1)/(p·v)) micro-batches (Korthikanti
    et al. 2022 §4.2.3). ZB-H1 keeps a micro-batch's graph until its W, and the engine's W
    placement lets every rank, not only rank 0, reach 1F1B's rank-0 peak of min(m, p) (Qi et
    al. 2023 bound the peak, not its spread). DualPipeV keeps 2p + 1 half-size chunks, p + 1/2
    micro-batches, on every rank. All of these equal `parallel.pipeline.check.peak_inflight`
    of the schedules the engine runs (docs/pipeline.md; tests/test_plan_flops_comm.py).
    """
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "afab":
        return float(m)
    if layout.schedule == "1f1b":
        return float(min(m, p - rank))
    if layout.schedule == "zb":
        return float(min(m, p))
    if layout.schedule == "interleaved":
        chunk_mbs = min(m * v, (p - rank - 1) * 2 + (v - 1) * p + 1)
        return chunk_mbs / v
    return float(min(m, p + 0.5))  # dualpipev


def inflight_per_chunk(layout: Layout, num_microbatches: int, rank: int,
                       weights: tuple[float, ...]) -> tuple[float, ...]:
    """Per chunk of `rank` (in `rank_chunks` order), the micro-batches whose activations are
    alive at the rank's peak, where a micro-batch of chunk c weighs `weights[c]` (its bytes).

    With one chunk per rank, or chunks of equal weight, every chunk holds the average,
    `inflight_microbatches`. Interleaved chunks of unequal weight (an uneven `pp_layers`)
    are not held equally: the peak is found along the order the engine runs
    (`parallel.pipeline.schedules`): w warm-up forwards, then each forward followed by a
    backward, the k-th forward through `interleaved_chunk(F, k)`, the k-th backward
    `interleaved_chunk(B, k)`. What is alive after steady forward w+i and before backward i
    repeats with period p·v in i (each period adds and frees p micro-batches of every
    chunk), so the peak lies in the first p·v steady steps. DualPipeV keeps the average
    (its peak is not split by chunk here)."""
    chunks = len(rank_chunks(layout, rank))
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    if layout.schedule != "interleaved" or p == 1 or len(set(weights)) <= 1:
        return (inflight_microbatches(layout, m, rank),) * chunks
    return _interleaved_inflight(p, m, v, rank, tuple(weights))


@functools.lru_cache(maxsize=16384)
def _interleaved_inflight(p: int, m: int, v: int, rank: int,
                          weights: tuple[float, ...]) -> tuple[float, ...]:
    warmup = interleaved_warmup(p, m, v, rank)
    alive = [0] * v
    for k in range(warmup):
        alive[interleaved_chunk(FORWARD, k, p, v)] += 1
    best = tuple(alive)
    for i in range(min(m * v - warmup, p * v)):
        alive[interleaved_chunk(FORWARD, warmup + i, p, v)] += 1
        if sum(n * w for n, w in zip(alive, weights)) > sum(
                n * w for n, w in zip(best, weights)):
            best = tuple(alive)
        alive[interleaved_chunk(BACKWARD, i, p, v)] -= 1
    return tuple(float(n) for n in best)


def pending_weight_passes(layout: Layout, num_microbatches: int, rank: int) -> tuple[int, ...]:
    """Per chunk of `rank` (in `rank_chunks` order), the most micro-batches whose B has run
    and whose W has not, at the rank's peak: each keeps its output gradients until W.

    Read off the engine's lists (`parallel.pipeline.schedules`; a B directly followed by its
    own W runs as one backward and keeps nothing): ZB-H1 keeps r + 1 on rank r > 0 and none
    on rank 0, whose every W follows its B; DualPipeV keeps r + 1 on rank r > 0 as well,
    ⌈(r+1)/2⌉ in the down-going chunk and ⌊(r+1)/2⌋ in the up-going one. Equal to
    `parallel.pipeline.check.peak_pending_weights` (tests/test_plan_flops_comm.py)."""
    chunks = len(rank_chunks(layout, rank))
    if layout.pp == 1 or rank == 0 or layout.schedule not in ("zb", "dualpipev"):
        return (0,) * chunks
    n = min(rank + 1, num_microbatches)
    if layout.schedule == "zb":
        return (n,)
    return ((n + 1) // 2, n // 2)


def bubble_ratio(layout: Layout, num_microbatches: int) -> float:
    """Pipeline bubble time as a fraction of the ideal compute time m·(t_f + t_b).

    AFAB and 1F1B: (p − 1)/m, i.e. (p − 1)/(m + p − 1) of the step (Narayanan 2021 §2.2.1).
    Interleaved: (p − 1)/(v·m) (Narayanan 2021 §2.2.2).
    ZB-H1: one third of 1F1B's, (p − 1)/(3m) (Qi et al. 2023, with F = B = W).
    DualPipeV: (p − 1)/(6m), half of ZB-H1's. DeepSeek-V3 Table 2 gives (PP/2 − 1)(F&B + B − 3W)
    where PP counts stages, two per rank in the V (PP = 2p); the engine's DualPipeV schedule,
    simulated with F = B = W and no F&B overlap (`parallel.pipeline.check.simulate`), idles
    exactly (p − 1)/(6m) of the ideal time.
    """
    p, m = layout.pp, num_microbatches
    if p == 1:
        return 0.0
    if layout.schedule == "interleaved":
        return (p - 1) / (layout.virtual_stages * m)
    if layout.schedule == "zb":
        return (p - 1) / (3 * m)
    if layout.schedule == "dualpipev":
        return (p - 1) / (6 * m)
    return (p - 1) / m


def critical_ranks(model: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """Pipeline ranks that can be the most loaded: the first (embedding, most activations),
    the last (output head, logits) and the one holding the most layers."""
    return _critical_ranks(_split_key(model, layout))
