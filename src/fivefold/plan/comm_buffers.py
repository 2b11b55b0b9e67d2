"""The transient buffers of the collectives on one pipeline rank: data parallelism's and
ZeRO's gradient buckets and gathered units, the pipeline's receive buffers, context
parallelism's K/V blocks and expert parallelism's dispatch buffers."""

from __future__ import annotations

from fivefold.plan.activations import kv_heads_per_rank
from fivefold.plan.fp8 import fp8_expert_gather_terms, fp8_gather_terms
from fivefold.plan.fp8_linears import layer_fp8_linears, layer_kinds
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.model_states import bytes_per_param, layer_param_counts, rank_param_counts
from fivefold.plan.placement import chunk_layer_counts, num_chunks, rank_chunks
from fivefold.plan.torch_pipelining import deferred_sync_grad_bytes, pipelined_fsdp


def dp_comm_buffer_bytes(work: Workload, layout: Layout, rank: int) -> float:
    """The most pipeline rank `rank` holds in DP/ZeRO's buffers: in backward, its gradient
    buckets and gathered ZeRO-3 units (`_dp_bucket_bytes`); in Muon's or Adafactor's step,
    after them, the one whole tensor gathered (plan/optimizer.py `gathered_bytes`)."""
    from fivefold.plan.optimizer import gathered_bytes

    return max(_dp_bucket_bytes(work, layout, rank), gathered_bytes(work, layout, rank))


def _dp_bucket_bytes(work: Workload, layout: Layout, rank: int) -> float:
    """The gradient buckets and gathered ZeRO-3 units pipeline rank `rank` holds at its peak,
    as parallel/data.py and parallel/zero3.py run them (checked against the engine's peak
    tracker, parallel/peak.py).

    DP and ZeRO-1 reduce in place in the gradient buffer: nothing extra. ZeRO-2 stages at
    most `buckets_in_flight` buckets (k), never more than the rank's gradient. ZeRO-3's units
    are a chunk's blocks and its rest (embedding, final norm, head); per chunk, the most of:
      forward   its rest + 2 blocks gathered (current + prefetched), as parameters
      backward  its rest gathered, and staged if the chunk ends the model (from the first
                gradient, final norm and head, to the last); then, when block n (counting
                down) starts filling: blocks n and n-1 gathered, n staged and up to k-1
                later blocks staged, their reductions on the wire (the rest, filling across
                them, is not one of the k: parallel/data.py)
    and, when a tied embedding spans two pipeline ranks (its gradient is complete only after
    the holders' all-reduce, so every gradient is staged after backward): k of the rank's
    largest units, as gradients."""
    mc = work.model
    if layout.dp * layout.cp == 1 or layout.zero <= 1:
        return 0.0
    bpp = bytes_per_param(work.precision, work.optimizer, work.grad_dtype_bytes)
    k = work.buckets_in_flight
    counts = rank_param_counts(mc, layout, rank)
    if layout.zero == 2:
        grads = counts["dense"] + counts["expert"]
        if work.lora_rank:  # only the adapters have gradients (plan/lora.py)
            from fivefold.plan.lora import lora_param_split

            grads = lora_param_split(mc, layout, rank, work.lora_rank, work.lora_targets,
                                     grads)["adapters"]
        return min(k * work.bucket_mb * 1e6, grads * bpp.grad)
    per_layer = sum(layer_param_counts(mc, layout.tp, layout.ep).values())
    vocab = mc.vocab_size * mc.hidden_size / layout.tp
    norm = (1 if mc.norm == "rmsnorm" else 2) * mc.hidden_size
    if pipelined_fsdp(work, layout) and work.zero3_keep_gathered_pp:  # plan/torch_pipelining.py
        return deferred_sync_grad_bytes(work, layout, rank, per_layer, vocab, norm)
    frozen = 0.0  # bytes of a block's gathered frozen base (LoRA: parallel/zero3_frozen.py)
    if work.lora_rank:  # the units hold the adapters alone; the frozen rest is no unit
        from fivefold.plan.lora import block_frozen_bytes, layer_lora_counts, sharded_block_bytes

        per_layer = layer_lora_counts(mc, work.lora_rank, work.lora_targets,
                                      layout.tp)["adapters"]
        vocab = norm = 0.0
        shards = layout.dp * layout.cp
        frozen = shards * sharded_block_bytes(block_frozen_bytes(
            mc, layout, work.lora_rank, work.lora_targets, work.lora_base, work.dtype_bytes,
            sum(layer_param_counts(mc, layout.tp, layout.ep).values())), shards)
    layers, chunks = chunk_layer_counts(mc, layout), rank_chunks(layout, rank)
    last = num_chunks(layout) - 1
    fp8_held = fp8_gather_buffers(work, layout, per_layer)
    # A tied head on another rank than the embedding holds its own copy; on the same rank
    # it uses the embedding (the same weight, or borrowed and gathered again: DualPipeV).
    tied_across = mc.tie_embeddings and layout.pp > 1 and ((0 in chunks) != (last in chunks))
    peak, units = 0.0, []
    for c in chunks:
        first = sum(layers[:c])  # the chunk's blocks are layers first .. first + layers[c] - 1
        # FP8 gathers: forward, block i in use and i + 1 prefetched; backward, block n
        # (counting down) in use and n - 1 prefetched
        fp8_fwd = max((fp8_held(first + i, first + i + 1 if i + 1 < layers[c] else None)
                       for i in range(layers[c])), default=0.0)
        fp8_bwd = [fp8_held(first + n, first + n - 1 if n else None) for n in range(layers[c])]
        rest, borrowed = (vocab if c == 0 else 0.0), 0.0
        if c == last:
            head = vocab if not mc.tie_embeddings or 0 not in chunks else 0.0
            rest += norm + head
            borrowed = vocab if mc.tie_embeddings and c != 0 and 0 in chunks else 0.0
        gathered = (rest + borrowed) * bpp.param
        peak = max(peak, gathered + min(2, layers[c]) * per_layer * bpp.param
                   + min(2, layers[c]) * frozen + fp8_fwd)
        if not tied_across:
            staged = (rest if c == last else 0.0) * bpp.grad
            blocks = max(((min(2, n + 1) * bpp.param
                           + (1 + min(k - 1, layers[c] - 1 - n)) * bpp.grad) * per_layer
                          + fp8_bwd[n] for n in range(layers[c])), default=0)
            peak = max(peak, gathered + staged + blocks)
            if frozen:  # blocks n and n-1's frozen bases are gathered with their adapters
                peak = max(peak, gathered + staged + max(
                    min(2, n + 1) * (bpp.param * per_layer + frozen)
                     + (1 + min(k - 1, layers[c] - 1 - n)) * bpp.grad * per_layer
                     for n in range(layers[c])))
        units += [rest] * (rest > 0) + [per_layer] * layers[c]
    if tied_across:
        peak = max(peak, sum(sorted(units)[-k:]) * bpp.grad)
    return peak


