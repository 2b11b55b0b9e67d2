"""Block tables: which physical blocks hold each request's keys and values.

`allocate_slots(request, n)` makes room for the request's next `n` tokens and returns the
new blocks, or None when the pool has too few free blocks (the scheduler then preempts; no
partial allocation is left behind). `get_computed_blocks` finds the longest run of the
prompt's full blocks already in the cache, by the chained hash of each block's token ids.
`fork` lets a second sequence share all of a parent's blocks; when either writes into a
shared, partly filled last block it gets a private copy first (copy-on-write), and the copy
is queued in `pending_copies` for the runner to perform before the next forward.

Sources: vLLM v1 `kv_cache_manager.py` (allocate_slots returns None; full blocks are hashed
when allocated, so requests admitted in the same step share them), nano-vllm
`block_manager.py`. This module imports no torch.
"""

from __future__ import annotations

from fivefold.serve.block_pool import BlockPool, KVBlock
from fivefold.serve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """A chained hash: equal hashes mean equal token ids in this block and every one before
    it (up to a 64-bit collision, ~2^-64 per pair)."""
    return hash((parent, token_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (source block, destination block)
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def _block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the request's first `num_tokens` tokens."""
        hashes = self._hashes.setdefault(request.request_id, [])
        full = num_tokens // self.block_size
        if len(hashes) < full:
            tokens = request.all_token_ids
            bs = self.block_size
            for i in range(len(hashes), full):
                # the first block's parent is the adapter: K/V under another LoRA differ
                parent = hashes[i - 1] if i else request.params.adapter
                hashes.append(hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs])))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks for the start of the request and the tokens they hold. At least one
        token is left to compute: its logits give the first new token."""
        if not self.enable_prefix_caching:
            return [], 0
        hits = []
        for block_hash in self._block_hashes(request, request.num_tokens - 1):
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None, register: bool = True
                       ) -> list[KVBlock] | None:
        """`register` False: the newest token's id is not known yet (a step scheduled ahead,
        serve/async_step.py); `register_full_blocks` names the blocks once it is."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        start = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = start + num_new_tokens
        num_new_blocks = cdiv(total, self.block_size) - len(blocks) - len(computed_blocks)
        # Writing into a partly filled block that another sequence also holds: copy it first.
        cow = (start % self.block_size != 0 and start // self.block_size < len(blocks)
               and blocks[start // self.block_size].ref_cnt > 1)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # leave the free list
        if max(num_new_blocks, 0) + cow + revived > self.pool.num_free:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self.prefix_hit_tokens += len(computed_blocks) * self.block_size
        if cow:
            index = start // self.block_size
            (copy,) = self.pool.allocate(1)
            self.pending_copies.append((blocks[index].block_id, copy.block_id))
            self.pool.release([blocks[index]])
            blocks[index] = copy
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if register:
            self.register_full_blocks(request, total)
        return new_blocks

    def register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the full blocks among the first `num_tokens` tokens findable by prefix."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks, hashes = self.req_blocks[rid], self._block_hashes(request, num_tokens)
        full = num_tokens // self.block_size  # hashes may run ahead (a prefix lookup)
        done = self._num_registered.get(rid, 0)
        for i in range(done, full):
            self.pool.register(blocks[i], hashes[i])
        self._num_registered[rid] = max(done, full)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (same tokens so far)."""
        blocks = list(self.req_blocks.get(parent.request_id, []))
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = blocks
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted); tail first, so the
        free list hands out a sequence's last blocks before its shared prefix."""
        rid = request.request_id
        self.pool.release(reversed(self.req_blocks.pop(rid, [])))
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
