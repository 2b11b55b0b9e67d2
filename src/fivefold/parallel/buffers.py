"""Flat buffers: many parameters laid end to end, cut into segments, each segment sharded.

One layout serves data parallelism and every ZeRO stage, as Megatron-LM's contiguous
parameter/gradient buffer does (Megatron-LM core `distributed/param_and_grad_buffer.py`):

    flat index   0 ............................................................ total
    segments     [ bucket 0          | bucket 1            | bucket 2  ... ]
    a segment    [ p7 | p6 | p5 |pad]    its size a multiple of the shard count N
    rank r owns  [seg.start + r·seg.size/N, seg.start + (r+1)·seg.size/N) of every segment

A segment is a gradient bucket (DP, ZeRO-1/2: one collective each, launched as soon as its
last gradient is ready; Li et al. 2020, "PyTorch Distributed", §3.2.3) or a ZeRO-3 unit (one
transformer block, gathered as a whole). Sharding each segment, rather than the buffer as a
whole, lets each bucket be reduce-scattered on its own, so ZeRO-1/2 keep DP's overlap.

A rank's shards, concatenated in segment order, form its flat shard of total/N elements;
segment s starts there at seg.start/N. The optimizer walks the *pieces* of its shard: the
intersection of one parameter's range with one owned range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Segment:
    index: int
    start: int  # flat offset, a multiple of the shard count
    size: int  # padded: a multiple of the shard count
    params: list[int]  # indices into FlatLayout.params, in layout order

    def owned(self, rank: int, shards: int) -> tuple[int, int]:
        """Flat [lo, hi) that `rank` owns in this segment."""
        per = self.size // shards
        return self.start + rank * per, self.start + (rank + 1) * per


@dataclass
class Slot:
    name: str
    param: nn.Parameter
    start: int  # flat offset
    numel: int
    shape: torch.Size
    segment: int


@dataclass
class Piece:
    """The part [lo, hi) (within the flattened parameter) of slot `slot` that a rank owns."""

    slot: int
    lo: int
    hi: int
    flat: int  # its flat offset (slot start + lo)
    shard: int  # its offset in the rank's concatenated flat shard


class FlatLayout:
    """Where every parameter lives in the flat buffer, and who owns which part."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]],
                 groups: list[list[int]], shards: int, align: int = 1):
        """`align` > 1 starts every parameter at a multiple of `align` values and makes
        every rank's share of a segment one too, so a shard boundary never cuts a block of
        `align` values of a parameter (quantised optimizer states: parallel/optimizers.py).
        It costs under `align` values of padding per parameter and per segment and rank."""
        self.shards, self.align = shards, align
        self.params: list[Slot] = []
        self.segments: list[Segment] = []
        offset = 0
        for seg_index, group in enumerate(groups):
            seg_start, members = offset, []
            for i in group:
                name, p = named_params[i]
                offset = seg_start + -(-(offset - seg_start) // align) * align
                members.append(len(self.params))
                self.params.append(Slot(name, p, offset, p.numel(), p.shape, seg_index))
                offset += p.numel()
            # Pad so that every rank owns an equal share: the collectives need equal chunks.
            size = -(-(offset - seg_start) // (shards * align)) * shards * align
            offset = seg_start + size
            self.segments.append(Segment(seg_index, seg_start, size, members))
        self.total = offset
        self.numel = sum(s.numel for s in self.params)

    @property
    def padding(self) -> int:
        return self.total - self.numel

    def shard_offset(self, segment: Segment) -> int:
        return segment.start // self.shards

    def pieces(self, rank: int) -> list[Piece]:
        out = []
        for seg in self.segments:
            lo, hi = seg.owned(rank, self.shards)
            base = self.shard_offset(seg) - lo
            for i in seg.params:
                slot = self.params[i]
                a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
                if a < b:
                    out.append(Piece(i, a - slot.start, b - slot.start, a, a + base))
        return out

    def view(self, flat: torch.Tensor, slot: int) -> torch.Tensor:
        """The parameter-shaped view of `slot` in a full flat buffer."""
        s = self.params[slot]
        return flat[s.start:s.start + s.numel].view(s.shape)

    def segment_shard(self, shard: torch.Tensor, seg: Segment) -> torch.Tensor:
        """This rank's part of `seg` inside its concatenated flat shard."""
        off = self.shard_offset(seg)
        return shard[off:off + seg.size // self.shards]


FIRST_BUCKET_BYTES = 1024 * 1024


def bucket_groups(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: float,
                  element_size: int) -> list[list[int]]:
    """Cut the parameters, in reverse order, into buckets of about `bucket_bytes`.

    Reverse order approximates the order in which backward produces gradients (the last
    layer's first), so the first bucket fills, and its reduction starts, early in backward —
    the heuristic of torch DDP (Li et al. 2020, §3.2.3) and Megatron-LM. The first bucket
    is capped at 1 MiB, as DDP's is (`dist._DEFAULT_FIRST_BUCKET_BYTES`), so communication
    starts after the first few gradients instead of after the first 25 MB.
    """
    groups, current, size = [], [], 0
    for i in reversed(range(len(named_params))):
        current.append(i)
        size += named_params[i][1].numel() * element_size
        cap = min(bucket_bytes, FIRST_BUCKET_BYTES) if not groups else bucket_bytes
        if size >= cap:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
