"""Communication per step and per rank: every collective a layout issues, in the engine's
ledger convention, and the bytes each one puts on the wire.

Ledger convention (what `parallel/comm.py` records): bytes = the full logical tensor. An
all_reduce counts the tensor; a reduce_scatter its full (unsharded) input; an all_gather its
full (gathered) output; send/recv the message (send on the sender, recv on the receiver); an
all_to_all its input. Wire bytes per rank use ring algorithms: all-reduce 2(n−1)/n, all-gather
and reduce-scatter (n−1)/n, all-to-all (n−1)/n of the ledger bytes (Patarasuk & Yuan 2009;
NCCL's bus-bandwidth convention), point-to-point 1.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fivefold.plan.activations import kv_heads_per_rank
from fivefold.plan.fp8 import delayed_amax_records, fp8_expert_gather_terms, fp8_gather_terms
from fivefold.plan.fp8_linears import rank_fp8_linears
from fivefold.plan.layout import (
    Layout,
    Workload,
    moe_layers_on_rank,
    num_chunks,
    rank_chunks,
    stage,
)
from fivefold.plan.memory import bytes_per_param, rank_param_counts

REGATHER = "saved shards (SP)"  # backward all-gathers that overlap the input-gradient GEMMs


@dataclass(frozen=True)
class Collective:
    """One kind of call a rank makes, with how often per step."""

    group: str  # the engine's group name: dp, dp_cp, tp, pp, cp, ep, edp, pp_embed, stage
    op: str  # all_reduce | reduce_scatter | all_gather | send | recv | all_to_all
    dtype_bytes: int
    elements: float  # elements of one call's logical tensor
    calls: float  # calls per step
    group_size: int
    phase: str  # fwd | bwd (per micro-batch, on the critical path) | grad (end of backward)
    #             | step (after the optimizer)
    note: str = ""

    @property
    def bytes(self) -> float:
        """Ledger bytes per step: the logical tensor size times the calls."""
        return self.elements * self.dtype_bytes * self.calls

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends over its link per step under ring algorithms."""
        n = self.group_size
        factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
                  "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n}.get(self.op, 1.0)
        return self.bytes * factor


def keeps_gathered(work: Workload, layout: Layout) -> bool:
    """ZeRO-3 under a pipeline that keeps each stage's parameters gathered for the whole step
    (torchtitan's FSDP default with PP: `reshard_after_forward = not pp_enabled`)."""
    return work.zero3_keep_gathered_pp and layout.zero == 3 and layout.pp > 1


def dp_group_name(layout: Layout) -> str:
    """Gradients are summed over dp×cp: each cp rank saw another slice of the same sequences.
    The engine's mesh names that group dp_cp whatever cp is (parallel/mesh.py)."""
    return "dp_cp"


def chunk_owner(layout: Layout, chunk: int) -> int:
    p = layout.pp
    if layout.schedule == "dualpipev" and p > 1:
        return chunk if chunk < p else 2 * p - 1 - chunk
    return chunk % p


