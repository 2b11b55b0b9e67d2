"""What a pipeline rank holds when torch.distributed.pipelining runs the pipeline over FSDP2
stages (torchtitan's runs; `Workload.pp_runtime` = "torch" or "torch-2412"), beyond what the
planner counts for fivefold's own engine.

Read from the source of torch.distributed.pipelining (torch/distributed/pipelining/stage.py
and _backward.py; line numbers of the installed torch 2.13) and of its history, which matters
because published runs used older torches (torchtitan's Dec 2024 benchmarks: torch 1963fc8,
2024-12-23):

- Receive buffers. A stage allocates one activation receive buffer per micro-batch when it is
  not the first (`_setup_forward_recv_info`, l. 2243-2274: `_make_tensor_from_meta` for every
  chunk id) and one gradient receive buffer per micro-batch when it is not the last
  (`_setup_backward_recv_info` l. 321-333 with `_create_grad_recv_info` l. 2286-2318). They
  are kept from step to step. A received activation is the stage's first layer's input, so the
  buffers of micro-batches whose activations are alive are already counted as activations.
- Stage outputs. `fwd_cache` keeps each micro-batch's output until its backward (l. 913).
  Until pytorch/pytorch#153383 (2025-05) every stage also appended every output to
  `output_chunks`, cleared only when the next step starts (`clear_runtime_states`); since then
  only the last stage does (l. 907-908; `return_outputs` defaults to True, schedules.py l. 745),
  and there the outputs are the logits.
- Input gradients. `stage_backward` accumulated the stage input's gradient into the receive
  buffer's `.grad`, which lived until the next step's `clear_runtime_states`, until
  pytorch/pytorch#164329 (2025-10) set `val.grad = None` after use (_backward.py l. 441-450).
- FSDP2. For every backward but the last micro-batch's the stage sets
  `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)` (stage.py
  l. 845-847; at torch 1963fc8 for every backward, with FSDP's post-backward run by hand after
  the last). FSDP2 then upcasts each unit's unsharded gradient to its reduce dtype and adds the
  later micro-batches' into it (fsdp/_fully_shard/_fsdp_param.py
  `to_accumulated_grad_if_needed`, `accumulate_unsharded_grad_if_needed`, l. 802-821):
  the whole stage's unsharded gradient in fp32 (the planner's `grad_buffer`, with
  `grad_dtype_bytes` = 4), even with one micro-batch, and in transit only the compute-dtype
  gradient of the unit being back-propagated, since the stage's parameters stay gathered
  (torchtitan: `reshard_after_forward = not pp_enabled`; `comm.keeps_gathered`).

Where the peak is: the most activations a rank holds (`placement.inflight_per_chunk`) stay alive
until its last forward; by then every micro-batch of a chunk is either alive or has run its
backward, so m − alive of them have left their receive buffer (and, before #164329, their input
gradient) behind. That point also has the whole fp32 accumulated gradient. A rank that runs no
forward after its first backward (1F1B with m ≤ p − r, e.g. rank 0 at m = p) reaches its most
activations before the accumulator exists; counting both there overstates it by the smaller of
one micro-batch's activations and the accumulator (the planner's `grad_buffer` item).
"""

from __future__ import annotations

from fivefold.plan.layout import Layout, Workload
from fivefold.plan.placement import num_chunks, rank_chunks


def pipelined_fsdp(work: Workload, layout: Layout) -> bool:
    """torch.distributed.pipelining over FSDP stages: gradient sync deferred to the step's
    last micro-batch, unsharded fp32 gradients accumulated until then."""
    return work.pp_runtime != "engine" and layout.pp > 1 and layout.zero >= 2


def stage_boundary_bytes(work: Workload, layout: Layout) -> float:
    """One micro-batch's tensor crossing a stage boundary: a block's output, [mbs, s/cp, h] in
    the compute dtype; the sequence shard under SP (torchtitan's blocks end in RowwiseParallel
    with output_layouts = Shard(1) and local outputs: parallelize_llama.py @9dec370)."""
    tokens = layout.mbs * work.seq_len / layout.cp
    return tokens * work.model.hidden_size * work.dtype_bytes / (layout.tp if layout.sp else 1)


def stage_buffer_bytes(work: Workload, layout: Layout, rank: int,
                       alive: tuple[float, ...]) -> float:
    """Bytes of receive buffers, kept outputs and input gradients pipeline rank `rank` holds at
    its peak beyond its activations, with `alive[i]` micro-batches alive in its i-th chunk
    (`placement.rank_chunks` order). Per chunk, with m micro-batches and a alive, b the boundary
    tensor and l a micro-batch's logits (T·V/tp in the compute dtype):

      activation receive buffers (not the first chunk)   (m − a)·b
      gradient receive buffers (not the last chunk)      m·b
      outputs kept     torch-2412: m·b (m·l on the last chunk); torch: a·b (m·l on the last)
      input gradients  torch-2412: (m − a)·b (not the first chunk); torch: 0
    """
    if work.pp_runtime == "engine" or layout.pp == 1:
        return 0.0
    m = work.num_microbatches(layout)
    b = stage_boundary_bytes(work, layout)
    tokens = layout.mbs * work.seq_len / layout.cp
    logits = tokens * -(-work.model.vocab_size // layout.tp) * work.dtype_bytes
    last = num_chunks(layout) - 1
    old = work.pp_runtime == "torch-2412"
    total = 0.0
    for chunk, a in zip(rank_chunks(layout, rank), alive):
        a = min(a, m)
        if chunk != 0:
            total += (m - a) * b * (2 if old else 1)
        if chunk != last:
            total += m * b + (m if old else a) * b
        else:
            total += m * logits
    return total


def deferred_sync_grad_bytes(work: Workload, layout: Layout, rank: int, per_layer: float,
                             vocab: float, norm: float) -> float:
    """FSDP's transient when the stage stays gathered and its sync is deferred: the compute-
    dtype gradient of the unit being back-propagated before FSDP2 adds it into the fp32
    accumulator (the largest unit of the rank: a block of `per_layer` parameters, or the root
    module's embedding / final norm and head, `vocab` and `norm` elements)."""
    chunks = rank_chunks(layout, rank)
    last = num_chunks(layout) - 1
    rest = vocab if 0 in chunks else 0.0
    if last in chunks:
        rest += norm + (0.0 if work.model.tie_embeddings and 0 in chunks else vocab)
    return max(per_layer, rest) * work.dtype_bytes
