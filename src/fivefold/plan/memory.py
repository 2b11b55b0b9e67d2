"""Memory per GPU: model states (plan/model_states.py), activations, logits, communication
buffers and framework overhead, itemised on the most-loaded rank."""

from __future__ import annotations

import dataclasses

from fivefold.plan.activations import (
    ActivationBytes,
    activation_bytes_per_microbatch,
    kept_output_grad_bytes,
    recompute_working_set,
)
from fivefold.plan.allocator import allocator_waste, released_cache
from fivefold.plan.comm_buffers import comm_buffer_bytes
from fivefold.plan.fp8_linears import layer_kinds
from fivefold.plan.hardware import GIB, Assumptions, Hardware, usable_memory
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.model_states import (  # noqa: F401 (bytes_per_param: comm.py's)
    ModelStates,
    bytes_per_param,
    layer_param_counts,
    rank_param_counts,
    shard_model_states,
    work_bytes_per_param,
)
from fivefold.plan.nvme import TierBytes, tier_memory
from fivefold.plan.placement import (
    chunk_layer_counts,
    critical_ranks,
    inflight_microbatches,
    inflight_per_chunk,
    num_chunks,
    pending_weight_passes,
    rank_chunks,
    stage,
)
from fivefold.plan.recompute_plan import BudgetTooSmall, RankPlan, full_layer_activations, plan_rank
from fivefold.plan.torch_pipelining import pipelined_fsdp, stage_buffer_bytes

# Order of the items in reports and stacked bars.
MEMORY_ITEMS = ("params", "grads", "master", "optimizer", "grad_accum", "grad_buffer",
                "activations", "logits_loss", "split_grads", "comm_buffers", "overhead")


