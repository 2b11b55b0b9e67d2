"""Which linears train.precision = fp8 runs in FP8, per layer, as the engine decides it.

The engine (lowp/convert.py `convert_to_fp8`) converts every module of the built model
that FP8 can take (a linear, a tensor-parallel shard of one, routed experts) unless its
name matches `ALWAYS_KEPT_OUT` (the output head, a shared expert's gate) or a
train.fp8_keep_out pattern (config/fp8.py `keep_out_matches`). The planner builds no model:
`model_linear_names` writes the names the engine's Llama gives those modules
(models/llama.py, mlp.py, moe.py), and the same matching decides. The router scores with
its own parameter (not a linear) and stays in high precision as the head does.

A kept-out linear is a bf16 linear to every term: its GEMMs at bf16's peak, no cast
kernels, its weight all-gathered in the compute dtype under parallel.fp8_allgather, no
delayed-scaling amax records. The terms read a rank's `FP8Linears`: how many of each kind
of linear its layers run in FP8, plus the shared input casts (q, k and v cast their
common input once, lowp/linear.py `_quantized_input`, if any of them is FP8; gate and up
likewise). Counts per layer are computed once per (model, keep-out) and summed per
pipeline rank from prefix sums, so the layout search pays a few additions per rank.
tests/test_plan_fp8_keep_out.py holds the names to `convert_to_fp8` on built models.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fivefold.config.fp8 import (
    ALWAYS_KEPT_OUT,
    keep_out_matches,
    parse_keep_out,
    unmatched_keep_out,
)
from fivefold.models.presets import ModelConfig
from fivefold.plan.placement import chunk_layer_counts, rank_chunks

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
SHARED = "shared_expert"


@dataclass(frozen=True)
class FP8Linears:
    """FP8 linears of some layers, by kind (a count each): attention's q, k, v and o; a
    dense layer's MLP (gate only under SwiGLU); a MoE layer's shared expert and its routed
    experts (one module: all three stacked weights); and the input casts the linears share
    (`qkv_input`: layers with any of q, k, v in FP8; `mlp_input`, `shared_input`: with
    gate or up)."""

    q: float = 0
    k: float = 0
    v: float = 0
    o: float = 0
    qkv_input: float = 0
    gate: float = 0
    up: float = 0
    down: float = 0
    mlp_input: float = 0
    shared_gate: float = 0
    shared_up: float = 0
    shared_down: float = 0
    shared_input: float = 0
    experts: float = 0

    def counts(self) -> tuple[float, ...]:
        return tuple(self.__dict__.values())  # the fields, in order (astuple deep-copies)

    def __add__(self, other: FP8Linears) -> FP8Linears:
        return FP8Linears(*(a + b for a, b in zip(self.counts(), other.counts())))

    def __sub__(self, other: FP8Linears) -> FP8Linears:
        return FP8Linears(*(a - b for a, b in zip(self.counts(), other.counts())))

    @property
    def linears(self) -> float:
        """FP8 linear modules, the routed experts not counted."""
        return (self.q + self.k + self.v + self.o + self.gate + self.up + self.down
                + self.shared_gate + self.shared_up + self.shared_down)


NONE = FP8Linears()


def layer_linear_names(mc: ModelConfig, i: int) -> list[str]:
    """The FP8-capable modules of layer i, named as the engine's model names them."""
    base = f"layers.{i}"
    names = [f"{base}.self_attn.{p}" for p in ATTENTION]
    if mc.is_moe_layer(i):
        names.append(f"{base}.mlp.experts")
        if mc.shared_expert_intermediate_size:  # a SwiGLU MLP (models/moe.py)
            names += [f"{base}.mlp.{SHARED}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
            if mc.shared_expert_gate:
                names.append(f"{base}.mlp.shared_expert_gate")
    else:
        mlp = ("gate_proj", "up_proj", "down_proj") if mc.mlp == "swiglu" else ("up_proj",
                                                                                "down_proj")
        names += [f"{base}.mlp.{p}" for p in mlp]
    return names


def model_linear_names(mc: ModelConfig) -> list[str]:
    """Every FP8-capable module of the model, in the engine's order (`fp8_targets`)."""
    names = [n for i in range(mc.num_layers) for n in layer_linear_names(mc, i)]
    return names + ([] if mc.tie_embeddings else ["lm_head"])


def keep_out_problem(mc: ModelConfig, keep_out: str) -> str:
    """The engine's one-line refusal of a pattern that names no linear, or ""."""
    return unmatched_keep_out(model_linear_names(mc), parse_keep_out(keep_out))


def fp8_linear_names(mc: ModelConfig, keep_out: str = "") -> list[list[str]]:
    """Per layer, the names of its modules that run in FP8 (precision = fp8)."""
    patterns = (*ALWAYS_KEPT_OUT, *parse_keep_out(keep_out))
    return [[n for n in layer_linear_names(mc, i)
             if not any(keep_out_matches(n, p) for p in patterns)]
            for i in range(mc.num_layers)]


def _layer_counts(mc: ModelConfig, names: list[str], i: int) -> FP8Linears:
    leaf = {n.removeprefix(f"layers.{i}.") for n in names}
    has = {k: float(k in leaf) for k in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.experts",
        f"mlp.{SHARED}.gate_proj", f"mlp.{SHARED}.up_proj", f"mlp.{SHARED}.down_proj")}
    q, k, v, o = (has[f"self_attn.{p}"] for p in ATTENTION)
    gate, up, down = has["mlp.gate_proj"], has["mlp.up_proj"], has["mlp.down_proj"]
    sg, su, sd = (has[f"mlp.{SHARED}.{p}"] for p in ("gate_proj", "up_proj", "down_proj"))
    return FP8Linears(q, k, v, o, max(q, k, v), gate, up, down, max(gate, up), sg, su, sd,
                      max(sg, su), has["mlp.experts"])


