"""Step time = compute + exposed communication + pipeline bubble + optimizer step.

Compute per micro-batch on a pipeline rank: GEMM FLOPs at the device's achievable GEMM rate
(shrinking for thin GEMMs), attention at a lower rate, and elementwise kernels (norms, RoPE,
SwiGLU, residuals, softmax of the loss) at HBM bandwidth. Backward is 2× the forward GEMMs,
2.5× flash attention's forward (it recomputes the probabilities; Dao 2022). The pipeline runs
at the pace of its slowest rank; its bubble is `layout.bubble_ratio` of the ideal time.
Overlap: TP is exposed (unless `tp_overlap`), except in the GPU's idle time under an eager
engine's host-bound micro-batch (`RankCompute.host_slack`); CP's K/V ring hides behind the
attention core; DP/ZeRO hide behind the backward (gradients) and forward (parameters) of one
micro-batch, as bucketed overlap does (Ultra-Scale Playbook, appendix A3); EP all-to-all is
exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from fivefold.plan.activations import kv_heads_per_rank, op_sac_recomputed_matmul_share
from fivefold.plan.comm import REGATHER, collectives
from fivefold.plan.flops import forward_flops_per_token
from fivefold.plan.fp8 import (
    expert_cast_bytes,
    fp8_gathers,
    gather_refresh_bytes,
    rank_dense_cast_bytes,
    rank_gather_cast_bytes,
)
from fivefold.plan.fp8_linears import fp8_gemm_flops, rank_fp8_linears
from fivefold.plan.hardware import (
    Assumptions,
    Hardware,
    profile_attention_rate,
    profile_host_layer_ms,
    profile_matmul_rate,
    runs_on_host,
)
from fivefold.plan.layout import (
    Layout,
    Workload,
    bubble_ratio,
    critical_ranks,
    moe_layers_on_rank,
    stage,
)
from fivefold.plan.memory import (
    auto_plan,
    rank_param_counts,
    shard_model_states,
    work_bytes_per_param,
)
from fivefold.plan.network import (  # noqa: F401 (re-exported: timing's names before)
    DP_GROUPS,
    blocked_host_s,
    call_time,
    collective_time,
    ddp_pp_message_s,
    group_link,
    rail_gbps,
)
from fivefold.plan.nvme import NvmeTime, nvme_states, nvme_time
from fivefold.plan.recompute_plan import recompute_seconds

GEMM_HALF_SIZE = 128  # a GEMM whose smallest side is 128 runs at half the large-GEMM rate


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part (all parts add up to `total`)."""

    compute: float  # m micro-batches on the slowest rank, recomputation included
    tp_comm: float  # exposed
    cp_comm: float
    ep_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    straggler: float = 0.0  # waiting for the slowest of the ranks (`straggler_time`)
    recompute: float = 0.0  # the share of `compute` spent recomputing (not added to total)

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm
                + self.bubble + self.dp_comm + self.optimizer + self.straggler)

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "recompute"}


@dataclass(frozen=True)
class RankCompute:
    forward: float
    backward: float  # recomputation included
    recompute: float
    attention_fwd: float  # one micro-batch, all layers on the rank
    gemm_fwd: float = 0.0  # the layers' forward GEMMs, one micro-batch
    # Host time per micro-batch beyond the GPU's work (its floor raised forward and
    # backward by this much): the GPU idles there, so kernels the host queued ahead, the
    # TP calls, run in it (`step_time`).
    host_slack: float = 0.0


