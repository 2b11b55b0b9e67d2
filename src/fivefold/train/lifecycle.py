"""How a run ends: exit codes, SIGTERM, and the process group, on every path.

A run ends in one of these ways, each with its own exit code:

    0    it finished (or `fivefold.train` returned)
    1    the run stopped for a reason it names in one line: `train.max_bad_steps` non-finite
         steps in a row, a checkpoint that could not be written, NaN weights
    2    a bad input, found before anything started (the config package)
    3    a peer rank was lost: named by the watchdog (parallel/watchdog.py)
    4    an unforeseen error (cli.py: one line, the traceback with --debug)
    130  Ctrl-C (SIGINT)
    143  SIGTERM, the scheduler's "stop now" (Slurm, Kubernetes, torchrun): the run stops at
         the next step boundary, after writing a checkpoint when
         `checkpoint.save_on_signal = true`

On a clean end (0, or 143 once every rank agreed to stop at the same step) every rank is at
the same point, so the process group is destroyed normally. On a failure a peer may be dead
or blocked inside a collective: waiting for it (as destroying a gloo group does, joining its
worker threads) could hang, so the process leaves with `os._exit` once its own files are
flushed and closed. Either way the watchdog thread has been stopped and joined first: a
thread inside a store call while the interpreter finalizes aborts the process (SIGABRT,
"terminate called without an active exception") after a run that succeeded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from fivefold.config import RunError

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_RANK_LOST = 0, 1, 2, 3
EXIT_INTERRUPT, EXIT_TERMINATED = 130, 143


class RunFailed(RunError):
    """A failure the run explains in one line (the CLI prints it, exit code 1)."""

    exit_code = EXIT_ERROR


class BadStepsError(RunFailed):
    exit_code = EXIT_ERROR


class CheckpointWriteError(RunFailed):
    exit_code = EXIT_ERROR


class Terminated(Exception):
    """Every rank agreed to stop after a SIGTERM; raised at a step boundary."""

    def __init__(self, step: int, saved: str | None):
        self.step, self.saved = step, saved
        where = f"checkpoint {saved} written" if saved else "no checkpoint written " \
            "(checkpoint.save_on_signal = false)"
        super().__init__(f"stopped by SIGTERM after step {step}; {where}")


@contextlib.contextmanager
def ledger_paused(dims):
    """Collectives that are not the training step's own traffic (metrics, agreement on a
    checkpoint, the stop flag) stay out of the byte ledger the planner is tested against."""
    was, dims.ledger.enabled = dims.ledger.enabled, False
    try:
        yield
    finally:
        dims.ledger.enabled = was


class StopSignal:
    """SIGTERM sets a flag that the training loop reads at step boundaries.

    The ranks of a job get the signal at slightly different times, so the decision to stop is
    taken together: `agreed` all-reduces the flag (max) over every rank, at the steps the
    loop names with `check` — the same on every rank (a function of the step number and the
    config), so every rank stops after the same step. The loop checks where it reads the
    steps' records anyway (every log.every steps, before a validation or a save, the last
    step): there the host has waited for the device already, and reading the flag adds no
    wait; a check at every step would stop the host each step (reading a reduced flag waits
    for the device's queue). One rank alone needs no collective and stops after the step the
    signal came in. A second SIGTERM while the first is pending ends the process at once
    (143).
    """

    def __init__(self):
        self.received = False
        self._previous = None

    def install(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received:
            sys.stderr.write("fivefold: second SIGTERM; exiting now\n")
            sys.stderr.flush()
            os._exit(EXIT_TERMINATED)
        self.received = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def agreed(self, world, check: bool = True) -> bool:
        """True on every rank when any rank has been signalled, at a `check` step (a
        collective over `world` there; every rank passes the same `check`)."""
        from fivefold.parallel import comm

        if world.size == 1:
            return self.received
        if not check:
            return False
        device = "cuda" if dist.get_backend(world.pg) == "nccl" else "cpu"
        flag = torch.full((1,), 1.0 if self.received else 0.0, device=device)
        was, world.ledger.enabled = world.ledger.enabled, False  # not the step's traffic
        try:
            comm.all_reduce(flag, world, op="max")
        finally:
            world.ledger.enabled = was
        return bool(flag.item())


def warn_shared_store_restarts() -> None:
    """torchrun --max-restarts with its default shared rendezvous store can hand a restarted
    worker the address of a peer that died in the attempt before (pytorch/pytorch#135712):
    the restart then fails in init_process_group. Say so once, before it can happen."""
    env = os.environ
    if (env.get("RANK") == "0" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
            and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        print("note: torchrun --max-restarts shares its rendezvous store with the workers; a "
              "restart can then be handed a dead worker's address (pytorch/pytorch#135712). "
              "Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", file=sys.stderr, flush=True)


def shutdown_distributed() -> None:
    """The clean end: every rank is here, nothing is in flight; destroy the process group."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_if_distributed(code: int) -> int:
    """Return `code`; but if the process group is still up this is a failure path (see the
    module docstring): flush and leave the process at once, without waiting for peers."""
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def leave_after_error() -> None:
    """An unexpected exception under a process group: print it and leave (exit code 1)."""
    if dist.is_available() and dist.is_initialized():
        import traceback

        traceback.print_exc()
        leave_if_distributed(EXIT_ERROR)
