"""Noticing a lost rank: heartbeats through the rendezvous store.

When one rank dies mid-step, its peers are left inside a collective. gloo usually fails it
at once ("connection closed by peer", naming an address, not a rank); a collective may also
hang until the process group's timeout. Neither says *which* rank was lost. So each rank
runs a daemon thread that bumps a counter `fivefold/heartbeat/<rank>` in the c10d store
every `interval` seconds and watches its peers' counters (on its own clock, so no clock
skew matters). Then:

- a failed collective is explained: the rank whose heartbeat stopped is named;
- a hang cannot outlive `timeout_s`: while a training step is under way ("armed"), a peer
  silent for longer than that makes the thread print the lost rank and end the process
  with exit code 3 — torchrun then tears the job down, as it does when a worker dies.

Outside a step (checkpoint writing, evaluation, the end of training) silence is not an
error, and a failing store ends the thread quietly: the run may be shutting down.

The thread must be stopped and joined (`close`) before the interpreter exits. A daemon
thread still inside `store.add` when Python finalizes is cut off by `pthread_exit` as it
retakes the GIL; the forced unwind crosses a `noexcept` C++ frame and the process aborts
("terminate called without an active exception", SIGABRT) after the run has finished.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

from fivefold.config import RunError

EXIT_RANK_LOST = 3


class RankLostError(RunError):
    exit_code = EXIT_RANK_LOST


class CollectiveTimeout(RunError):
    """A collective failed while every peer's heartbeat was alive: on some rank it waited
    longer than parallel.timeout_s (the rank it waited for was slow, not lost). Exit 1."""

    exit_code = 1


# What gloo and NCCL put in the RuntimeError of a failed or timed-out collective.
_COMM_FAILURES = ("gloo", "Timed out", "timed out", "Connection closed", "Application timeout",
                  "NCCL", "Connection reset")


def is_comm_failure(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in _COMM_FAILURES)


class _State:
    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.interval = min(max(timeout_s / 20, 0.05), 2.0)
        now = time.monotonic()
        self.seen = {r: (-1, now) for r in range(world) if r != rank}  # counter, when changed
        self.armed = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.store_host = _store_host_rank(rank)

    def silent_for(self) -> dict[int, float]:
        now = time.monotonic()
        with self.lock:
            return {r: now - t for r, (_, t) in self.seen.items()}


def _store_host_rank(rank: int) -> int | None:
    """The rank whose process holds the c10d store, when one does: under env:// rendezvous
    (torchrun, or MASTER_ADDR set by hand) rank 0 starts the TCPStore, unless torchrun's agent
    shares its own (TORCHELASTIC_USE_AGENT_STORE=True; torch/distributed/rendezvous.py,
    _create_c10d_store). A file:// store has no host process."""
    if rank == 0 or not os.environ.get("MASTER_ADDR"):
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    return 0


def _key(rank: int) -> str:
    return f"fivefold/heartbeat/{rank}"


def _failed_key(rank: int) -> str:
    return f"fivefold/failed/{rank}"


def _beat(store, state: _State) -> None:
    while not state.stop.wait(state.interval):
        try:
            store.add(_key(state.rank), 1)
            for r in state.seen:
                value = store.add(_key(r), 0)  # add(0) reads without blocking on a missing key
                with state.lock:
                    if value != state.seen[r][0]:
                        state.seen[r] = (value, time.monotonic())
        except (RuntimeError, OSError):  # the store is gone: shutting down, or its host died
            if state.armed.is_set():
                _die(state, "lost contact with the rendezvous store (its host may have died)"
                     if state.store_host is None else f"lost rank {state.store_host}: the "
                     f"rendezvous store it hosted stopped answering")
            return
        if state.armed.is_set():
            silent = {r: s for r, s in state.silent_for().items() if s > state.timeout_s}
            if silent:
                lost = ", ".join(f"rank {r} (silent {s:.1f} s)" for r, s in sorted(silent.items()))
                _die(state, f"lost {lost}; parallel.timeout_s = {state.timeout_s}", store)


