"""The pool of physical KV blocks: reference counts, a free list, and the prefix-cache map.

PagedAttention (Kwon et al., SOSP 2023, section 4) stores each sequence's keys and values in
fixed-size blocks that need not be contiguous, like pages of virtual memory; a block may be
shared by several sequences, so each carries a reference count. Automatic prefix caching
(vLLM) names a *full* block by a hash of (its parent block's hash, its token ids): equal
prompt prefixes then map to the same physical block.

A block whose count drops to 0 goes on the free list but keeps its hash until it is handed
out again, so a later request with the same prefix can still find it (a hit on a free block
takes it off the list). The list is least-recently-freed first; blocks without a hash go to
its front, so cached content is the last thing overwritten. This module imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the cache


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """`count` fresh blocks (reference count 1); the caller checked `num_free` first."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        out = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # its old content is about to be overwritten
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """One more reference to each block (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """One reference fewer; a block nobody holds returns to the free list."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} released more often than held")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def register(self, block: KVBlock, block_hash: int) -> None:
        """Make a full block findable by its hash (the first block with that content wins)."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