def _model_key(mc: ModelConfig) -> tuple:
    """What the names depend on (ModelConfig itself is not hashable)."""
    return (mc.num_layers, mc.num_experts, mc.moe_first_dense, mc.moe_layer_freq,
            mc.shared_expert_intermediate_size, mc.shared_expert_gate, mc.mlp)


@functools.lru_cache(maxsize=256)
def _per_layer(key: tuple, keep_out: str) -> tuple[FP8Linears, ...]:
    layers, experts, first_dense, freq, shared, gate, mlp = key
    mc = ModelConfig(num_layers=layers, num_experts=experts, moe_first_dense=first_dense,
                     moe_layer_freq=freq, shared_expert_intermediate_size=shared,
                     shared_expert_gate=gate, mlp=mlp)
    return tuple(_layer_counts(mc, names, i)
                 for i, names in enumerate(fp8_linear_names(mc, keep_out)))


@functools.lru_cache(maxsize=256)
def _prefix_counts(key: tuple, keep_out: str) -> tuple[FP8Linears, ...]:
    """Running sums of the layers' counts: entry j sums layers 0..j-1."""
    out = [NONE]
    for layer in _per_layer(key, keep_out):
        out.append(out[-1] + layer)
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _kinds(key: tuple, keep_out: str, first: int, stop: int) -> tuple:
    kinds: dict = {}
    for layer in _per_layer(key, keep_out)[first:stop]:
        kinds[layer] = kinds.get(layer, 0) + 1
    return tuple(kinds.items())


def layer_fp8_linears(work, i: int) -> FP8Linears:
    """The FP8 linears of layer i (none unless precision = fp8)."""
    if work.precision != "fp8":
        return NONE
    return _per_layer(_model_key(work.model), getattr(work, "fp8_keep_out", ""))[i]


def layer_kinds(work, first: int, stop: int) -> tuple[tuple[FP8Linears, int], ...]:
    """Layers first..stop-1 grouped by their FP8 linears: (linears, how many layers)."""
    return _kinds(_model_key(work.model), getattr(work, "fp8_keep_out", ""), first, stop)


def layers_fp8_linears(work, first: int, stop: int) -> FP8Linears:
    """The FP8 linears of layers first..stop-1 (none unless precision = fp8)."""
    if work.precision != "fp8" or stop <= first:
        return NONE
    prefix = _prefix_counts(_model_key(work.model), getattr(work, "fp8_keep_out", ""))
    return prefix[stop] - prefix[first]


def rank_fp8_linears(work, layout, rank: int) -> FP8Linears:
    """The FP8 linears of the layers pipeline rank `rank` holds (its chunks' layers)."""
    if work.precision != "fp8":
        return NONE
    counts = chunk_layer_counts(work.model, layout)
    spans = tuple((sum(counts[:c]), sum(counts[:c + 1])) for c in rank_chunks(layout, rank))
    return _spans_counts(_model_key(work.model), getattr(work, "fp8_keep_out", ""), spans)


@functools.lru_cache(maxsize=65536)
def _spans_counts(key: tuple, keep_out: str, spans: tuple) -> FP8Linears:
    prefix = _prefix_counts(key, keep_out)
    total = NONE
    for first, stop in spans:
        total = total + (prefix[stop] - prefix[first])
    return total


def uniform_fp8_linears(mc: ModelConfig, layers: float, moe: float) -> FP8Linears:
    """Every linear of `layers` layers (`moe` of them MoE) in FP8: no keep-out."""
    dense = layers - moe
    gate = dense if mc.mlp == "swiglu" else 0
    shared = moe if mc.num_experts and mc.shared_expert_intermediate_size else 0
    return FP8Linears(layers, layers, layers, layers, layers, gate, dense, dense, dense,
                      shared, shared, shared, shared, moe if mc.num_experts else 0)


def fp8_gemm_flops(mc: ModelConfig, linears: FP8Linears, tp: int) -> tuple[float, float]:
    """Forward FLOPs per token of the FP8 linears' GEMMs: (those split over tp, the attention
    linears and a dense MLP, already divided by tp; those a MoE block runs whole on every
    tp rank: its shared expert and top-k routed experts)."""
    h, d = mc.hidden_size, mc.dim_per_head
    q, kv = mc.num_heads * d, mc.num_kv_heads * d
    split = 2 * (h * q * (linears.q + linears.o) + h * kv * (linears.k + linears.v)
                 + h * mc.intermediate_size * (linears.gate + linears.up + linears.down)) / tp
    whole = 2 * h * (mc.shared_expert_intermediate_size
                     * (linears.shared_gate + linears.shared_up + linears.shared_down)
                     + linears.experts * mc.experts_top_k * 3 * mc.moe_intermediate_size)
    return split, whole

