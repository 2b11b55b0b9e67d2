"""A torchrun worker for test_restarts.py: `fivefold train`, with one rank SIGKILLed at a
chosen point of a chosen step on each attempt of torch elastic's restart loop.

    torchrun --max-restarts N tests/fault_worker.py POINT:RANK:STEP,... -- TRAIN-ARGS...

Attempt k (TORCHELASTIC_RESTART_COUNT) uses the k-th fault; attempts beyond the list run
clean. Points: forward, backward, reduction (entering the gradient reduction), optimizer
(entering the update), save (after the step's checkpoint data is written, before it is
published); and slow: the rank sleeps 10 s before saving the step's checkpoint, alive but
late.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _die() -> None:
    sys.stderr.write(f"fault_worker: SIGKILL rank {os.environ['RANK']}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, step: int) -> None:
    from fivefold.train import checkpoint as ckpt
    from fivefold.train.trainer import Trainer

    real_step = Trainer.train_step

    def train_step(self):
        now = self.step + 1
        if point == "forward" and now == step:
            _die()
        if point == "slow" and now == step:  # alive (heartbeats go on), but late into the
            real_save = self.save_checkpoint  # save's first all-reduce over the world group

            def late_save(*args, **kwargs):
                # Twice test_restarts.py's parallel.timeout_s = 5: the peer, in step with this
                # rank until the save, times its first all-reduce out after 5 s; any sleep
                # past that lets it find every heartbeat alive, and a longer one only holds
                # the job's end back.
                sys.stderr.write(f"fault_worker: rank {os.environ['RANK']} sleeps 10 s\n")
                time.sleep(10.0)
                self.save_checkpoint = real_save
                return real_save(*args, **kwargs)
            self.save_checkpoint = late_save
        if point == "backward" and now == step and not getattr(self, "_fault_hooked", False):
            self._fault_hooked = True
            next(iter(self.model.named_parameters()))[1].register_hook(lambda g: _die())
        if point in ("reduction", "optimizer") and now == step:
            name = "finish_grad_sync" if point == "reduction" else "step"
            real = getattr(self.optimizer, name)

            def dying(*args, **kwargs):
                _die()
                return real(*args, **kwargs)
            setattr(self.optimizer, name, dying)
        return real_step(self)

    Trainer.train_step = train_step
    if point == "save":
        real_save = ckpt.dcp.save

        def save_then_die(state, *args, **kwargs):
            real_save(state, *args, **kwargs)
            if state["trainer"]["step"] == step:
                _die()
        ckpt.dcp.save = save_then_die


def main() -> int:
    faults, train_args = sys.argv[1].split(","), sys.argv[3:]  # argv[2] is "--"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(faults):
        point, victim, step = faults[attempt].split(":")
        if int(os.environ["RANK"]) == int(victim):
            install(point, int(step))
    from fivefold.cli import main as cli_main

    return cli_main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main())
