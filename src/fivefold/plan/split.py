"""How a model's layers are cut into pipeline stages: the one function the engine
(`parallel/pipeline/stages.py`) and the planner (`plan/placement.py`) both call. No torch.

Three ways (`parallel.pp_split`, `parallel.pp_layers`):

- "even": floor or ceil of L / S layers per stage, the spare layers on the middle stages
  first, sparing the first (embedding) and last (head and loss) stages, as Llama 3 did for
  405B (126 layers on 16 stages; Dubey et al. 2024 §3.3.2).
- "balanced": the split whose most expensive stage is cheapest, counting the embedding on the
  first stage and the output head on the last. Costs are nanotron's
  (`src/nanotron/models/llama.py`, `get_block_compute_costs`, @2411b022): a decoder layer
  costs its GEMM weights per token, 4·h·(heads·head_dim) + 3·h·ffn for MHA (here the exact
  h·(2q + 2kv) + 3·h·ffn, so GQA counts its smaller k and v; GeLU MLPs 2·h·ffn), the head
  V·h, the embedding lookup nothing. nanotron assigns blocks greedily against cumulative-cost
  thresholds; this finds the minimum of the largest stage cost exactly (every layer costs the
  same, so a binary search over the stage-cost bound gives it) and breaks ties towards
  lighter early stages, which also hold the most in-flight activations under 1F1B.
- "cumulative" (planner only, the nanotron convention): nanotron's own greedy cut
  (`src/nanotron/models/base.py`, `build_model`, @2411b022): blocks in order (embedding,
  layers, final norm, head, fp32 cast, loss) go to stage k until their cumulative cost
  passes total·(k + 1)/S. It can leave the last stages without a layer (nanotron runs
  pp > L that way); the head is planned on the last stage wherever nanotron puts it.
- an explicit list of layers per stage (`parallel.pp_layers = [3, 4, 4, 3]`): Megatron-LM's
  `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`
  (TransformerConfig `num_layers_in_first/last_pipeline_stage`) generalised to every stage,
  and BLOOM's [embed + 5 layers, 6, ..., 5 + embed] (bigscience tr11-176B-ml README).

Stages here are model chunks: pp·v of them for interleaved schedules (chunk 0 holds the
embedding, chunk S−1 the head).
"""

from __future__ import annotations

import functools
import math

from fivefold.plan.flops import mlp_weights_per_token

SPLITS = ("even", "balanced", "cumulative")


def split_costs(model) -> tuple[float, float, float]:
    """(one layer, the embedding, the output head) in weight elements per token (nanotron's
    costs; `model` is a ModelConfig)."""
    h, d = model.hidden_size, model.dim_per_head
    q, kv = model.num_heads * d, model.num_kv_heads * d
    mlp = mlp_weights_per_token(model)  # an MoE layer's active weights, averaged over layers
    return float(h * (2 * q + 2 * kv) + mlp), 0.0, float(model.vocab_size * h)


def check_split(num_layers: int, num_stages: int, split: str = "even",
                layers: tuple[int, ...] | list[int] = ()) -> str | None:
    """The problem with a split, as one line naming the key and the fix, or None."""
    if split not in SPLITS:
        return f"parallel.pp_split = '{split}' is not one of {', '.join(SPLITS)}"
    if layers:
        layers = tuple(layers)
        if len(layers) != num_stages:
            return (f"parallel.pp_layers = {list(layers)} has {len(layers)} entries but the "
                    f"pipeline has {num_stages} stages (pp × chunks per rank); give one per stage")
        if any(n < 1 for n in layers):
            return f"parallel.pp_layers = {list(layers)}: every stage needs at least one layer"
        if sum(layers) != num_layers:
            return (f"parallel.pp_layers = {list(layers)} sums to {sum(layers)} but "
                    f"model.num_layers = {num_layers}; make them add up")
    elif num_stages > num_layers and split != "cumulative":
        return (f"{num_stages} pipeline stages but only {num_layers} layers: every stage "
                f"needs at least one; lower pp or virtual_stages")
    return None