def rank_compute(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                 rank: int) -> RankCompute:
    """Forward and backward seconds of one micro-batch on pipeline rank `rank`."""
    mc, lay, B = work.model, layout, work.dtype_bytes
    tokens = lay.mbs * work.seq_len / lay.cp
    layers, _, head = stage(mc, lay, rank)
    fwd = forward_flops_per_token(mc, work.seq_len)
    peak = hw.peak_flops(work.precision)
    # fp8: the linears' and experts' GEMMs at the FP8 peak; attention, the output head and
    # the loss stay in bf16 (DeepSeek-V3 §3.3; lowp/convert.py). Quantisation's cast
    # kernels, the dense linears' and the routed experts', at the HBM rate (plan/fp8.py).
    high_peak = hw.peak_flops("bf16") if work.precision == "fp8" else peak
    h, t = mc.hidden_size, lay.tp
    q, kv = mc.num_heads * mc.dim_per_head, mc.num_kv_heads * mc.dim_per_head
    ffn = mc.moe_intermediate_size if mc.num_experts else mc.intermediate_size
    thin = min(tokens, q / t, (mc.intermediate_size if mc.num_moe_layers < mc.num_layers
                               else ffn) / t, h)
    # A GEMM's efficiency grows with its thinnest side: measured (calibrate) or modelled.
    gemm_rate = (profile_matmul_rate(hw, thin)
                 or peak * hw.matmul_efficiency * thin / (thin + GEMM_HALF_SIZE))
    hbm = hw.hbm_tbps * 1e12 * assume.hbm_efficiency
    scale = 1 + assume.compute_overhead  # launches, syncs, data loading: not modelled
    moe = moe_layers_on_rank(mc, lay, rank)
    # MoE blocks run whole on every tp rank (router, k experts, shared expert), as grouped
    # GEMMs whose groups hold tokens·k·ep/E rows each on average: thin for many experts.
    moe_mm = 2 * sum(mc.moe_params(active=True).values()) if moe else 0.0
    rows = tokens * mc.experts_top_k * lay.ep / mc.num_experts if moe else 1.0
    thin_e = min(rows, mc.moe_intermediate_size or 1, h)
    expert_rate = (profile_matmul_rate(hw, thin_e)
                   or peak * hw.matmul_efficiency * thin_e / (thin_e + GEMM_HALF_SIZE))
    other_mm = layers * fwd.layer_matmul - moe * moe_mm
    if moe:  # layer_matmul averages dense and MoE layers over the model; this rank's mix
        attn_mm = 2 * (2 * h * q + 2 * h * kv)
        other_mm = layers * attn_mm + (layers - moe) * 2 * (
            3 if mc.mlp == "swiglu" else 2) * h * mc.intermediate_size
    # The FP8 linears' GEMMs at the FP8 rate; the kept-out linears' (train.fp8_keep_out),
    # the router's and a shared expert's gate at bf16's (plan/fp8_linears.py)
    fp8 = rank_fp8_linears(work, lay, rank)
    fp8_split, fp8_whole = fp8_gemm_flops(mc, fp8, t)
    slow = peak / high_peak  # 1 unless precision = fp8
    gemm_fp8 = tokens * (fp8_split / gemm_rate + fp8_whole / expert_rate) * scale
    gemm = gemm_fp8 + tokens * ((other_mm / t - fp8_split) / gemm_rate
                                + (moe * moe_mm - fp8_whole) / expert_rate) * slow * scale
    # flash skips the masked half of the causal square; math attention computes all of it
    attn_flops = tokens * layers * fwd.layer_attention / t * (0.5 if work.flash else 1.0)
    attn_rate = (profile_attention_rate(hw, work.seq_len / lay.cp)
                 or high_peak * hw.matmul_efficiency * assume.attention_efficiency)
    attn = attn_flops / attn_rate * scale
    # HBM traffic of elementwise kernels per layer: two norms (read+write h each), two
    # residual adds (2 reads + 1 write), RoPE on q and k, the SwiGLU product (3f) or GeLU (2f).
    seq_div = t if lay.sp else 1
    act_f = 3 if mc.mlp == "swiglu" or mc.num_experts else 2
    k_routed = mc.experts_top_k if mc.num_experts else 1
    elem_bytes = tokens * B * (10 * h / seq_div + (2 * (q + kv) + act_f * ffn * k_routed) / t)
    elem = layers * elem_bytes / hbm * scale
    dense_f, dense_b = rank_dense_cast_bytes(work, lay, tokens, fp8)
    local_experts = mc.num_experts / lay.ep if moe else 0  # parallel.fp8_allgather's gathers
    gather_f, gather_b = rank_gather_cast_bytes(
        work, lay, fp8, kv_heads_per_rank(mc, t),
        fp8.experts * 3 * local_experts * h * mc.moe_intermediate_size)
    cast_fwd, cast_bwd = (dense_f + gather_f) / hbm * scale, (dense_b + gather_b) / hbm * scale
    if fp8.experts:  # FP8 routed experts: their casts and loop copies
        per = expert_cast_bytes(work.fp8_recipe, tokens * mc.experts_top_k, local_experts, h,
                                mc.moe_intermediate_size, B, fp8_gathers(work, lay)[0] > 0,
                                getattr(work, "fp8_scaling", "dynamic"))
        cast_fwd += fp8.experts * (per["casts"][0] + per["loop"][0]) / hbm * scale
        cast_bwd += fp8.experts * (per["casts"][1] + per["loop"][1]) / hbm * scale
    head_time = 0.0
    if head:  # the output GEMM, and an fp32 softmax over the vocabulary
        head_time = (tokens * fwd.head / t / (gemm_rate * high_peak / peak)
                     + tokens * mc.vocab_size / t * (2 * B + 12) / hbm) * scale
    layers_fwd = gemm + attn + elem + cast_fwd
    forward = layers_fwd + head_time
    # Selective recomputation re-runs the attention core, except the ring core under cp > 1
    # (parallel/context/: it keeps only O(s) tensors, and a re-run would repeat its transfers).
    selective = attn if lay.cp == 1 else 0.0
    # (The re-run forward takes the units the backward gathered: no FP8 gather of its own.)
    # Nor a dense layer's bf16 down projection: the re-run stops before its GEMM (plan/
    # recompute_plan.py `rerun_down`); an FP8 one runs again.
    bf16_down = ((layers - moe - fp8.down) * tokens * 2 * h * mc.intermediate_size / t
                 / gemm_rate * slow * scale) if work.recompute_early_stop else 0.0
    recompute = {"full": layers_fwd - gather_f / hbm * scale - bf16_down,
                 "selective": selective}.get(lay.recompute, 0.0)
    if lay.recompute == "op":  # the matmuls it does not keep and every elementwise kernel
        share = op_sac_recomputed_matmul_share(mc)  # (their forward casts: by FLOP share)
        recompute = gemm * share + elem + share * dense_f / hbm * scale
    if lay.recompute == "auto":  # the per-layer choices under the budget
        plan = auto_plan(work, lay, rank)  # ranked at the default GPU's rates, as the engine
        recompute = recompute_seconds(work, lay, rank, hw, assume, plan) * scale
    # A frozen base (LoRA, plan/lora.py) runs no weight-gradient GEMMs: its backward is the
    # input-gradient GEMM alone (the adapters' rank-r GEMMs are thin and left out).
    # rowwise_gw_hp's weight gradients (the dense linears' and the routed experts' loop)
    # are bf16 GEMMs of the saved bf16 input (lowp/linear.py): that pass at bf16's peak.
    wgrad = gemm + gemm_fp8 * (slow - 1 if work.precision == "fp8"
                               and work.fp8_recipe == "rowwise_gw_hp" else 0.0)
    backward = (gemm + head_time + (0.0 if work.lora_rank else wgrad + head_time)
                + 2 * elem + cast_bwd
                + attn * (2.5 if work.flash else 2.0) + recompute)
    # An eager engine's host time per layer (assume.host_layer_ms, else calibrate's measured
    # one; a third of it in forward). On a GPU it bounds a micro-batch from below when the
    # GPU's share is shorter (tp spreads it thin); on a CPU the same cores run it between the
    # kernels, so it adds.
    host = (assume.host_layer_ms or profile_host_layer_ms(hw) or 0.0) * 1e-3 * layers
    slack = 0.0
    if runs_on_host(hw):
        forward, backward = forward + host / 3, backward + 2 * host / 3
    else:
        gpu = forward + backward
        forward, backward = max(forward, host / 3), max(backward, 2 * host / 3)
        slack = forward + backward - gpu
    return RankCompute(forward, backward, recompute, attn, gemm, slack)


