"""The multi-rank harness fails a test when a rank fails, exits early or hangs."""

import os
import sys
import time

import pytest
import torch.distributed as dist
from harness import run_ranks


def _outcome(rank, world_size, how):
    if rank == 1:
        if how == "raise":
            raise ValueError("rank one broke")
        if how == "sys.exit":
            sys.exit(0)
        if how == "os._exit":
            os._exit(0)
        if how == "hang":
            time.sleep(60)
    dist.barrier()  # the healthy rank waits on its peer, as a real collective would
    return rank


def test_failing_exiting_and_hanging_ranks_fail_the_run_within_its_timeout():
    assert run_ranks(_outcome, 2, "none", timeout=60) == [0, 1]
    cases = [("raise", RuntimeError, "rank 1:.*ValueError: rank one broke"),
             ("sys.exit", RuntimeError, "rank 1:.*SystemExit"),
             ("os._exit", RuntimeError, "rank 1 exited with code 0 without reporting"),
             ("hang", TimeoutError, r"timed out after 3 s; hung: rank 1; waiting in a "
                                    r"collective: 0")]
    for how, error, message in cases:
        start = time.monotonic()
        with pytest.raises(error, match=f"(?s){message}"):
            run_ranks(_outcome, 2, how, timeout=3)
        assert time.monotonic() - start < 10, how  # not the 120 s gloo timeout


def _threads_and_cores(rank, world_size):
    import torch

    return torch.get_num_threads(), sorted(os.sched_getaffinity(0)), os.environ["OMP_NUM_THREADS"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="core pinning is Linux-only")
def test_each_rank_runs_one_thread_pinned_to_its_own_share_of_the_cores():
    """4 ranks on the cores this process may use: one thread each, each on one core, the
    ranks spread round robin (on 2 cores: ranks 0 and 2 on the first, 1 and 3 on the other)."""
    cores = sorted(os.sched_getaffinity(0))
    results = run_ranks(_threads_and_cores, 4)
    assert [threads for threads, _, _ in results] == [1, 1, 1, 1]
    assert [pinned for _, pinned, _ in results] == [[cores[r % len(cores)]] for r in range(4)]
    assert {omp for _, _, omp in results} == {"1"}
    assert sorted(os.sched_getaffinity(0)) == cores  # the parent is left as it was
