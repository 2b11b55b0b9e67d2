"""ZeRO-3's all-gather of FP8-linear weights in FP8 (parallel.fp8_allgather, tensorwise).

torchao's float8 training for FSDP2 casts each rank's shard of a float8 linear's weight to
FP8 before the all-gather, with the tensorwise scale of the whole weight, so the gather
moves 1 byte per element instead of 2 (bf16), and the GEMM takes the gathered FP8 weight
as it is (torchao `float8/fsdp_utils.py`, `WeightWithDynamicFloat8CastTensor`). Here:

    1. each rank takes the amax of its piece of every such weight in the unit,
    2. one all_reduce(max) of those amaxes gives every weight's amax, so its scale
       (numerics.scaling.amax_to_scale) is the one the tensorwise cast of the whole
       weight computes: the cast is elementwise, so each rank's bytes are exactly the
       bytes of that cast (bit-equal to quantising the gathered bf16 weight),
    3. the unit's shard is split in two messages, the FP8 bytes (uint8) of those weights'
       elements and the unit's other elements (bf16), each padded to the largest rank's
       count, and gathered,
    4. the FP8 bytes land in a per-unit byte buffer (freed with the unit, like the bf16
       one); each weight's module gets `fp8_weight` (data a view of that buffer, scale the
       weight's) that its FP8 GEMMs use instead of quantising the weight (lowp/linear.py).
       The weight's bf16 view is filled with the dequantised values, so the parameter
       holds what the GEMM uses.

The gather is synchronous (no prefetch) for units holding such weights.
"""

from __future__ import annotations

import torch

from fivefold.numerics.formats import E4M3
from fivefold.numerics.fp8 import FP8Tensor
from fivefold.numerics.scaling import amax_to_scale
from fivefold.parallel import comm


class FP8UnitGather:
    """The index maps of one unit (segment) whose FP8-linear weights gather in FP8."""

    def __init__(self, layout, seg, weights: list, rank: int, device: torch.device):
        self.layout, self.seg, self.rank = layout, seg, rank
        shards, per = layout.shards, seg.size // layout.shards
        owner = torch.full((seg.size,), -1, dtype=torch.long)
        self.views = []  # (module, slot) per weight
        for k, (slot, module) in enumerate(weights):
            lo = slot.start - seg.start
            owner[lo:lo + slot.numel] = k
            self.views.append((module, slot))
        by_rank = owner.view(shards, per)
        idx8 = [(by_rank[r] >= 0).nonzero().squeeze(1) for r in range(shards)]
        idx16 = [(by_rank[r] < 0).nonzero().squeeze(1) for r in range(shards)]
        self.n8 = max(len(i) for i in idx8)
        self.n16 = max(len(i) for i in idx16)
        self.local8, self.local16 = idx8[rank].to(device), idx16[rank].to(device)
        self.local_weight = by_rank[rank][idx8[rank]].to(device)
        self.dest8 = torch.cat([r * per + i for r, i in enumerate(idx8)]).to(device)
        self.src8 = torch.cat([r * self.n8 + torch.arange(len(i))
                               for r, i in enumerate(idx8)]).to(device)
        self.dest16 = torch.cat([r * per + i for r, i in enumerate(idx16)]).to(device)
        self.src16 = torch.cat([r * self.n16 + torch.arange(len(i))
                                for r, i in enumerate(idx16)]).to(device)
        self.weight_of = owner.to(device)
        self.bytes = torch.zeros(seg.size, dtype=torch.uint8, device=device)
        self.scales = torch.ones(len(weights), dtype=torch.float32, device=device)
        self.bytes.untyped_storage().resize_(0)

    def gather(self, full: torch.Tensor, shard: torch.Tensor, group: comm.Group) -> None:
        """Fill `full` (the unit's bf16 buffer, storage allocated) and the FP8 bytes."""
        local = self.layout.segment_shard(shard, self.seg)
        vals = local[self.local8].float()
        amax = torch.zeros(len(self.views), dtype=torch.float32, device=local.device)
        amax.scatter_reduce_(0, self.local_weight, vals.abs(), "amax")
        amax[torch.isnan(amax.new_zeros(len(self.views)).index_add_(
            0, self.local_weight, vals.abs()))] = float("nan")  # a NaN reaches the scale
        comm.all_reduce(amax, group, op="max")
        mult = amax_to_scale(amax, E4M3)
        send8 = torch.zeros(self.n8, dtype=torch.uint8, device=local.device)
        q = (vals * mult[self.local_weight]).clamp(-E4M3.max, E4M3.max).to(E4M3.dtype)
        send8[:len(q)] = q.view(torch.uint8)
        send16 = torch.zeros(self.n16, dtype=local.dtype, device=local.device)
        send16[:len(self.local16)] = local[self.local16]
        out8 = torch.empty(self.n8 * group.size, dtype=torch.uint8, device=local.device)
        out16 = torch.empty(self.n16 * group.size, dtype=local.dtype, device=local.device)
        comm.all_gather(out8, send8, group)
        comm.all_gather(out16, send16, group)
        self.bytes.untyped_storage().resize_(self.seg.size)
        with torch.no_grad():
            self.bytes.index_copy_(0, self.dest8, out8[self.src8])
            full.index_copy_(0, self.dest16, out16[self.src16])
            self.scales.copy_(mult.reciprocal())
            fp8 = self.bytes[self.dest8].view(E4M3.dtype).float()
            full.index_copy_(0, self.dest8, (fp8 * self.scales[self.weight_of[self.dest8]])
                             .to(full.dtype))
        for k, (module, slot) in enumerate(self.views):
            lo = slot.start - self.seg.start
            data = self.bytes[lo:lo + slot.numel].view(E4M3.dtype).view(slot.shape)
            module.fp8_weight = FP8Tensor(data, self.scales[k], "tensorwise", E4M3)

    def free(self) -> None:
        self.bytes.untyped_storage().resize_(0)
        for module, _ in self.views:  # a GEMM's saved copy (for backward) stays valid
            module.fp8_weight = None