def comm_buffer_bytes(work: Workload, layout: Layout, rank: int) -> float:
    """Transient buffers of the collectives: DP/ZeRO's (`dp_comm_buffer_bytes`); PP receive
    buffers for an activation and a gradient; CP's double-buffered K/V chunk;
    EP's dispatch buffers."""
    mc, B = work.model, work.dtype_bytes
    tokens = layout.mbs * work.seq_len / layout.cp
    total = dp_comm_buffer_bytes(work, layout, rank)
    if layout.pp > 1 and work.pp_runtime == "engine":  # else torch_pipelining.py's buffers
        total += 2 * tokens * mc.hidden_size * B / (layout.tp if layout.sp else 1)
    if layout.cp > 1:  # the backward of one layer's core (parallel/context/attention.py)
        kv = 2 * tokens * kv_heads_per_rank(mc, layout.tp) * mc.dim_per_head
        dq = tokens * mc.num_heads / layout.tp * mc.dim_per_head * 4  # fp32 accumulator
        if layout.cp_comm == "allgather":  # fp32 dK/dV of all cp ranks, and the own slice
            total += (layout.cp + 1) * kv * 4 + dq
        else:  # K/V held and arriving; a dK/dV block being summed and one arriving, fp32
            total += 2 * kv * B + 2 * kv * 4 + dq
    if layout.ep > 1:
        total += 2 * tokens * mc.experts_top_k * mc.hidden_size * B
    return total


def fp8_gather_buffers(work: Workload, layout: Layout, per_layer: float):
    """parallel.fp8_allgather's own bytes beside gathered blocks (parallel/zero3.py
    `fp8_buffers`), as a function of the block in use and the prefetched one (layer
    indices; None: none prefetched): the block in use holds its FP8 codes (a byte per
    element of its unit), the prefetched one its gather in flight, the messages: the
    receive buffer of every rank's message and this rank's send buffer, (n + 1)/n of the
    unit's FP8 weights (routed experts' too) at 1 byte and its other elements at their
    dtype's (n: dp x cp). A block whose linears train.fp8_keep_out leaves all in bf16 is a
    bf16 unit: none of these (plan/fp8_linears.py). Each message is padded to the longest
    rank's and to the dtype's alignment: a few hundred bytes the planner leaves out
    (tests/test_fp8_gather_memory.py bounds them)."""
    if not (work.fp8_allgather and work.precision == "fp8" and layout.zero == 3):
        return lambda in_use, prefetched=None: 0.0
    shards, mc = layout.dp * layout.cp, work.model
    kv = kv_heads_per_rank(mc, layout.tp)
    experts = layer_param_counts(mc, layout.tp, layout.ep)["expert"] if mc.num_experts else 0
    param = bytes_per_param(work.precision, work.optimizer, work.grad_dtype_bytes).param

    # each layer's weight elements gathered in FP8, from its kind's (its FP8 linears)
    kinds = {linears: (fp8_gather_terms(work, layout, linears, kv)[0]
                       + fp8_expert_gather_terms(work, layout, experts * linears.experts,
                                                 linears.experts)[0])
             for linears, _ in layer_kinds(work, 0, mc.num_layers)}
    fp8 = [kinds[layer_fp8_linears(work, i)] for i in range(mc.num_layers)]

    def held(in_use: int, prefetched: int | None = None) -> float:
        codes = per_layer if fp8[in_use] else 0.0
        f = fp8[prefetched] if prefetched is not None else 0.0
        return codes + ((shards + 1) / shards * (f + param * (per_layer - f)) if f else 0.0)
    return held