def memory_items(work: Workload, layout: Layout, assume: Assumptions, rank: int = 0,
                 act: ActivationBytes | None = None,
                 limit: float | None = None) -> tuple[dict[str, float], float]:
    """Itemised bytes on pipeline rank `rank` at its peak, and the CPU bytes of offload. With
    `limit` (the bytes the rank may fill), the allocator's cache beyond it is released."""
    mc, m = work.model, work.num_microbatches(layout)
    counts = rank_param_counts(mc, layout, rank)
    bpp = work_bytes_per_param(work)
    shards = layout.dp * layout.cp
    states = shard_model_states(counts["dense"], bpp, layout.zero, shards, layout.offload,
                                counts["expert"], max(shards // layout.ep, 1))
    if work.lora_rank:  # a frozen base and trainable adapters (plan/lora.py)
        from fivefold.plan.lora import lora_state_items

        states = ModelStates(**lora_state_items(
            mc, layout, rank, bpp, work.dtype_bytes, counts["dense"] + counts["expert"],
            work.lora_rank, work.lora_targets, work.lora_base,
            sum(layer_param_counts(mc, layout.tp, layout.ep).values())), layout=bpp)
    act = act or _activations(work, layout)
    head = stage(mc, layout, rank)[2]
    inflight = inflight_microbatches(layout, m, rank)
    # A micro-batch's activations in each of the rank's chunks: its layers, the rotary tables
    # its forward computes (when it has layers to use them), the embedding's in chunk 0.
    counts = chunk_layer_counts(mc, layout)
    chunk_layers = [counts[c] for c in rank_chunks(layout, rank)]
    per_microbatch = [layers_activation_bytes(work, layout, act, sum(counts[:c]),
                                              sum(counts[:c + 1]))
                      + (act.rope_tables if counts[c] else 0) + (act.embedding if c == 0 else 0)
                      for c in rank_chunks(layout, rank)]
    alive = inflight_per_chunk(layout, m, rank, tuple(per_microbatch))
    activations = sum(n * b for n, b in zip(alive, per_microbatch)) + _working_set(work, layout)
    if layout.recompute == "auto":  # the per-layer choices under the budget (below the
        # minimum nothing is chosen: full recomputation's bytes stand, over the budget)
        plan = auto_plan(work, layout, rank, assume)
        if plan is not None:
            activations += plan.activations - full_layer_activations(work, layout, rank)
    logits_loss = 0.0
    if head:
        # With one chunk per rank (AFAB, 1F1B, ZB-H1) the head's logits live as long as the
        # rank's other activations: all m under AFAB, until each W under ZB-H1, one under 1F1B.
        # Interleaved and DualPipeV run the head chunk's backward right after its forward.
        live = inflight if num_chunks(layout) == layout.pp else 1
        logits_loss = (act.final_norm + act.logits + act.loss) * live + act.loss_backward
        waiting = _head_weight_passes(layout, m, rank)
        if waiting:
            # A split backward (ZB-H1) materialises the head's logits (parallel/pipeline/
            # stages.py): each micro-batch waiting for its W keeps the final norm's tensors,
            # the head's input and the fp32 logits' gradient, graph retained from B to W. The
            # loss's backward (its gradient, and the cast) runs while one is kept.
            vocab = -(-mc.vocab_size // layout.tp)
            tokens = layout.mbs * work.seq_len / layout.cp
            split = act.final_norm + tokens * mc.hidden_size * work.dtype_bytes
            split += tokens * vocab * 4
            cast = work.dtype_bytes if work.dtype_bytes < 4 else 0
            logits_loss = max(waiting * split, split + tokens * vocab * (4 + cast))
    split_grads = 0.0
    pending = pending_weight_passes(layout, m, rank)
    if any(pending):
        kept = _kept_grads(work, layout)
        counts = chunk_layer_counts(mc, layout)
        last = num_chunks(layout) - 1
        for chunk, waiting in zip(rank_chunks(layout, rank), pending):
            per_microbatch = (counts[chunk] * kept["layer"] + kept["embedding"] * (chunk == 0)
                              + kept["head"] * (chunk == last))
            split_grads += waiting * per_microbatch
    grad_buffer = 0.0
    if layout.zero >= 2 and shards > 1 and work.grad_sync == "step" and (
            m > 1 or pipelined_fsdp(work, layout)):
        # Reduce-scattered once per step, ZeRO-2/3 gradients accumulate whole in .grad over
        # the micro-batches before the last (parallel/data.py); with one micro-batch only a
        # bucket at a time is whole (in comm_buffers), except under torch.distributed.
        # pipelining, whose FSDP2 stages accumulate in fp32 even then (torch_pipelining.py).
        grad_buffer = states.num_params * bpp.grad
    items = {
        "params": states.params, "grads": states.grads, "master": states.master,
        "optimizer": states.optimizer, "grad_accum": states.grad_accum,
        "grad_buffer": grad_buffer, "activations": activations, "logits_loss": logits_loss,
        "split_grads": split_grads,
        "comm_buffers": comm_buffer_bytes(work, layout, rank)
        + stage_buffer_bytes(work, layout, rank, alive),
    }
    if layout.zero == 3 and layout.pp > 1 and work.zero3_keep_gathered_pp and shards > 1:
        # the stage's compute-dtype parameters stay gathered from forward to backward
        items["comm_buffers"] += states.num_params * work.dtype_bytes
    allocated = sum(items.values())
    layer_microbatches = sum(n * k for n, k in zip(alive, chunk_layers))
    waste = allocator_waste(act, layer_microbatches, head, _working_set(work, layout))
    cached = head * assume.head_token_bytes * layout.mbs * work.seq_len / layout.cp * mc.hidden_size
    items["overhead"] = (assume.context_gib * GIB + waste + assume.fragmentation * allocated
                         + assume.activation_reserve * activations
                         + assume.loss_reserve * logits_loss + cached)
    if limit is not None:
        items["overhead"] -= released_cache(sum(items.values()), cached, limit)
    return items, states.cpu


def _head_weight_passes(layout: Layout, num_microbatches: int, rank: int) -> int:
    """Micro-batches of the head's chunk on `rank` waiting for their W at the peak (0 when
    the rank has no head or runs its backward whole)."""
    last = num_chunks(layout) - 1
    chunks = rank_chunks(layout, rank)
    if last not in chunks:
        return 0
    return pending_weight_passes(layout, num_microbatches, rank)[chunks.index(last)]


def _act_kwargs(work: Workload, layout: Layout) -> dict:
    # auto: full recomputation's terms; memory_items replaces its layers' (recompute_plan.py)
    recompute = "full" if layout.recompute == "auto" else layout.recompute
    return {"tp": layout.tp, "sp": layout.sp, "cp": layout.cp, "recompute": recompute,
            "dtype_bytes": work.dtype_bytes, "flash": work.flash, "dropout": work.dropout,
            "sp_saves_gathered": layout.sp_saved != "shard", "cp_comm": layout.cp_comm,
            "ep": layout.ep, "fp8_recipe": work.fp8_recipe if work.precision == "fp8" else "",
            "chunked_loss": work.chunked_loss, "loss_parallel": work.loss_parallel,
            "softmax_loss": work.softmax_loss, "loss_device_memory": work.loss_device_memory}


def layers_activation_bytes(work: Workload, layout: Layout, act: ActivationBytes, first: int,
                            stop: int) -> float:
    """The saved bytes of one micro-batch of layers first .. stop-1: `act.layer` each, but
    a layer with linears train.fp8_keep_out leaves in bf16 saves their inputs as bf16
    does (plan/fp8_linears.py; `apply_fp8_terms`)."""
    if not (work.precision == "fp8" and work.fp8_keep_out):
        return act.layer * (stop - first)
    return sum(n * activation_bytes_per_microbatch(work.model, layout.mbs, work.seq_len,
                                                   fp8_linears=linears,
                                                   **_act_kwargs(work, layout)).layer
               for linears, n in layer_kinds(work, first, stop))


def _activations(work: Workload, layout: Layout) -> ActivationBytes:
    return activation_bytes_per_microbatch(work.model, layout.mbs, work.seq_len,
                                           **_act_kwargs(work, layout))


def _kept_grads(work: Workload, layout: Layout) -> dict[str, float]:
    return kept_output_grad_bytes(work.model, layout.mbs, work.seq_len, tp=layout.tp,
                                  sp=layout.sp, cp=layout.cp, dtype_bytes=work.dtype_bytes)


def _working_set(work: Workload, layout: Layout) -> float:
    return recompute_working_set(work.model, layout.mbs, work.seq_len,
                                 **_act_kwargs(work, layout))


def peak_memory(work: Workload, layout: Layout, assume: Assumptions,
                limit: float | None = None) -> tuple[int, dict[str, float], float]:
    """(pipeline rank, items, cpu bytes) of the most-loaded rank."""
    act = _activations(work, layout)
    best = None
    for rank in critical_ranks(work.model, layout):
        items, cpu = memory_items(work, layout, assume, rank, act, limit)
        total = sum(items.values())
        if best is None or total > best[0]:
            best = (total, rank, items, cpu)
    return best[1], best[2], best[3]


def placed_peak(work: Workload, layout: Layout, hw: Hardware,
                assume: Assumptions) -> tuple[int, TierBytes]:
    """(the most-loaded pipeline rank, its bytes placed by offload tier, plan/nvme.py) under
    `usable_memory(hw, assume)`: what `plan_layout` reports and judges."""
    rank, items, cpu = peak_memory(work, layout, assume, usable_memory(hw, assume))
    return rank, tier_memory(items, cpu, layout.offload, hw)


def _full_allocated(work: Workload, layout: Layout, assume: Assumptions, rank: int) -> float:
    """Peak allocated bytes of `rank` under full recomputation (the items but the overhead)."""
    items, _ = memory_items(work, dataclasses.replace(layout, recompute="full"), assume, rank)
    return sum(v for k, v in items.items() if k != "overhead")


def auto_plan(work: Workload, layout: Layout, rank: int,
              assume: Assumptions | None = None) -> RankPlan | None:
    """recompute = auto: the per-layer plan of `rank` under the budget (plan/recompute_plan.py),
    or None where even full recomputation does not fit."""
    assume = assume or Assumptions()
    try:
        return plan_rank(work, layout, rank, _full_allocated(work, layout, assume, rank), assume)
    except BudgetTooSmall:
        return None


def minimum_budget(work: Workload, layout: Layout, assume: Assumptions | None = None) -> float:
    """GiB of peak allocated memory under full recomputation: the smallest budget recompute =
    auto accepts (the most-loaded pipeline rank's)."""
    assume = assume or Assumptions()
    return max(_full_allocated(work, layout, assume, rank) for rank in range(layout.pp)) / GIB