def step_time(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions) -> StepTime:
    """Predicted seconds per optimizer step and their parts (see the module docstring)."""
    lay = layout
    m = work.num_microbatches(lay)
    bucket = work.bucket_mb * 1e6
    worst = None
    for rank in _timed_ranks(work, lay, assume):
        rc = rank_compute(work, lay, hw, assume, rank)
        colls = collectives(work, lay, rank)
        per = {"tp": 0.0, "cp": 0.0, "ep": 0.0, "pp": 0.0}
        dp = {"fwd": 0.0, "bwd": 0.0, "grad": 0.0, "step": 0.0}
        cp_fwd = cp_bwd = cp_exposed = regather = 0.0
        for c in colls:
            if c.note == REGATHER:  # hides behind the input-gradient GEMMs it overlaps
                regather += collective_time(c, hw, assume, lay)
            elif c.group in ("tp", "ep"):
                per[c.group] += collective_time(c, hw, assume, lay)
            elif c.group == "cp" and c.op == "send":  # the ring: overlapped with attention
                tcp = collective_time(c, hw, assume, lay)
                cp_fwd, cp_bwd = (cp_fwd + tcp, cp_bwd) if c.phase == "fwd" else (cp_fwd,
                                                                                   cp_bwd + tcp)
            elif c.group == "cp" and c.op != "recv":  # all-gather K/V: exposed (Llama 3)
                cp_exposed += collective_time(c, hw, assume, lay)
            elif c.group == "pp":
                per["pp"] += call_time(c, hw, assume, lay, bucket)
            elif c.group in DP_GROUPS:
                dp[c.phase] += call_time(c, hw, assume, lay, bucket)
        # The column linears' input-gradient GEMMs (about their forward GEMMs, half the
        # layers' matmul time) run while the saved shards are gathered again.
        regather = max(0.0, regather - m * rc.gemm_fwd / 2)
        tp = (per["tp"] + regather) * (1 - assume.tp_overlap)
        # Where the host's time per micro-batch passes the GPU's, the GPU idles; the TP
        # calls the host has queued run there (their kernels wait on the GPU, not the
        # host), so a micro-batch takes the longer of the host's time and the GPU's work
        # with its TP calls, the blocked waits below on the host's side.
        tp = max(0.0, tp - m * rc.host_slack)
        tp += _blocked_exposed(work, lay, hw, assume, rank, colls,
                               rc.forward + rc.backward + (tp + per["ep"]) / m)
        core_runs = 2 if lay.recompute == "full" else 1  # selective leaves the ring core alone
        cp = (max(0.0, cp_fwd - m * core_runs * rc.attention_fwd)
              + max(0.0, cp_bwd - m * 2.5 * rc.attention_fwd) + cp_exposed)
        mb = rc.forward + rc.backward
        # DP overlap windows: ZeRO-3 gathers hide behind each micro-batch's forward and
        # backward; the end-of-backward reduction behind the last backward (every backward
        # when reduced per micro-batch); the ZeRO-1/2 parameter all-gather behind the next
        # step's first forward. At least one bucket always shows.
        if lay.zero == 3:
            exposed_dp = (max(0.0, dp["fwd"] - m * rc.forward)
                          + max(0.0, dp["bwd"] + dp["grad"] - m * rc.backward))
        elif lay.zero in (1, 2) and work.zero_sync_blocking:
            exposed_dp = dp["grad"] + dp["step"]
        else:
            per_mb = lay.zero == 2 and work.grad_sync == "microbatch"
            exposed_dp = (max(0.0, dp["grad"] - (m if per_mb else 1) * rc.backward)
                          + max(0.0, dp["step"] - rc.forward))
        if any(dp.values()):
            exposed_dp = max(exposed_dp, _one_bucket(work, lay, hw, assume, bucket))
        # The messages' hold on the host under DDP makes an interior rank the slowest.
        held = sum(ddp_pp_message_s(c, assume, lay) for c in colls)
        entry = (mb + (tp + cp + per["ep"] + held) / m, rc, tp, cp, per["ep"], per["pp"],
                 exposed_dp, rank)
        if worst is None or entry[0] > worst[0]:
            worst = entry
    mb_time, rc, tp, cp, ep, pp, exposed_dp, slowest = worst
    compute = m * (rc.forward + rc.backward)
    # Each fill and drain step of the pipeline also waits for its stage's messages: the
    # other stages' micro-batches carry the slowest rank's point-to-point time per
    # micro-batch (a cross-node hop when pp neighbours sit on other nodes).
    bubble = bubble_ratio(lay, m) * m * _others_microbatch(
        work, lay, hw, assume, slowest, mb_time,
        mb_time - (rc.forward + rc.backward) + pp / m)
    return StepTime(compute=compute, tp_comm=tp, cp_comm=cp, ep_comm=ep, pp_comm=pp,
                    bubble=bubble, dp_comm=exposed_dp,
                    optimizer=optimizer_time(work, lay, hw, assume),
                    straggler=straggler_time(lay, assume, compute + bubble),
                    recompute=m * rc.recompute)