def _die(state: _State, message: str, store=None) -> None:
    if store is not None:
        _report_failure(store, state.rank)
    print(f"fivefold: rank {state.rank}: {message}; exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_RANK_LOST)


def _report_failure(store, rank: int) -> None:
    """Say 'I am alive and saw a failure': a survivor that exits is not the lost rank."""
    try:
        store.add(_failed_key(rank), 1)
    except (RuntimeError, OSError):
        pass


class Watchdog:
    """Heartbeats of every rank, armed around a training step. One per run (the trainer's)."""

    def __init__(self, timeout_s: float, store=None):
        self.active = dist.is_initialized() and dist.get_world_size() > 1
        if not self.active:
            return
        store = store or dist.distributed_c10d._get_default_store()
        self.store = store
        self.state = _State(dist.get_rank(), dist.get_world_size(), timeout_s)
        # The thread holds the state, not this object, so the optimizer can be collected.
        self.thread = threading.Thread(target=_beat, args=(store, self.state), daemon=True,
                                       name="fivefold-watchdog")
        self.thread.start()

    def arm(self) -> None:
        if self.active:
            self.state.armed.set()

    def disarm(self) -> None:
        if self.active:
            self.state.armed.clear()

    def close(self) -> None:
        """Stop the heartbeat thread and wait for it to leave the store (see above)."""
        if not self.active:
            return
        self.state.armed.clear()
        self.state.stop.set()
        if self.thread is not threading.current_thread():
            # One store round trip at most; bounded in case the store's host is gone.
            self.thread.join(timeout=self.state.interval + 10.0)

    def __del__(self):
        if getattr(self, "active", False):
            self.state.stop.set()  # no join here: finalizers may run on any thread

    def _reported_failure(self, rank: int) -> bool:
        try:
            return self.store.add(_failed_key(rank), 0) > 0
        except (RuntimeError, OSError):
            return False

    def lost_ranks(self) -> list[int]:
        """Peers silent for three heartbeat intervals that did not themselves report a
        failure (a survivor exiting after us is not the culprit), and still silent and
        unreported after a confirmation window; waits up to timeout_s.

        The window is there because a live peer can fall silent for a moment: on a loaded
        machine its heartbeat thread waits for a core or the GIL (0.6 s seen on 2 cores with
        4 ranks, four intervals at timeout_s = 3), and a collective failing at that moment
        would name it beside, or instead of, the dead one. A dead peer stays silent; a live
        one beats again or reports its own failure within the window."""
        if not self.active:
            return []
        st = self.state
        _report_failure(self.store, st.rank)
        deadline = time.monotonic() + st.timeout_s
        confirm_s = max(5 * st.interval, min(st.timeout_s / 2, 2.0))
        suspects: dict[int, float] = {}  # peer → when it was first found silent
        while True:
            silent = st.silent_for()
            now = time.monotonic()
            lost = [r for r, s in silent.items()
                    if s > 3 * st.interval and not self._reported_failure(r)]
            suspects = {r: suspects.get(r, now) for r in lost}
            confirmed = sorted((r for r, since in suspects.items() if now - since >= confirm_s),
                               key=lambda r: -silent[r])
            if confirmed and len(confirmed) == len(suspects) or now > deadline:
                return sorted(suspects, key=lambda r: -silent[r]) if now > deadline else confirmed
            time.sleep(st.interval)

    def wait(self, handle, what: str) -> None:
        """Wait for a collective; if it fails, name the rank that was lost."""
        try:
            handle.wait()
        except Exception as exc:
            raise self.explain(exc, what) from exc

    def explain(self, exc: BaseException, what: str) -> RunError:
        """The one-line error for a failed collective: the lost rank, or, with every peer's
        heartbeat alive, the timeout that ended it and the key that sets it."""
        lost = self.lost_ranks()
        first = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if lost:
            who = ", ".join(f"rank {r}" for r in lost)
            return RankLostError(f"{what} failed: lost {who} ({first})")
        return CollectiveTimeout(
            f"{what} failed with every rank alive ({first[:200]}): a collective waited longer "
            f"than parallel.timeout_s = {self.state.timeout_s} s on some rank; raise "
            f"parallel.timeout_s (the default is 300) if a step, evaluation or checkpoint "
            f"save can take that long")
