"""`train.recompute = "auto"`: the fastest per-layer recomputation that fits a memory budget.

Candidates. Inside a block, the operators worth keeping are the projections and the
attention core; everything else (norms, RoPE, SiLU, products, residual adds) is elementwise
and cheap to run again. Per layer the choices are
    none        keep what autograd saves (`activations.py`, recompute = none)
    selective   recompute the attention core (Korthikanti et al. 2022, §5)
    keep S      checkpoint the block, keeping the outputs of the operators in S, a subset of
                q, k, v, core, o, gate, up, down (torchtitan's per-operator selective
                checkpointing; `torch.utils.checkpoint.create_selective_checkpoint_contexts`,
                parallel/recompute.py); S = {} is full recomputation
Each choice has a saving (the bytes a micro-batch leaves stored between its forward and
backward, from the same activation model the peak tracker is checked against), a working
set (what the layer's recomputation brings back during its backward) and a cost (the
recompute seconds of the planner's per-operator model: GEMMs at the GEMM rate, the attention
core at the attention rate, the elementwise kernels at HBM bandwidth, as plan/timing.py; a
MoE layer's MLP as its MoE block's forward, and under FP8 the casts every re-run of the
block runs again, whatever it keeps: plan/recompute_costs.py).
Dominated choices (more bytes and more time) are dropped: ~10 remain. Under train.precision
= fp8 a projection's GEMM runs at the FP8 rate unless train.fp8_keep_out leaves its linear
in bf16 (plan/fp8_linears.py): layers that differ in which do have choices of their own
costs, one set per such kind of layer (usually one or two kinds).

The choice. Layers of a pipeline rank weigh by the micro-batches their chunk keeps in flight
(`inflight_per_chunk`). Minimise Σ cost subject to Σ in_flight·stored + max working ≤ the
rank's budget for layer activations: a multiple-choice knapsack, solved exactly by a dynamic
program over the layers (the least seconds within each number of budget units so far; bytes
rounded up to 1/4096 of the budget, so the plan always fits), once per cap on the working
set. Checkmate (Jain et al., MLSys 2020) solves the general graph as an integer program;
over a chain of identical blocks the front stays small.

The budget bounds the peak *allocated* bytes (what the peak tracker and
`torch.cuda.max_memory_allocated` measure): the rest of the rank (model states, buffers,
logits) is the planner's, and the layers get what is left. Below full recomputation's peak
nothing fits: `minimum_budget` says where that is. Costs rank choices at the default
catalog GPU's rates, so the engine and the planner pick the same plan whatever GPU is
planned; plan/timing.py charges the chosen plan at the planned GPU's rates.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from fivefold.plan.activations import STAT_BYTES, activation_bytes_per_microbatch
from fivefold.plan.flops import forward_flops_per_token
from fivefold.plan.fp8_linears import FP8Linears, layer_fp8_linears
from fivefold.plan.hardware import GIB, Assumptions, Hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.placement import chunk_layer_counts, rank_chunks
from fivefold.plan.recompute_costs import moe_seconds, recompute_cast_seconds

OPS = ("q", "k", "v", "core", "o", "gate", "up", "down")
DEFAULT_GPU = "h100-sxm"


@dataclass(frozen=True)
class LayerChoice:
    """One layer's recomputation: kind none | selective | keep (`kept` operators' outputs)."""

    kind: str
    kept: frozenset = frozenset()
    stored: float = 0.0  # bytes of one micro-batch kept from forward to backward
    working: float = 0.0  # bytes its recomputation brings back in backward
    seconds: float = 0.0  # recompute time per micro-batch

    def label(self) -> str:
        if self.kind != "keep":
            return self.kind
        if not self.kept:
            return "full"
        return "keep " + ",".join(op for op in OPS if op in self.kept)


@dataclass(frozen=True)
class RankPlan:
    """The choice for every layer of one pipeline rank (in its chunks' order)."""

    choices: tuple[LayerChoice, ...]
    activations: float  # bytes of the rank's layer activations at its peak (all in flight)
    seconds: float  # recompute seconds per micro-batch, all its layers
    budget: float  # bytes the budget leaves for layer activations

    def summary(self) -> str:
        runs = [(label, len(list(group))) for label, group in
                itertools.groupby(c.label() for c in self.choices)]
        return "; ".join(f"{n}× {label}" for label, n in runs)


class BudgetTooSmall(ValueError):
    """The budget is below full recomputation's peak."""


def layer_fp8_ops(work: Workload, i: int) -> frozenset | None:
    """The projections of layer i (OPS' names) whose GEMMs run in FP8 under precision = fp8
    (every one but those train.fp8_keep_out leaves in bf16; a MoE layer's MLP operators
    follow its routed experts, and "shared_gate", "shared_up", "shared_down" name its
    shared expert's FP8 linears); None for other precisions (every GEMM at their rate)."""
    return _fp8_ops(work, layer_fp8_linears(work, i), work.model.is_moe_layer(i))


def _fp8_ops(work: Workload, n: FP8Linears, moe: bool) -> frozenset | None:
    if work.precision != "fp8":
        return None
    flags = {"q": n.q, "k": n.k, "v": n.v, "o": n.o, "gate": n.experts if moe else n.gate,
             "up": n.experts if moe else n.up, "down": n.experts if moe else n.down}
    if moe:
        flags.update(shared_gate=n.shared_gate, shared_up=n.shared_up,
                     shared_down=n.shared_down)
    elif work.model.mlp != "swiglu":
        del flags["gate"]
    return frozenset(op for op, fp8 in flags.items() if fp8)


def layer_kind(work: Workload, i: int) -> tuple[bool, FP8Linears]:
    """What layer i's choices depend on beyond the layout: whether it is a MoE layer, and
    its FP8 linears (plan/fp8_linears.py; none unless precision = fp8)."""
    return work.model.is_moe_layer(i), layer_fp8_linears(work, i)


def op_table(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
             fp8_ops: frozenset | None = None, moe: bool = False
             ) -> dict[str, tuple[float, float, float]]:
    """Per operator of one layer and one micro-batch: (output bytes, bytes of that output
    autograd also saves, forward seconds). Under tp the projections and the core are split.
    Under precision = fp8 the projections in `fp8_ops` (None: all; `layer_fp8_ops`) run at
    the FP8 rate, the others at bf16's, as plan/timing.py times a kept-out linear.
    A MoE layer (`moe`): its MLP's seconds are the MoE block's forward
    (plan/recompute_costs.py `moe_seconds`); its bytes stay the dense MLP's (the
    activation model averages MoE layers over the model)."""
    mc, lay, B = work.model, layout, work.dtype_bytes
    tokens = lay.mbs * work.seq_len / lay.cp
    h, t, d = mc.hidden_size, lay.tp, mc.dim_per_head
    q = mc.num_heads * d / t
    kv = max(mc.num_kv_heads // t, 1) * d
    f = mc.intermediate_size / t
    peak = hw.peak_flops(work.precision)
    thin = min(tokens, q, f, h)
    # attention's core runs in bf16 under FP8 too (plan/timing.py's `high_peak`)
    high = hw.peak_flops("bf16") if work.precision == "fp8" else peak
    attn_rate = high * hw.matmul_efficiency * assume.attention_efficiency
    rates = {p: p * hw.matmul_efficiency * thin / (thin + 128)  # plan/timing.py's GEMM rate
             for p in (peak, high)}

    def gemm(op: str) -> float:
        return rates[peak if fp8_ops is None or op in fp8_ops else high]
    scores = forward_flops_per_token(mc, work.seq_len).layer_attention / t
    core_out = tokens * q * B + tokens * mc.num_heads / t * STAT_BYTES
    table = {"q": (tokens * q * B, 0.0, 2 * tokens * h * q / gemm("q")),
             "k": (tokens * kv * B, 0.0, 2 * tokens * h * kv / gemm("k")),
             "v": (tokens * kv * B, tokens * kv * B, 2 * tokens * h * kv / gemm("v")),
             "core": (core_out, core_out, tokens * scores * (0.5 if work.flash else 1.0)
                      / attn_rate),
             "o": (tokens * h * B, 0.0, 2 * tokens * q * h / gemm("o")),
             "up": (tokens * f * B, tokens * f * B, 2 * tokens * h * f / gemm("up")),
             "down": (tokens * h * B, 0.0, 2 * tokens * f * h / gemm("down"))}
    if mc.mlp == "swiglu" or moe:
        table["gate"] = (tokens * f * B, tokens * f * B, 2 * tokens * h * f / gemm("gate"))
    if moe:
        seconds = moe_seconds(work, layout, hw, tokens, fp8_ops)
        table.update({op: (*table[op][:2], seconds[op]) for op in seconds})
    return table


def elementwise_seconds(work: Workload, layout: Layout, hw: Hardware,
                        assume: Assumptions) -> float:
    """One layer's elementwise kernels, forward, at HBM bandwidth (as plan/timing.py)."""
    mc, lay = work.model, layout
    tokens = lay.mbs * work.seq_len / lay.cp
    q = mc.num_heads * mc.dim_per_head / lay.tp
    kv = max(mc.num_kv_heads // lay.tp, 1) * mc.dim_per_head
    act = 3 if mc.mlp == "swiglu" else 2
    traffic = tokens * work.dtype_bytes * (10 * mc.hidden_size + 2 * (q + kv)
                                           + act * mc.intermediate_size / lay.tp)
    return traffic / (hw.hbm_tbps * 1e12 * assume.hbm_efficiency)


_CHOICES: dict[str, tuple[LayerChoice, ...]] = {}


def layer_choices(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                  kind: tuple | None = None) -> list[LayerChoice]:
    """The choices of one layer of `kind` (`layer_kind`; None: layer 0's) that no other
    beats in both bytes and seconds. Memoised on what they depend on: a search asks for
    them once per layout, rank and kind of layer, over layouts that differ only in dp,
    ZeRO or the schedule."""
    kind = layer_kind(work, 0) if kind is None else kind
    key = repr((work, layout.tp, layout.sp, layout.cp, layout.mbs, layout.sp_saved,
                layout.cp_comm, layout.ep, layout.zero, hw, assume, kind))
    if key not in _CHOICES:
        if len(_CHOICES) > 4096:
            _CHOICES.clear()
        _CHOICES[key] = tuple(_layer_choices(work, layout, hw, assume, kind))
    return list(_CHOICES[key])


def _layer_choices(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                   kind: tuple) -> list[LayerChoice]:
    kwargs = {"tp": layout.tp, "sp": layout.sp, "cp": layout.cp,
              "dtype_bytes": work.dtype_bytes, "flash": work.flash, "dropout": work.dropout,
              "sp_saves_gathered": layout.sp_saved != "shard", "cp_comm": layout.cp_comm}
    model, mbs, seq = work.model, layout.mbs, work.seq_len
    none = activation_bytes_per_microbatch(model, mbs, seq, recompute="none", **kwargs)
    selective = activation_bytes_per_microbatch(model, mbs, seq, recompute="selective",
                                                **kwargs)
    block_input = none.layer_terms["attn_norm_input"]
    moe, linears = kind
    ops = op_table(work, layout, hw, assume, _fp8_ops(work, linears, moe), moe)
    # the block re-run: its elementwise kernels and its FP8 casts, whatever it keeps
    elem = (elementwise_seconds(work, layout, hw, assume)
            + recompute_cast_seconds(work, layout, hw, assume, linears, moe))
    out = [LayerChoice("none", stored=none.layer)]
    if layout.cp == 1:  # under cp selective leaves the ring core alone: it is "none"
        out.append(LayerChoice("selective", stored=selective.layer,
                               working=none.layer_terms.get("attn_core", 0.0),
                               seconds=ops["core"][2]))
    names = tuple(ops)
    for n in range(len(names) + 1):
        for kept in itertools.combinations(names, n):
            stored = block_input + sum(ops[op][0] for op in kept)
            working = none.layer - block_input - sum(ops[op][1] for op in kept)
            seconds = elem + sum(ops[op][2] for op in names if op not in kept)
            out.append(LayerChoice("keep", frozenset(kept), stored, working, seconds))
    return pareto(out)


def pareto(choices: list[LayerChoice]) -> list[LayerChoice]:
    """Drop a choice another beats or equals in stored bytes, working set and seconds."""
    keep = []
    for c in sorted(choices, key=lambda c: (c.seconds, c.stored, c.working)):
        if not any(k.stored <= c.stored and k.working <= c.working for k in keep):
            keep.append(c)
    return keep


def _front(choices, cap: float) -> tuple[LayerChoice, ...]:
    """The choices whose working set is within `cap`, on their Pareto front of seconds and
    stored bytes (under a cap only those matter)."""
    allowed = []
    for c in sorted((c for c in choices if c.working <= cap),
                    key=lambda c: (c.seconds, c.stored)):
        if not allowed or c.stored < allowed[-1].stored:
            allowed.append(c)
    return tuple(allowed)


def choose(choices: list, weights: list[float], budget: float,
           kinds: list[int] | None = None) -> tuple[LayerChoice, ...] | None:
    """The cheapest choice per layer with Σ weight·stored + max working ≤ budget (exact),
    or None when nothing fits. `weights`: per layer, the micro-batches in flight. `choices`:
    every layer's; or, with `kinds` (per layer, an index into `choices`), one list per kind
    of layer (layers whose FP8 projections differ: `layer_fp8_ops`)."""
    sets = [choices] if kinds is None else choices
    kinds = tuple(kinds) if kinds is not None else (0,) * len(weights)
    candidates, previous = [], None  # (cap, each kind's Pareto front), caps ascending
    for cap in sorted({c.working for one in sets for c in one}):
        allowed = tuple(_front(one, cap) for one in sets)
        if allowed != previous and all(allowed):  # the same choices under a smaller
            candidates.append((cap, allowed))     # budget: no better plan
        previous = allowed
    # Solve the caps in the order of a lower bound on their cost, and skip a cap whose bound
    # cannot beat the plan in hand: most are skipped. Among costs within 1e-15 the smallest
    # cap wins, as when every cap is solved in ascending order.
    bounds = [_cost_bound(allowed, weights, budget - cap, kinds)
              for cap, allowed in candidates]
    best = None  # (cost, index, plan)
    for bound, index in sorted((b, i) for i, b in enumerate(bounds)):
        if best is not None and (bound > best[0] + 1e-15 or
                                 (bound >= best[0] - 1e-15 and index > best[1])):
            continue
        cap, allowed = candidates[index]
        picked = _knapsack(allowed, tuple(weights), budget - cap, kinds)
        if picked is None:
            continue
        cost = sum(c.seconds for c in picked)
        if (best is None or cost < best[0] - 1e-15
                or (cost <= best[0] + 1e-15 and index < best[1])):
            best = (cost, index, picked)
    return None if best is None else best[2]


def _cost_bound(sets: tuple, weights: list[float], budget: float, kinds: tuple) -> float:
    """A lower bound on the knapsack's least seconds, by weak Lagrangian duality: for any
    λ ≥ 0, Σ_layers min_choice (seconds + λ·weight·stored) − λ·budget ≤ the optimum (the
    constraint's slack is ≥ 0 in every plan that fits). λ runs over the slopes at which a
    layer's cheapest choice changes, where the bound can peak; the best of them is taken.
    −inf when the budget is ≤ 0 (the knapsack then returns nothing). `sets`: each kind of
    layer's choices, `kinds`: each layer's."""
    import numpy as np

    if budget <= 0:
        return -np.inf
    stored = [np.array([c.stored for c in one]) for one in sets]
    seconds = [np.array([c.seconds for c in one]) for one in sets]
    groups: dict[tuple, int] = {}
    for w, k in zip(weights, kinds):
        groups[w, k] = groups.get((w, k), 0) + 1
    slopes = []
    for st, sec in zip(stored, seconds):
        ds = st[:, None] - st[None, :]  # a above b in bytes, below in seconds
        dt = sec[None, :] - sec[:, None]
        pairs = (ds > 0) & (dt > 0)
        if pairs.any():
            slopes.append(dt[pairs] / ds[pairs])
    slopes = np.concatenate(slopes) if slopes else np.zeros(0)
    lambdas = np.concatenate([[0.0], *[slopes / w for w in dict.fromkeys(w for w, _ in groups)]])
    total = -lambdas * budget
    for (w, k), n in groups.items():
        total += n * (seconds[k][None, :] + lambdas[:, None] * w * stored[k][None, :]).min(axis=1)
    return float(total.max())


UNITS = 4096  # the budget is cut into this many units; a choice's bytes round up to units


def _knapsack(choices: tuple, weights: tuple[float, ...], budget: float,
              kinds: tuple | None = None) -> tuple[LayerChoice, ...] | None:
    """Dynamic program over the layers: best[u] = the least seconds of the layers so far
    within u units of bytes. Bytes are rounded *up* to units of budget/UNITS, so a plan it
    returns always fits, and it misses only plans within a unit of the budget per layer.
    `choices`: every layer's; with `kinds`, one tuple per kind of layer (`choose`)."""
    import numpy as np

    if budget <= 0:
        return None
    sets = (choices,) if kinds is None else choices
    kinds = kinds if kinds is not None else (0,) * len(weights)
    unit = budget / UNITS
    best = np.zeros(UNITS + 1)
    steps = []  # per layer: (the table before it, the units of each choice, its choices)
    for w, k in zip(weights, kinds):
        size = [int(np.ceil(w * c.stored / unit - 1e-9)) for c in sets[k]]
        new = np.full(UNITS + 1, np.inf)
        for u, c in zip(size, sets[k]):
            if u <= UNITS:
                np.minimum(new[u:], best[:UNITS + 1 - u] + c.seconds, out=new[u:])
        steps.append((best, size, sets[k]))
        best = new
    if not np.isfinite(best[UNITS]):
        return None
    # Walk back: at each layer the first choice (in order) that reaches the table's value,
    # the one a strict "better than" over the choices in order would have kept. The sums are
    # the same float operations as above, so equality is exact.
    plan, at, value = [], UNITS, best[UNITS]
    for before, size, layer in reversed(steps):
        i = next(i for i, (u, c) in enumerate(zip(size, layer))
                 if u <= at and before[at - u] + c.seconds == value)
        plan.append(layer[i])
        at -= size[i]
        value = before[at]
    return tuple(reversed(plan))


def rank_layer_ops(work: Workload, layout: Layout, rank: int) -> list:
    """Per layer of pipeline rank `rank` (as `rank_weights` lists them): its kind
    (`layer_kind`: MoE or not, its FP8 linears)."""
    counts = chunk_layer_counts(work.model, layout)
    return [layer_kind(work, i) for c in rank_chunks(layout, rank)
            for i in range(sum(counts[:c]), sum(counts[:c + 1]))]


def rank_weights(work: Workload, layout: Layout, rank: int) -> list[float]:
    """Per layer of pipeline rank `rank`: the micro-batches its chunk keeps in flight."""
    from fivefold.plan.placement import inflight_per_chunk

    counts = chunk_layer_counts(work.model, layout)
    chunks = rank_chunks(layout, rank)
    alive = inflight_per_chunk(layout, work.num_microbatches(layout), rank,
                               tuple(counts[c] for c in chunks))
    return [a for c, a in zip(chunks, alive) for _ in range(counts[c])]


def layer_budget(work: Workload, layout: Layout, rank: int, full_allocated: float) -> float:
    """Bytes the budget leaves for the layers' activations on `rank`: the budget minus the
    rest of the peak allocated under full recomputation (`full_allocated`, the planner's
    items for that layout without the overhead; its layer inputs and working set taken out)."""
    full = full_layer_activations(work, layout, rank)
    return work.memory_budget_gib * GIB - (full_allocated - full)


def full_layer_activations(work: Workload, layout: Layout, rank: int) -> float:
    """Full recomputation's layer activations on `rank`: inputs in flight + working set."""
    hw, assume = _ranking_hardware()
    full = [c for c in layer_choices(work, layout, hw, assume)
            if c.kind == "keep" and not c.kept][0]
    weights = rank_weights(work, layout, rank)
    return sum(weights) * full.stored + (full.working if weights else 0.0)


@functools.lru_cache(maxsize=1)
def _ranking_hardware():
    from fivefold.plan.hardware import get_hardware

    return get_hardware(DEFAULT_GPU)


_PLANS: dict[str, RankPlan] = {}


def plan_rank(work: Workload, layout: Layout, rank: int, full_allocated: float,
              assume: Assumptions | None = None) -> RankPlan:
    """The fastest choice per layer of `rank` under `work.memory_budget_gib`, given the peak
    allocated bytes of full recomputation on that rank (plan/memory.py `auto_plan` supplies
    it); raises BudgetTooSmall when even full recomputation does not fit. Memoised: memory
    and time ask for the same plan (the model config holds a dict, so the key is its repr)."""
    key = repr((work, layout, rank, full_allocated, assume))
    if key not in _PLANS:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = _plan_rank(work, layout, rank, full_allocated, assume)
    return _PLANS[key]


def _plan_rank(work: Workload, layout: Layout, rank: int, full_allocated: float,
               assume: Assumptions | None) -> RankPlan:
    hw, default_assume = _ranking_hardware()
    assume = assume or default_assume
    budget = layer_budget(work, layout, rank, full_allocated)
    weights = rank_weights(work, layout, rank)
    ops = rank_layer_ops(work, layout, rank)
    kinds = list(dict.fromkeys(ops))  # the kinds of layer (MoE, FP8 linears)
    if len(kinds) > 1:  # dense and MoE layers, or train.fp8_keep_out's bf16 projections
        sets = [layer_choices(work, layout, hw, assume, k) for k in kinds]
        picked = choose(sets, weights, budget, [kinds.index(k) for k in ops])
    else:
        choices = layer_choices(work, layout, hw, assume, kinds[0] if kinds else None)
        picked = choose(choices, weights, budget) if weights else ()
    if picked is None:
        raise BudgetTooSmall(f"a budget of {work.memory_budget_gib:g} GiB is below full "
                             f"recomputation's peak of {full_allocated / GIB:.3g} GiB on "
                             f"pipeline rank {rank}")
    # Layers of equal weight and kind are interchangeable: list each kind's choices grouped
    # (over its layers' places).
    if len(set(weights)) == 1:
        picked = list(picked)
        for k in kinds:
            at = [i for i, o in enumerate(ops) if o == k]
            for i, c in zip(at, sorted((picked[i] for i in at),
                                       key=lambda c: (-c.stored, c.label()))):
                picked[i] = c
    stored = sum(w * c.stored for w, c in zip(weights, picked))
    working = max((c.working for c in picked), default=0.0)
    return RankPlan(tuple(picked), stored + working, sum(c.seconds for c in picked), budget)


def recompute_seconds(work: Workload, layout: Layout, rank: int, hw: Hardware,
                      assume: Assumptions, plan: RankPlan | None) -> float:
    """Recompute seconds per micro-batch of `plan` (the one chosen for `rank`), at `hw`'s
    rates; None (a budget below full recomputation's peak): full recomputation's. Each
    layer's operators at its own rates (`layer_fp8_ops`)."""
    layers = rank_layer_ops(work, layout, rank)
    tables = {k: op_table(work, layout, hw, assume, _fp8_ops(work, k[1], k[0]), k[0])
              for k in dict.fromkeys(layers)}
    elem = elementwise_seconds(work, layout, hw, assume)
    casts = {k: recompute_cast_seconds(work, layout, hw, assume, k[1], k[0]) for k in tables}
    if plan is None:
        return sum(layers.count(k) * (elem + casts[k] + sum(o[2] for o in ops.values()))
                   for k, ops in tables.items())
    total = 0.0
    for c, k in zip(plan.choices, layers, strict=True):
        ops = tables[k]
        if c.kind == "selective":
            total += ops["core"][2]
        elif c.kind == "keep":
            total += elem + casts[k] + sum(ops[op][2] for op in ops if op not in c.kept)
    return total