def _timed_ranks(work: Workload, layout: Layout, assume: Assumptions) -> tuple[int, ...]:
    """The pipeline ranks whose step `step_time` plans: the critical ones, and where each
    pipeline message holds the host under DDP (`network.ddp_pp_message_s`), the interior
    rank with the most layers too, which passes twice the first and last stage's
    messages."""
    ranks = critical_ranks(work.model, layout)
    if (layout.pp < 3 or layout.zero != 0 or layout.dp == 1
            or not assume.ddp_pp_message_ms):
        return ranks
    inner = max(range(1, layout.pp - 1), key=lambda r: stage(work.model, layout, r)[0])
    return tuple(sorted(set(ranks) | {inner}))


def _blocked_exposed(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                     rank: int, colls: list, gpu_mb: float) -> float:
    """Seconds per step the host's blocked waits on TP calls (`network.blocked_host_s`)
    add to a rank. They hold the host, not the GPU: a micro-batch takes the longer of the
    GPU's work (`gpu_mb`) and the host's (its time per layer, `host_layer_ms`, plus the
    waits), so they show only by how much the host's passes the GPU's; on a CPU device
    the same cores run both, so they add."""
    blocked = sum(blocked_host_s(c, assume, layout) for c in colls)
    if not blocked:
        return 0.0
    if runs_on_host(hw):
        return blocked
    m = work.num_microbatches(layout)
    layers = stage(work.model, layout, rank)[0]
    host_mb = ((assume.host_layer_ms or profile_host_layer_ms(hw) or 0.0) * 1e-3 * layers
               + blocked / m)
    return m * max(0.0, host_mb - gpu_mb)


