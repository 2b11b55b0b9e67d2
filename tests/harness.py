"""Run a function on N gloo ranks inside pytest.

The ranks are forked (about 0.2 s for 8, against 10-20 s for torchrun) and meet through a
file:// rendezvous. Each child uses one thread: a forked child with several OpenMP threads
can hang. Each child is also pinned to one core (rank r to the r-th of the cores this process
may use, round robin), so N ranks on a 2-core machine share the cores N/2 to a core instead of
every rank's threads migrating over both, and a child's own subprocesses start with one
OpenMP thread too. One start can serve many checks: the function may run several
configurations.

The parent watches the ranks instead of joining them blindly, so a broken rank fails the
test at once rather than leaving its peers blocked in a collective:
- a rank whose function raises, or calls sys.exit (even sys.exit(0)), reports "error";
- a rank that dies without reporting (os._exit, a signal) fails the run by its exit code;
- the whole run is bounded by a timeout; on expiry every rank's Python stack is dumped
  (faulthandler on SIGUSR1), the ranks are killed, and the error names the ranks that are
  not waiting inside torch.distributed, i.e. the ones that hung.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  (import the submodules before forking)

# Whole-run bound in seconds; generous because 2 cores are shared by many test processes.
RUN_TIMEOUT = float(os.environ.get("FIVEFOLD_TEST_TIMEOUT", "600"))
_POLL_S = 0.02


def pin_to_one_core(rank: int) -> None:
    """One compute thread, on one core: the rank's share of the cores it was given."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the thread count alone
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _child(rank, fn, world_size, init_file, out_dir, args, kwargs):
    pin_to_one_core(rank)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    stack_file = open(os.path.join(out_dir, f"rank{rank}.stack"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args, **kwargs)
        outcome = ("ok", result)
    except BaseException:  # SystemExit too: a rank that exits early has failed the run
        outcome = ("error", traceback.format_exc())
    _write_atomic(result_path, outcome)
    if outcome[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    # Skip interpreter teardown: a failed rank may hold a group its peers still wait on.
    os._exit(0 if outcome[0] == "ok" else 1)


def _write_atomic(path, outcome):
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)


def _read(path):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _stop(procs):
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()


def _hang_report(procs, out_dir, timeout):
    """Dump every live rank's stack, kill the ranks, and say which ones hung and where."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)  # let faulthandler write
    _stop(procs)
    hung, waiting, stacks = [], [], []
    for r in alive:
        with open(os.path.join(out_dir, f"rank{r}.stack")) as f:
            stack = f.read()
        stacks.append(f"rank {r}:\n{stack}")
        # faulthandler prints the innermost frame first for each thread; the main thread
        # is the one marked "Current thread" or the first one listed.
        frames = [line for line in stack.splitlines() if line.strip().startswith("File ")]
        inner = frames[0] if frames else ""
        (waiting if "torch/distributed" in inner else hung).append(r)
    named = hung or alive
    return (f"ranks timed out after {timeout:.0f} s; hung: "
            f"{', '.join(f'rank {r}' for r in named)}"
            + (f"; waiting in a collective: {', '.join(map(str, waiting))}" if hung and waiting
               else "")
            + "\n" + "\n".join(stacks))


# What a rank raises when a peer, not itself, failed: the peer's own failure is the news.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "transport/tcp")


def _first_failure(procs, out_dir, grace_s: float = 2.0) -> str:
    """The failure that caused the others: a rank that fails first makes its peers' collectives
    fail a moment later, and whichever the parent reads first must not hide the cause. Wait
    up to `grace_s` for the ranks to end, then report a rank that failed of itself (raised, or
    exited without reporting) before one that only lost its peer."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(p.exitcode is None for p in procs):
        time.sleep(_POLL_S)
    failures = []
    for r, proc in enumerate(procs):
        if proc.exitcode is None:
            continue
        outcome = _read(os.path.join(out_dir, f"rank{r}.pkl"))
        if outcome is None:
            failures.append((False, f"rank {r} exited with code {proc.exitcode} without "
                                    f"reporting a result"))
        elif outcome[0] != "ok":
            derived = any(text in outcome[1] for text in _PEER_LOST)
            failures.append((derived, f"rank {r}:\n{outcome[1]}"))
    failures.sort(key=lambda f: f[0])  # stable: by rank among equals
    return failures[0][1]


def run_ranks(fn, world_size: int, *args, timeout: float = RUN_TIMEOUT, **kwargs) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size ranks; return their results.

    fn must be a module-level function; results must pickle (tensors do). Raises
    RuntimeError with the rank's traceback as soon as any rank fails or exits early, and
    TimeoutError naming the hung ranks when the run takes longer than `timeout` seconds
    (so `timeout` cannot be a keyword of fn).
    """
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child,
                             args=(r, fn, world_size, init_file, tmp, args, kwargs))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        try:
            while True:
                finished = 0
                for r, proc in enumerate(procs):
                    if proc.exitcode is None:
                        continue
                    outcome = _read(os.path.join(tmp, f"rank{r}.pkl"))
                    if outcome is None or outcome[0] != "ok":
                        raise RuntimeError(_first_failure(procs, tmp))
                    finished += 1
                if finished == world_size:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(_hang_report(procs, tmp, timeout))
                time.sleep(_POLL_S)
        finally:
            _stop(procs)
        return [_read(os.path.join(tmp, f"rank{r}.pkl"))[1] for r in range(world_size)]