@functools.lru_cache(maxsize=16384)
def stage_layer_counts(num_layers: int, num_stages: int, split: str = "even",
                       layers: tuple[int, ...] = (), layer_cost: float = 1.0,
                       embed_cost: float = 0.0, head_cost: float = 0.0) -> tuple[int, ...]:
    """Layers per stage, first to last. Raises ValueError (the `check_split` line) when the
    split is impossible."""
    problem = check_split(num_layers, num_stages, split, layers)
    if problem:
        raise ValueError(problem)
    if layers:
        return tuple(layers)
    if split == "balanced" and num_stages > 1 and (embed_cost or head_cost):
        return _balanced(num_layers, num_stages, layer_cost, embed_cost, head_cost)
    if split == "cumulative" and num_stages > 1:
        return _cumulative(num_layers, num_stages, layer_cost, embed_cost, head_cost)
    base, spare = divmod(num_layers, num_stages)
    middle = sorted(range(num_stages), key=lambda s: (abs(s - (num_stages - 1) / 2), s))
    extra = set(middle[:spare])
    return tuple(base + (s in extra) for s in range(num_stages))


def _balanced(num_layers: int, stages: int, c: float, embed: float,
              head: float) -> tuple[int, ...]:
    extra = [embed] + [0.0] * (stages - 2) + [head]

    def capacity(bound: float) -> list[int]:
        return [math.floor((bound - e) / c + 1e-9) for e in extra]

    def feasible(bound: float) -> bool:
        caps = capacity(bound)
        return min(caps) >= 1 and sum(caps) >= num_layers

    # The optimum is k·c + (a stage's extra cost) for some k: search those bounds.
    bounds = sorted({k * c + e for k in range(1, num_layers + 1) for e in set(extra)})
    lo, hi = 0, len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(bounds[mid]):
            hi = mid
        else:
            lo = mid + 1
    counts = capacity(bounds[lo])
    # Too many layers fit under the bound: take them from the costliest stage, the earliest
    # of equals (the first stages also keep the most micro-batches of activations).
    for _ in range(sum(counts) - num_layers):
        costs = [n * c + e if n > 1 else -1.0 for n, e in zip(counts, extra)]
        counts[costs.index(max(costs))] -= 1
    return tuple(counts)


def _cumulative(num_layers: int, stages: int, c: float, embed: float,
                head: float) -> tuple[int, ...]:
    """nanotron's greedy cut: a block joins the current stage, which closes once the blocks'
    cumulative cost passes its threshold total·(k + 1)/S (the zero-cost blocks after the
    head only follow it)."""
    costs = [embed] + [c] * num_layers + [head]
    total, cumulative, stage = sum(costs), 0.0, 0
    counts = [0] * stages
    for block, cost in enumerate(costs):
        cumulative += cost
        if 1 <= block <= num_layers:
            counts[stage] += 1
        if stage < stages - 1 and cumulative > total * (stage + 1) / stages:
            stage += 1
    return tuple(counts)


def cumulative_idle_ranks(num_layers: int, stages: int, c: float, embed: float,
                          head: float) -> int:
    """Pipeline ranks nanotron's greedy cut leaves without any block. The cut moves on by
    at most one rank per block, so when the head's cost passes several thresholds the
    zero-cost blocks after it (final cast to fp32, loss) take one rank each and the ranks
    after them get nothing (1B, 16 layers of cost c and a 4c head, on 16 ranks: the last
    one; on 32: the last 16)."""
    costs = [embed] + [c] * num_layers + [0.0, head, 0.0, 0.0]  # ..., norm, head, cast, loss
    total, cumulative, stage = sum(costs), 0.0, 0
    for cost in costs[:-1]:
        cumulative += cost
        if stage < stages - 1 and cumulative > total * (stage + 1) / stages:
            stage += 1
    return stages - 1 - stage


def model_stage_layers(model, num_stages: int, split: str = "even",
                       layers: tuple[int, ...] | list[int] = ()) -> tuple[int, ...]:
    """`stage_layer_counts` for a ModelConfig, with its costs."""
    return stage_layer_counts(model.num_layers, num_stages, split, tuple(layers or ()),
                              *split_costs(model))