def straggler_time(layout: Layout, assume: Assumptions, busy: float) -> float:
    """The step ends when the slowest rank does: with every rank's busy time spread by
    `straggler_sigma` (relative), the slowest of N ranks takes σ·√(2 ln N) longer on
    average (the expected maximum of N normal variables), N the world size (every step
    ends in a collective over all of it). 0 on one rank or with σ = 0."""
    n = layout.world_size
    if n < 2 or not assume.straggler_sigma:
        return 0.0
    return busy * assume.straggler_sigma * math.sqrt(2 * math.log(n))


def _others_microbatch(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                       slowest: int, mb_time: float, comm: float) -> float:
    """The mean micro-batch time of the pipeline ranks other than the slowest one. A
    pipeline's fill and drain run the other stages' forwards and backwards while the slowest
    waits: 1F1B takes (m − 1)·max_s t_s + Σ_s t_s (Narayanan 2021 §2.2.1 with stages of
    unequal time), so its bubble is Σ over the other stages, (p − 1)/m · m · their mean;
    equal stages give back (p − 1)·t. The other schedules' ratios scale the same mean.
    Their communication per micro-batch is the slowest rank's (`comm`), in proportion to
    layers."""
    if layout.pp == 1:
        return mb_time
    layers = max(1, stage(work.model, layout, slowest)[0])
    seen: dict = {}
    times = []
    for rank in range(layout.pp):
        if rank == slowest:
            continue
        key = (stage(work.model, layout, rank), moe_layers_on_rank(work.model, layout, rank))
        if key not in seen:
            rc = rank_compute(work, layout, hw, assume, rank)
            seen[key] = rc.forward + rc.backward + comm * key[0][0] / layers
        times.append(seen[key])
    return sum(times) / len(times)


