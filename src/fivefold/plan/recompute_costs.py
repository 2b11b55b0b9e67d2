"""What a recomputed layer's forward costs beyond its dense projections, for recompute =
auto's per-operator table (plan/recompute_plan.py `op_table`, `layer_choices`): a MoE
block's forward, and the FP8 casts a recomputed forward runs again."""

from __future__ import annotations

from fivefold.plan.fp8 import expert_cast_bytes, fp8_gathers, rank_dense_cast_bytes
from fivefold.plan.fp8_linears import NONE, FP8Linears
from fivefold.plan.hardware import Assumptions, Hardware
from fivefold.plan.layout import Layout, Workload


def moe_seconds(work: Workload, layout: Layout, hw: Hardware, tokens: float,
                fp8_ops: frozenset | None) -> dict[str, float]:
    """A MoE block's forward seconds (models/moe.py), whole on every tp rank, as plan/
    timing.py times it: the FLOPs of `ModelConfig.moe_params(active=True)` (the router, the
    top-k routed experts of their own width, the shared expert and its gate) at the grouped
    GEMMs' rate (groups of tokens·k·ep/E rows: thin for many experts), an FP8 linear's at
    the FP8 peak, the router's and the shared expert's gate at bf16's. The routed and the
    shared expert's projections are gate, up and down; the router and the shared gate run
    first, with gate."""
    mc, h = work.model, work.model.hidden_size
    peak = hw.peak_flops(work.precision)
    high = hw.peak_flops("bf16") if work.precision == "fp8" else peak
    rows = tokens * mc.experts_top_k * layout.ep / mc.num_experts
    thin = min(rows, mc.moe_intermediate_size or 1, h)

    def rate(fp8: bool) -> float:  # plan/timing.py's `expert_rate`
        return (peak if fp8 else high) * hw.matmul_efficiency * thin / (thin + 128)

    def fp8(op: str) -> bool:
        return fp8_ops is None or op in fp8_ops
    active = mc.moe_params(active=True)
    shared = 2 * h * mc.shared_expert_intermediate_size  # FLOPs per token, one projection
    routed = 2 * active["routed"] / 3
    scores = 2 * (active["router"] + active["shared"]) - 3 * shared  # router, shared gate
    out = {op: tokens * (routed / rate(fp8(op)) + shared / rate(fp8("shared_" + op)))
           for op in ("gate", "up", "down")}
    out["gate"] += tokens * scores / rate(False)
    return out


def recompute_cast_seconds(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                           linears: FP8Linears = NONE, moe: bool = False) -> float:
    """The FP8 casts one layer's recomputed forward runs again (precision = fp8; 0
    otherwise), at the HBM rate as plan/timing.py adds them: every cast of the layer's
    forward, whatever it keeps (parallel/recompute.py keeps GEMM and attention outputs;
    each FP8 linear casts its input again for the codes its backward takes, and its weight,
    as the first forward did: lowp/linear.py keeps no cast weight), so `rank_dense_cast_bytes`'
    forward of its FP8 linears and, in a MoE layer with FP8 routed experts, their
    `expert_cast_bytes` forward. Under parallel.fp8_allgather the re-run takes the weights
    the backward gathered (no weight cast, as plan/timing.py's full recomputation)."""
    if work.precision != "fp8":
        return 0.0
    mc, lay = work.model, layout
    tokens = lay.mbs * work.seq_len / lay.cp
    cast = rank_dense_cast_bytes(work, lay, tokens, linears)[0]
    if moe and linears.experts:
        per = expert_cast_bytes(work.fp8_recipe, tokens * mc.experts_top_k,
                                mc.num_experts / lay.ep, mc.hidden_size,
                                mc.moe_intermediate_size, work.dtype_bytes,
                                fp8_gathers(work, lay)[0] > 0,
                                getattr(work, "fp8_scaling", "dynamic"))
        cast += linears.experts * (per["casts"][0] + per["loop"][0])
    return cast / (hw.hbm_tbps * 1e12 * assume.hbm_efficiency)