def collectives(work: Workload, layout: Layout, pp_rank: int = 0) -> list[Collective]:
    """Every collective pipeline rank `pp_rank` issues in one optimizer step.

    Choices, stated because the ledger will be compared with the engine's:
    - DP/ZeRO run once per step, after the last micro-batch (no sync during accumulation):
      ZeRO-0 one all_reduce of all this rank's gradient elements; ZeRO-1/2 one reduce_scatter
      of the gradients (an all_reduce of all of them with `work.zero1_grad_sync ==
      "all_reduce"` at ZeRO-1, as nanotron runs it) plus one all_gather of the updated
      parameters (param dtype); ZeRO-3
      gathers the parameters per micro-batch twice (forward, and again in backward) and
      reduce-scatters the gradients once per step, or per micro-batch when
      `work.grad_sync == "microbatch"` (ZeRO-2 likewise).
    - Gradients travel in the grad dtype, or fp32 with a separate fp32 accumulation buffer.
      ZeRO ≥ 1 adds one all_reduce of a single float64 (the squared norm of the gradient
      shards). The engine pads buckets to a multiple of dp·cp; the planner does not.
    - TP per layer per micro-batch: 4 all_reduces of b·(s/cp)·h without SP (2 forward, 2
      backward; Shoeybi et al. 2019), 4 all_gathers + 4 reduce_scatters with SP (Korthikanti
      §4.2.2). Full recompute repeats the forward ones but the MLP's last (checkpoint early
      stop). Vocab-parallel embedding and loss add,
      per micro-batch: one all_reduce (SP: reduce_scatter, and an all_gather in backward)
      after the embedding, the head's
      input all_reduce in backward (SP: all_gather forward + reduce_scatter backward) and three
      all_reduces of b·s/cp fp32 in the cross-entropy (max, sum of exps, target logit). With
      SP, each norm weight's gradient is all-reduced per micro-batch; kv heads shared by several
      tp ranks have their k/v gradients all-reduced per micro-batch; the gradient norm adds one
      float64 all_reduce over tp (and over pp). Saving the sequence shard (`sp_saved = shard`)
      adds, per layer per micro-batch, the backward all_gathers of the two regions' inputs.
    - PP: per micro-batch and chunk boundary, one activation send forward and one gradient send
      backward of b·(s/cp)·h (÷tp with SP), and the matching recvs (Narayanan 2021 §3.2).
    - CP, per layer per micro-batch, on K and V packed as one tensor (2·b·(s/cp)·kv), and the
      fp32 dK,dV accumulators (parallel/context/attention.py). Ring: cp−1 sends (and recvs)
      forward; backward cp−1 K,V sends again plus cp dK,dV sends, the last one home. All-gather:
      one all_gather of cp·K,V forward, one reduce_scatter of cp·dK,dV (fp32) backward. Full
      recompute repeats the forward; selective leaves the ring core alone.
    - EP: per MoE layer per micro-batch, all_to_all dispatch and combine of b·(s/cp)·k·h, in
      forward and backward (4; full recompute adds 2).
    - Tied embeddings whose first and last chunk sit on different ranks: one all_reduce of the
      embedding gradient between those two ranks per step (Megatron's embedding group; the
      engine's `pp_embed`).
    """
    mc, lay, B = work.model, layout, work.dtype_bytes
    m = work.num_microbatches(lay)
    h = mc.hidden_size
    tokens = lay.mbs * work.seq_len / lay.cp  # tokens of one micro-batch on this rank
    chunks = rank_chunks(lay, pp_rank)
    layers = stage(mc, lay, pp_rank)[0]
    bpp = bytes_per_param(work.precision, work.optimizer, work.grad_dtype_bytes)
    grad_bytes = 4 if work.fp32_grad_accum else bpp.grad
    params = rank_param_counts(mc, lay, pp_rank)
    last = num_chunks(lay) - 1  # the chunk with the head
    out: list[Collective] = []

    def add(group, op, dtype, elements, calls, size, phase, note=""):
        if size > 1 and calls > 0 and elements > 0:
            out.append(Collective(group, op, dtype, elements, calls, size, phase, note))

    # --- data parallel / ZeRO over dp×cp (experts over dp·cp/ep; at ep 1 they share the
    # dense weights' buffers, parallel/expert_optim.py) ---
    expert_group = "edp" if lay.ep > 1 else dp_group_name(lay)
    moe = moe_layers_on_rank(mc, lay, pp_rank)
    # the rank's FP8 linears and routed experts (not those train.fp8_keep_out leaves in
    # bf16: plan/fp8_linears.py); experts gathered in FP8 (plan/fp8.py): at ep 1 their
    # amaxes ride in the dense weights' one all-reduce (one gatherer), under ep in the edp
    # gatherer's own
    fp8_linears = rank_fp8_linears(work, lay, pp_rank)
    fp8_experts = fp8_expert_gather_terms(
        work, lay, params["expert"] * fp8_linears.experts / moe if moe else 0.0,
        fp8_linears.experts)
    for k, (group, n, elems) in enumerate((
            (dp_group_name(lay), lay.dp * lay.cp, params["dense"]),
            (expert_group, lay.dp * lay.cp // lay.ep, params["expert"]))):
        rs_calls = m if (lay.zero >= 2 and work.grad_sync == "microbatch") else 1
        if lay.zero == 0:
            add(group, "all_reduce", grad_bytes, elems, 1, n, "grad", "gradients")
        elif lay.zero in (1, 2):
            sync = ("all_reduce" if lay.zero == 1 and work.zero1_grad_sync == "all_reduce"
                    else "reduce_scatter")
            add(group, sync, grad_bytes, elems, rs_calls, n, "grad", "gradients")
            add(group, "all_gather", bpp.param, elems, 1, n, "step", "updated parameters")
        else:  # FP8 linears' weights at 1 byte with parallel.fp8_allgather (plan/fp8.py)
            fp8, amaxes = (fp8_gather_terms(work, lay, fp8_linears,
                                            kv_heads_per_rank(mc, lay.tp))
                           if k == 0 else fp8_experts)
            what = "FP8 linear weights" if k == 0 else "FP8 expert weights"
            if lay.ep == 1:  # one gatherer for both: one all-reduce of all the amaxes
                amaxes = amaxes + fp8_experts[1] if k == 0 else 0
            # their scales: one all_reduce(max) of fp32 amaxes per step
            add(group, "all_reduce", 4, amaxes, 1, n, "fwd", "FP8 weight amaxes")
            if keeps_gathered(work, lay):  # gathered once, kept through every micro-batch
                add(group, "all_gather", bpp.param, elems - fp8, 1, n, "fwd",
                    "parameters (kept)")
                add(group, "all_gather", 1, fp8, 1, n, "fwd", f"{what} (kept)")
                continue
            for phase in ("fwd", "bwd"):
                add(group, "all_gather", bpp.param, elems - fp8, m, n, phase,
                    "parameters (forward)" if phase == "fwd" else "parameters (backward)")
                add(group, "all_gather", 1, fp8, m, n, phase, f"{what} (FP8)")
            add(group, "reduce_scatter", grad_bytes, elems, rs_calls, n, "grad", "gradients")
    if (lay.zero == 3 and mc.tie_embeddings and lay.pp > 1 and 0 in chunks and last in chunks
            and lay.dp * lay.cp > 1):
        # DualPipeV's V puts the tied head on the embedding's rank: the head chunk gathers
        # the embedding's ZeRO-3 unit for its own forward and backward (parallel/zero3.py).
        embedding = mc.vocab_size * h / lay.tp
        add(dp_group_name(lay), "all_gather", bpp.param, embedding, 2 * m, lay.dp * lay.cp,
            "fwd", "tied embedding for the head")
    # delayed FP8 scaling: the step's amax records of this rank's FP8 linears, one
    # all_reduce(max) over the stage's dp x cp x tp ranks (plan/fp8.py)
    add("stage", "all_reduce", 4, delayed_amax_records(work, fp8_linears), 1,
        lay.dp * lay.cp * lay.tp, "step", "FP8 amax records (delayed scaling)")
    if lay.zero >= 1:  # the squared norm of the gradient shards, for clipping (float64)
        add(dp_group_name(lay), "all_reduce", 8, 1, 1, lay.dp * lay.cp, "step", "grad norm")
    elif lay.ep > 1 and params["expert"]:  # whole gradients, but each ep rank other experts
        add("ep", "all_reduce", 8, 1, 1, lay.ep, "step", "grad norm (experts)")

    # --- tensor (+ sequence) parallel ---
    t = lay.tp
    # Full recompute runs each block's forward again in backward, but stops at the last tensor
    # backward needs (torch.utils.checkpoint's early stop): the MLP's closing collective (the
    # down projection's all-reduce or reduce-scatter) is not repeated; the other three are.
    # A MoE layer has one region, the attention: its block runs whole on every tp rank; its
    # closing collective is repeated under full recompute (the MoE block's tensors come after).
    full = lay.recompute == "full"
    moe = moe_layers_on_rank(mc, lay, pp_rank)
    dense = layers - moe
    fwd_regions = dense * (4 if full else 2) + moe * (2 if full else 1)
    fwd_closing = dense * (3 if full else 2) + moe * (2 if full else 1)
    bwd_regions = 2 * dense + moe
    act = tokens * h
    if lay.sp:
        add("tp", "all_gather", B, act, fwd_regions * m, t, "fwd", "layers")
        add("tp", "reduce_scatter", B, act, fwd_closing * m, t, "fwd", "layers")
        add("tp", "all_gather", B, act, bwd_regions * m, t, "bwd", "layers")
        add("tp", "reduce_scatter", B, act, bwd_regions * m, t, "bwd", "layers")
        if lay.sp_saved == "shard":  # the saved shards gathered again for the weight grads
            add("tp", "all_gather", B, act, bwd_regions * m, t, "bwd", REGATHER)
    else:
        add("tp", "all_reduce", B, act, fwd_closing * m, t, "fwd", "layers")
        add("tp", "all_reduce", B, act, bwd_regions * m, t, "bwd", "layers")
    if 0 in chunks:
        add("tp", "reduce_scatter" if lay.sp else "all_reduce", B, act, m, t, "fwd", "embedding")
        if lay.sp:  # the reduce-scatter's backward gathers the embedding output's gradient
            add("tp", "all_gather", B, act, m, t, "bwd", "embedding")
    if num_chunks(lay) - 1 in chunks:
        if lay.sp:
            add("tp", "all_gather", B, act, m, t, "fwd", "head")
            add("tp", "reduce_scatter", B, act, m, t, "bwd", "head")
        else:
            add("tp", "all_reduce", B, act, m, t, "bwd", "head")
        add("tp", "all_reduce", 4, tokens, 3 * m, t, "fwd", "loss")
    if lay.sp:
        # Norm weights (and row-parallel biases) act on this rank's tokens only under SP: their
        # gradients are summed over tp per micro-batch, as soon as backward produces them.
        per_norm = 1 if mc.norm == "rmsnorm" else 2
        tensors = layers * (2 * per_norm + (2 if mc.mlp == "gelu" else 0))
        tensors += per_norm if num_chunks(lay) - 1 in chunks else 0
        add("tp", "all_reduce", grad_bytes, h, tensors * m, t, "bwd", "norm weights (SP)")
    if t > mc.num_kv_heads:
        # A key/value head shared by tp/kv ranks: each rank's gradient covers only its own query
        # heads, so the k and v weights (and biases) are summed over tp per micro-batch.
        kv_elems = 2 * mc.kv_size * (h + (1 if mc.qkv_bias else 0))
        add("tp", "all_reduce", grad_bytes, kv_elems, layers * m, t, "bwd", "shared kv heads")
    if mc.qk_norm:  # one q and one k norm weight shared by heads that tp ranks split
        add("tp", "all_reduce", grad_bytes, mc.dim_per_head, 2 * layers * m, t, "bwd",
            "q/k norm weights")
    # The gradient norm's partial sums of squares meet over each dimension that splits them.
    add("tp", "all_reduce", 8, 1, 1, t, "step", "grad norm")  # float64 (parallel/update.py)
    add("pp", "all_reduce", 8, 1, 1, lay.pp, "step", "grad norm")

    # --- pipeline: count this rank's chunk boundaries that cross to another rank ---
    msg = tokens * h / (t if lay.sp else 1)
    sends_out = sum(1 for c in chunks if c < last and chunk_owner(lay, c + 1) != pp_rank)
    recv_in = sum(1 for c in chunks if c > 0 and chunk_owner(lay, c - 1) != pp_rank)
    add("pp", "send", B, msg, sends_out * m, lay.pp, "fwd", "activations")
    add("pp", "recv", B, msg, recv_in * m, lay.pp, "fwd", "activations")
    add("pp", "send", B, msg, recv_in * m, lay.pp, "bwd", "gradients")
    add("pp", "recv", B, msg, sends_out * m, lay.pp, "bwd", "gradients")

    # --- context parallel: ring attention passes K and V around cp ranks ---
    if lay.cp > 1:
        kv = 2 * tokens * kv_heads_per_rank(mc, t) * mc.dim_per_head
        fwd_runs = (2 if lay.recompute == "full" else 1) * layers * m
        if lay.cp_comm == "allgather":
            add("cp", "all_gather", B, lay.cp * kv, fwd_runs, lay.cp, "fwd", "K,V")
            add("cp", "reduce_scatter", 4, lay.cp * kv, layers * m, lay.cp, "bwd", "dK,dV")
        else:
            for op in ("send", "recv"):
                add("cp", op, B, kv, (lay.cp - 1) * fwd_runs, lay.cp, "fwd", "K,V")
                add("cp", op, B, kv, (lay.cp - 1) * layers * m, lay.cp, "bwd", "K,V")
                add("cp", op, 4, kv, lay.cp * layers * m, lay.cp, "bwd", "dK,dV")

    # --- expert parallel: counts, then dispatch + combine (parallel/expert.py) ---
    # Per MoE layer and micro-batch: the per-expert counts (E int64), the dispatch and the
    # combine forward, the same two reversed in backward; under full recomputation the
    # forward's all-to-alls are replayed, not sent again. A dispatch sends this rank's routed
    # rows T·k·h; a combine the rows its experts ran, T·k·h on average over the ep group.
    if lay.ep > 1 and mc.num_experts:
        routed = tokens * mc.experts_top_k * h
        add("ep", "all_to_all", 8, mc.num_experts, moe * m, lay.ep, "fwd", "expert counts")
        add("ep", "all_to_all", B, routed, 2 * moe * m, lay.ep, "fwd", "tokens")
        add("ep", "all_to_all", B, routed, 2 * moe * m, lay.ep, "bwd", "tokens")
    if mc.num_experts and mc.expert_bias_rate > 0:
        # the global tokens per expert (and the two aux sums) of this rank's MoE layers, for
        # the aux-loss-free bias update (train/moe_stats.py)
        add(dp_group_name(lay), "all_reduce", 4, (mc.num_experts + 2) * moe, 1,
            lay.dp * lay.cp, "step", "expert counts")

    # --- tied embeddings split across the first and last stage (the engine's pp_embed group;
    # none under DualPipeV, whose V puts both ends on rank 0) ---
    split = chunk_owner(lay, 0) != chunk_owner(lay, last)
    if mc.tie_embeddings and split and (0 in chunks or last in chunks):
        add("pp_embed", "all_reduce", grad_bytes, mc.vocab_size * h / t, 1, 2, "grad",
            "tied embedding")
    return out


def ledger_volume(work: Workload, layout: Layout, pp_rank: int = 0) -> dict[str, dict[str, float]]:
    """Ledger bytes per step on one rank of pipeline stage `pp_rank`: {group: {op: bytes}}, in
    the engine's convention (full logical tensors; see `collectives` for every choice)."""
    vol: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in collectives(work, layout, pp_rank):
        vol[c.group][c.op] += c.bytes
    return {g: dict(ops) for g, ops in vol.items()}


def wire_volume(work: Workload, layout: Layout, pp_rank: int = 0) -> dict[str, float]:
    """Bytes per step this rank sends on the wire, by group (ring algorithms)."""
    vol: dict[str, float] = defaultdict(float)
    for c in collectives(work, layout, pp_rank):
        if c.op != "recv":
            vol[c.group] += c.wire_bytes
    return dict(vol)