def step_lower_bound(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions,
                     cache: dict | None = None) -> float:
    """Seconds a step takes at least: the slowest pipeline rank's micro-batches and the
    bubble at the quickest stage's pace, no communication (`step_time` adds only to it).
    `cache` keeps each rank's compute between calls of one search (by the layout fields
    compute depends on)."""
    lay, cache = layout, {} if cache is None else cache
    m = work.num_microbatches(lay)
    key = (lay.tp, lay.cp, lay.pp, lay.mbs, lay.schedule, lay.virtual_stages, lay.recompute,
           lay.sp)
    cached = cache.get(key)
    if cached is None:
        def rank_mb(rank):
            rkey = (lay.tp, lay.cp, lay.mbs, lay.recompute, lay.sp,
                    stage(work.model, lay, rank))
            rc = cache.get(rkey)
            if rc is None:
                one = rank_compute(work, lay, hw, assume, rank)
                rc = cache[rkey] = one.forward + one.backward
            return rc
        # the slowest stage's micro-batches; the bubble is the other stages' fill and
        # drain (`_others_microbatch`), at least the quickest stage's time each
        cached = cache[key] = (
            max(rank_mb(r) for r in critical_ranks(work.model, lay)),
            min(rank_mb(r) for r in range(lay.pp)) if lay.pp > 1 else 0.0)
    per_mb, quickest = cached
    return m * per_mb + bubble_ratio(lay, m) * m * quickest


def _one_bucket(work, layout, hw, assume, bucket: float) -> float:
    bw, _ = group_link(hw, layout, "dp", assume)
    n = layout.dp * layout.cp
    return 2 * (n - 1) / n * bucket / (bw * assume.bandwidth_efficiency)


def optimizer_time(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions) -> float:
    """The Adam step streams every state of the rank's shard through HBM once (read param,
    grad, master, moments; write param, master, moments). Offloaded: gradients down and
    parameters up over PCIe, and the update at host-memory bandwidth shared by the node."""
    bpp = work_bytes_per_param(work)
    counts = rank_param_counts(work.model, layout, 0)
    shards = layout.dp * layout.cp if layout.zero >= 1 else 1
    elems = counts["dense"] / shards + counts["expert"] / max(
        shards // layout.ep if layout.zero >= 1 else 1, 1)
    traffic = bpp.param + bpp.grad + 2 * (bpp.master + bpp.optimizer) + bpp.param
    ns = 0.0
    if work.optimizer == "muon":  # every rank orthogonalises its stage's whole matrices
        from fivefold.plan.optimizer import newton_schulz_flops

        ns = newton_schulz_flops(work.model, exclude=work.muon_exclude) / layout.pp / (
            hw.peak_flops("bf16") * hw.matmul_efficiency)  # in bf16, as the engine
    hbm = hw.hbm_tbps * 1e12 * assume.hbm_efficiency
    # parallel.fp8_allgather's scale refresh: once per step, the amax of the rank's shard
    # of its FP8-gathered weights (plan/fp8.py `gather_refresh_bytes`)
    mc, fp8 = work.model, rank_fp8_linears(work, layout, 0)
    local_experts = mc.num_experts / layout.ep if mc.num_experts else 0
    refresh = gather_refresh_bytes(
        work, layout, fp8, kv_heads_per_rank(mc, layout.tp),
        fp8.experts * 3 * local_experts * mc.hidden_size * mc.moe_intermediate_size) / hbm
    resident = elems * traffic / hbm + ns + refresh
    if not layout.offload:
        return resident
    pcie = elems * (bpp.grad + bpp.param) / (hw.host_link_gbps * 1e9)
    host = elems * 2 * (bpp.master + bpp.optimizer + 4) / (
        assume.cpu_adam_gbps * 1e9 / hw.gpus_per_node)
    # on a CPU device the offloaded update is the resident one: no link, the same memory
    update = resident if hw.device_is_host else pcie + host + ns + refresh
    if layout.offload != "nvme":
        return update
    return offload_nvme_time(work, layout, hw, update).step


def offload_nvme_time(work: Workload, layout: Layout, hw: Hardware, update: float) -> NvmeTime:
    """The NVMe tier's step on pipeline rank 0: its offloaded states (what CPU offload would
    put in host memory) read and written once, beside `update` (plan/nvme.py)."""
    counts = rank_param_counts(work.model, layout, 0)
    shards = layout.dp * layout.cp
    states = shard_model_states(counts["dense"], work_bytes_per_param(work), layout.zero,
                                shards, True, counts["expert"], max(shards // layout.ep, 1))
    return nvme_time(nvme_states(states.cpu).disk, update, hw)
