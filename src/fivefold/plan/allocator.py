"""The CUDA caching allocator's share of a rank's peak: what it holds reserved beyond what
is allocated, as the planner models it (the memory items' `overhead`)."""

from __future__ import annotations

from fivefold.plan.activations import ActivationBytes

MIB = 2**20


def allocator_waste(act: ActivationBytes, layer_microbatches: float, head: bool,
                    working_set: float) -> float:
    """Reserved minus allocated at the peak, under a model of PyTorch's CUDA caching allocator
    (c10/cuda/CUDACachingAllocator.cpp): a request over 1 MiB is served from a segment
    rounded up to 2 MiB (requests under 10 MiB from 20 MiB segments), and a freed block stays
    reserved, serving later requests only that fit in it.

    - rounding: every live saved activation of 1 MiB or more wastes half a 2 MiB granule on
      average (1 MiB); smaller ones share small-block segments (ignored);
    - caching: the largest transient block freed before the peak stays cached and cannot
      hold the activations that follow (they are requested in other sizes): the loss
      backward's vocabulary-sized buffers on the head's rank, else the recomputation working
      set. Activation gradients recur at the same sizes layer after layer and reuse their
      cached blocks, adding nothing.
    Model states and communication buffers are allocated once, in whole segments.
    Fragmentation therefore grows with the size and number of activation blocks."""
    large = sum(1 for v in act.layer_terms.values() if v >= MIB) * layer_microbatches
    large += sum(1 for v in act.outside_terms.values() if v >= MIB) * (2 if head else 1)
    cached = (0.0 if act.loss_transient_is_peak else act.loss_backward) if head else working_set
    return large * MIB + cached


def released_cache(total: float, cached: float, limit: float) -> float:
    """Bytes of `cached` the allocator gives back when a rank's planned `total` passes
    `limit`. `cached` is reserve that holds no tensor (the nanotron convention's
    `head_token_bytes`, fitted to reserved peaks and traced to no tensor): when cudaMalloc
    fails, the caching allocator frees every cached block not in use and tries again before
    it reports out-of-memory (c10/cuda/CUDACachingAllocator.cpp, `release_cached_blocks` in
    `malloc`), so such bytes lower the logged peak near the limit instead of failing the
    run. Reserve that live blocks pin (the rounding above, the activation reserve) is not
    released: the crashed runs need it (bench/plan/usp_memory_candidates.py,
    `reserve_released`)."""
    return max(0.0, min(cached, total - limit))
