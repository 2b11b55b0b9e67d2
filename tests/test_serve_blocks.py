"""The torch-free half of serving: block pool, block tables, prefix hashing, copy-on-write,
and the continuous-batching scheduler (admission, preemption of the newest, retirement).

Every check here is exact (counts of blocks and tokens); no model runs.
"""

import subprocess
import sys

import pytest

from fivefold.errors import ConfigError
from fivefold.serve.block_pool import BlockPool
from fivefold.serve.kv_cache_manager import KVCacheManager
from fivefold.serve.request import Request, RequestStatus
from fivefold.serve.sampling_params import SamplingParams
from fivefold.serve.scheduler import Scheduler


def request(rid: str, n: int, max_tokens: int = 8, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


def test_torch_free_modules_import_no_torch():
    code = ("import sys, fivefold.serve, fivefold.serve.scheduler, fivefold.serve.block_pool, "
            "fivefold.serve.kv_cache_manager, fivefold.serve.request; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_status_is_ordered_and_maps_to_finish_reasons():
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    assert not RequestStatus.PREEMPTED.finished and RequestStatus.FINISHED_STOPPED.finished
    assert [s.finish_reason for s in RequestStatus if s.finished] == ["stop", "length", "abort",
                                                                      "error"]


def test_pool_reference_counts_and_free_list():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and [b.ref_cnt for b in a] == [1, 1, 1]
    pool.touch(a[:1])
    pool.release(a)
    assert pool.num_free == 3 and a[0].ref_cnt == 1  # still held once
    pool.release(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release(a[:1])


def test_allocate_returns_none_and_leaves_nothing_behind():
    kv = KVCacheManager(num_blocks=4, block_size=16, enable_prefix_caching=False)
    r1, r2 = request("a", 40), request("b", 30)
    assert len(kv.allocate_slots(r1, 40)) == 3
    assert kv.allocate_slots(r2, 30) is None  # needs 2, one is free
    assert kv.pool.num_free == 1 and kv.block_ids("b") == []
    kv.free(r1)
    assert kv.pool.num_free == 4 and len(kv.allocate_slots(r2, 30)) == 2


def test_block_table_grows_one_block_per_block_size_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = request("a", 5)
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    grown = []
    for _ in range(8):  # decode: one token at a time
        r.output_token_ids.append(1)
        grown.append(len(kv.allocate_slots(r, 1)))
        r.num_computed_tokens += 1
    assert grown == [0, 0, 0, 1, 0, 0, 0, 1]  # positions 5..12: new blocks at 8 and 12
    assert len(kv.block_ids("a")) == 4  # 13 tokens in blocks of 4


def test_prefix_hits_share_full_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = request("a", 10)  # blocks [0..3] [4..7] full, [8, 9] partial
    kv.allocate_slots(first, 10)
    same = request("b", 11)  # the same first 10 tokens and one more
    hits, cached = kv.get_computed_blocks(same)
    assert cached == 8 and [b.block_id for b in hits] == kv.block_ids("a")[:2]
    other = Request("c", [99] + list(range(1, 11)), SamplingParams())
    assert kv.get_computed_blocks(other) == ([], 0)  # a different first block: no chain
    kv.allocate_slots(same, 11 - cached, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert [b.ref_cnt for b in hits] == [2, 2]
    assert kv.pool.num_used == 3 + 1  # a: 3 blocks, b: one block of its own


def test_a_whole_prompt_hit_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots(request("a", 8), 8)
    hits, cached = kv.get_computed_blocks(request("b", 8))
    assert cached == 4 and len(hits) == 1  # the block holding the last token is recomputed


def test_freed_blocks_stay_findable_until_reused():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = request("a", 8)
    kv.allocate_slots(a, 8)
    kv.free(a)
    hits, cached = kv.get_computed_blocks(request("b", 9))
    assert cached == 8 and kv.pool.num_free == 3
    assert kv.allocate_slots(request("b", 9), 1, hits) is not None
    assert kv.pool.num_free == 0  # both hits left the free list, plus one new block
    kv.free(request("b", 9))
    kv.allocate_slots(request("c", 12, first=50), 12)  # overwrites every block
    assert kv.get_computed_blocks(request("d", 9)) == ([], 0)


def test_copy_on_write_of_a_shared_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = request("p", 6)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = request("c", 6)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.block_ids("c") == kv.block_ids("p") and kv.pool.num_used == 2
    child.output_token_ids.append(7)
    kv.allocate_slots(child, 1)  # writes position 6 of the shared block [4..7]
    (src, dst), = kv.take_copies()
    assert src == kv.block_ids("p")[1] and dst == kv.block_ids("c")[1] and src != dst
    assert kv.block_ids("c")[0] == kv.block_ids("p")[0]  # the full block stays shared
    parent.output_token_ids.append(8)
    kv.allocate_slots(parent, 1)  # the parent holds its block alone now: no copy
    assert kv.take_copies() == [] and kv.pool.num_used == 3


def scheduler(num_blocks=64, block_size=4, max_len=64, **kw) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_len, **kw)


def run_step(s: Scheduler, token: int = 1):
    out = s.schedule()
    sampled = {r.request_id: token for r, n in out.scheduled
               if r.num_computed_tokens + n == r.num_tokens}
    s.update_from_output(out, sampled)
    return out


def test_continuous_batching_admits_and_retires_each_step():
    s = scheduler(max_num_seqs=2)
    for rid, n, m in (("a", 5, 1), ("b", 3, 3), ("c", 4, 2)):
        s.add_request(Request(rid, list(range(n)), SamplingParams(max_tokens=m)))
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 3)]
    # a finished at once (max_tokens 1); c joins in the very next step, beside b's decode
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 1), ("c", 4)]
    assert s.kv.block_ids("a") == []


