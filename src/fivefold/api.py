"""The library API: drive the engine from Python, not only from the command line.

    import fivefold

    with fivefold.Trainer(train={"steps": 20, "gbs": 8}, data=my_batches) as trainer:
        for _ in range(20):
            metrics = trainer.step()          # {'step': 1, 'loss': ..., 'grad_norm': ...}
        trainer.save()

    records = fivefold.train(fivefold.Config())   # the whole loop, as `fivefold train` runs it

A config is a `fivefold.Config`, keyword sections (`train={"lr": 1e-3}`) applied on top of
it, or both; it is validated as the command line's is. `data` is any iterable of global
batches `(inputs, targets)`, int64 tensors of shape (train.gbs, train.seq_len); each rank
takes its data-parallel share, cut into micro-batches of parallel.mbs, exactly as the
built-in loader shares its batches. Without `data` the config's token file is used.

Under torchrun the process group is joined on construction (when nothing has joined it yet)
and destroyed by `close()`; the context manager closes on every exit, so the watchdog
thread and the process group never outlive the trainer (train/lifecycle.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from fivefold.config import Config, ConfigError, from_dict, validate


def make_config(cfg: Config | None = None, **sections: dict) -> Config:
    """`cfg` (or the defaults) with keyword sections applied, validated."""
    import copy

    cfg = copy.deepcopy(cfg) if cfg is not None else Config()
    from_dict(sections, cfg)
    validate(cfg)
    return cfg


class _GivenBatches:
    """The trainer's loader interface over a user's iterable of global batches."""

    def __init__(self, data: Iterable, gbs: int, seq_len: int, mbs: int, dp: int, dp_rank: int,
                 inner):
        self.iterator: Iterator = iter(data)
        self.gbs, self.seq_len, self.mbs, self.dp, self.dp_rank = gbs, seq_len, mbs, dp, dp_rank
        self.inner = inner  # the config's loader: its position is what checkpoints record
        self.pending = None

    @property
    def num_target_tokens(self) -> int:
        return self.gbs * self.seq_len

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.pending if self.pending is not None else next(self.iterator, None)
        self.pending = None
        if batch is None:
            raise StopIteration("the data iterable is exhausted")
        inputs, targets = (torch.as_tensor(t, dtype=torch.long) for t in batch)
        want = (self.gbs, self.seq_len)
        if tuple(inputs.shape) != want or tuple(targets.shape) != want:
            raise ConfigError(f"a batch has inputs {tuple(inputs.shape)} and targets "
                              f"{tuple(targets.shape)}; each must be (train.gbs, train.seq_len)"
                              f" = {want}")
        per = self.gbs // self.dp
        rows = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        self.inner.samples_consumed += self.gbs
        return list(zip(inputs[rows].split(self.mbs), targets[rows].split(self.mbs)))

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class Trainer:
    """One training run: `step()`, `evaluate()`, `save()`, `load()`; a context manager."""

    def __init__(self, cfg: Config | None = None, data: Iterable | None = None,
                 **sections: dict):
        from fivefold.parallel.mesh import ParallelDims, init_distributed
        from fivefold.train import lifecycle
        from fivefold.train.trainer import Trainer as Engine

        self.cfg = make_config(cfg, **sections)
        joined_before = torch.distributed.is_initialized()
        _, world = init_distributed(self.cfg.parallel.backend, self.cfg.parallel.timeout_s) \
            if not joined_before else (None, torch.distributed.get_world_size())
        self._owns_group = not joined_before and world > 1
        self._shutdown = lifecycle.shutdown_distributed
        try:
            if world != self.cfg.parallel.world_size:
                raise ConfigError(f"{world} process(es) launched but parallel.dp·tp·pp·cp = "
                                  f"{self.cfg.parallel.world_size}; launch that many")
            dims = ParallelDims.from_config(self.cfg.parallel) if world > 1 else None
            self.engine = Engine(self.cfg, dims, quiet=True)
        except ConfigError:  # a bad input on every rank alike: nothing is in flight
            if self._owns_group:
                self._shutdown()
            raise
        if data is not None:
            e, par = self.engine, self.cfg.parallel
            e.loader = _GivenBatches(data, self.cfg.train.gbs, self.cfg.train.seq_len, par.mbs,
                                     par.dp, e.dims.dp_rank, e.loader)
        self.closed = False

    @property
    def step_count(self) -> int:
        return self.engine.step

    @property
    def model(self):
        """This rank's modules (a ParallelModel: `.chunks`, `.named_parameters()`)."""
        return self.engine.model

    def step(self, batch=None) -> dict:
        """One optimizer step on `batch` (a global (inputs, targets) batch), or on the next
        batch of the data; returns its metrics (loss, lr, grad_norm, tokens_per_s, ...)."""
        if batch is not None:
            if not isinstance(self.engine.loader, _GivenBatches):
                e, par = self.engine, self.cfg.parallel
                e.loader = _GivenBatches((), self.cfg.train.gbs, self.cfg.train.seq_len,
                                         par.mbs, par.dp, e.dims.dp_rank, e.loader)
            self.engine.loader.pending = batch
        return self.engine.train_step()

    def evaluate(self) -> dict:
        """Validation loss and perplexity on the config's held-out split."""
        if self.engine.val_loader is None:
            raise ConfigError("no validation split: set data.val_fraction > 0")
        return self.engine.evaluate()

    def save(self) -> str:
        """Write a checkpoint of the current step; returns its directory."""
        from pathlib import Path

        from fivefold.train import checkpoint as ckpt

        self.engine.save_checkpoint()
        return str(ckpt.step_dir(Path(self.cfg.checkpoint.dir), self.engine.step))

    def load(self, path: str | None = None) -> str:
        """Load a step_* directory, or the newest loadable checkpoint of checkpoint.dir."""
        self.engine.resume(self.cfg.checkpoint.dir, path or "auto")
        if self.engine.resumed_from is None:
            raise ConfigError(f"no checkpoint in {self.cfg.checkpoint.dir} to load")
        return self.engine.resumed_from

    def close(self, failed: bool = False) -> None:
        """Stop the watchdog thread; destroy the process group if this trainer joined it —
        unless the run failed: then a peer may be gone, and waiting for it could hang, so
        the group is left to the end of the process (train/lifecycle.py)."""
        if self.closed:
            return
        self.closed = True
        self.engine.close()
        if self._owns_group and not failed:
            self._shutdown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def train(cfg: Config | None = None, **sections: dict) -> list[dict]:
    """The whole run as `fivefold train` does it (progress, validation, checkpoints, resume);
    returns the step records. Under torchrun it joins and leaves the process group."""
    from fivefold.parallel.mesh import ParallelDims, init_distributed
    from fivefold.train import lifecycle
    from fivefold.train.loop import run

    cfg = make_config(cfg, **sections)
    joined_before = torch.distributed.is_initialized()
    _, world = (0, 1) if joined_before else init_distributed(cfg.parallel.backend,
                                                              cfg.parallel.timeout_s)
    if joined_before:
        world = torch.distributed.get_world_size()
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else None
    records = run(cfg, dims)  # on a failure the group is left up: see Trainer.close
    if not joined_before and world > 1:
        lifecycle.shutdown_distributed()
    return records