def test_preemption_frees_the_newest_and_recomputes_it():
    s = scheduler(num_blocks=4, block_size=4, max_len=16)
    s.add_request(request("old", 7, max_tokens=8))
    s.add_request(request("new", 7, max_tokens=8, first=50))
    run_step(s)  # both prefilled: 2 blocks each, the pool is full
    run_step(s)  # position 7 still fits in each one's second block
    out = run_step(s)  # position 8 of each needs a third block: "new" is preempted
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [r.request_id for r, _ in out.scheduled] == ["old"]
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.waiting[0] is new and new.output_token_ids == [1, 1]  # its tokens are kept
    while s.has_unfinished():
        run_step(s)
    assert new.num_output_tokens == 8 and new.num_preemptions >= 1


def test_chunked_prefill_splits_a_long_prompt_within_the_token_budget():
    s = scheduler(max_len=64, max_num_batched_tokens=16, chunked_prefill=True)
    s.add_request(request("a", 40, max_tokens=2))
    chunks = [run_step(s).scheduled[0][1] for _ in range(3)]
    assert chunks == [16, 16, 8] and s.requests["a"].output_token_ids == [1]


def test_stops_eos_stop_ids_and_length():
    s = scheduler(eos_token_ids=[7])
    s.add_request(Request("eos", [1, 2], SamplingParams(max_tokens=5)))
    s.add_request(Request("ign", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))
    s.add_request(Request("sid", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=(7,))))
    reqs = dict(s.requests)
    run_step(s, token=7)
    assert reqs["eos"].status == RequestStatus.FINISHED_STOPPED
    assert reqs["sid"].status == RequestStatus.FINISHED_STOPPED
    while s.has_unfinished():
        run_step(s, token=7)
    assert reqs["ign"].status == RequestStatus.FINISHED_LENGTH
    assert reqs["ign"].output_token_ids == [7, 7, 7]
    assert s.kv.pool.num_used == 0


def test_requests_that_can_never_fit_are_refused():
    s = scheduler(num_blocks=2, block_size=4, max_len=64)
    with pytest.raises(ConfigError, match="KV blocks"):
        s.add_request(request("a", 6, max_tokens=8))
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        scheduler(max_len=64, max_num_batched_tokens=32)


def test_sampling_params_are_checked():
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1},
                {"stop": [""]}):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(temperature=0).greedy
