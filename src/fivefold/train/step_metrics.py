"""A training step's record, read from the device when it is logged, not when it is made.

A step on a GPU must not wait for the device (a host sync stops the host from queueing the
next kernels, and none is allowed inside a CUDA graph). What a step learns on the device —
its loss, gradient norm, whether it was skipped (a non-finite loss or gradient, an fp16
overflow), the loss scale — stays there as 0-d tensors in its `StepMetrics`. The first read
of such a value reads every pending record's at once: one `.tolist()` per device
(`StepBook.settle`). `fivefold train` reads them every `log.every` steps, before a
validation or a checkpoint, and at the end (train/loop.py); a record read earlier (a test,
the Python API) settles then.

Throughput is measured over the same span: the wall-clock time from the start of the first
pending step to the settle, which waited for all of them, divided among them, so
`step_time_s`, `tokens_per_s` and `mfu` count what the device did, not what the host queued.

`train.max_bad_steps` non-finite steps in a row stop the run when their records are read:
every `log.every` steps at the latest, and always before a checkpoint is written.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

_PENDING = object()
DEVICE_KEYS = ("loss", "grad_norm", "skipped", "bad", "loss_scale", "tokens_per_s",
               "step_time_s", "mfu")


class StepMetrics(MutableMapping):
    """One step's record, a mapping like the dict it stands for. Keys whose values are on
    the device read as soon as any of them is asked for (with every pending record of the
    same `StepBook`); the others are there already."""

    def __init__(self, data: dict, book: StepBook | None = None):
        self._data, self._book = data, book

    def __getitem__(self, key):
        value = self._data[key]
        if value is _PENDING:
            self._book.settle()
            value = self._data[key]
        return value

    def __setitem__(self, key, value) -> None:
        self._data[key] = value

    def __delitem__(self, key) -> None:
        del self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __reduce__(self):
        """Pickled (sent from a rank, copied) as its values, read first."""
        return StepMetrics, (dict(self),)

    @property
    def settled(self) -> bool:
        return all(v is not _PENDING for v in self._data.values())

    def __repr__(self) -> str:
        return f"StepMetrics({self._data if self.settled else '<pending>'})"


class StepBook:
    """The records of the steps made and not yet read.

    `throughput`: a metrics.Throughput; `on_bad_run(first, last)` is called (and raises) when
    steps first..last are `max_bad_steps` non-finite steps in a row; `counts_bad`: whether a
    skipped step is a bad one (not under fp16, whose overflows are the scaler's)."""

    def __init__(self, throughput, max_bad_steps: int, counts_bad: bool, on_bad_run):
        self.throughput, self.max_bad_steps = throughput, max_bad_steps
        self.counts_bad, self.on_bad_run = counts_bad, on_bad_run
        self.pending: list[tuple[StepMetrics, dict, int, int]] = []
        self.bad_steps = 0  # non-finite steps in a row, as of the last record read
        self.bad_run: tuple[int, int] | None = None  # steps first..last that stop the run

    def begin(self) -> None:
        """A step starts: with nothing pending, the timed span starts here (what ran since
        the last settle, a validation or a save, is not counted)."""
        if not self.pending:
            self.throughput.begin()

    def add(self, data: dict, device_values: dict, num_tokens: int, tokens: int,
            later: dict | None = None) -> StepMetrics:
        """A record of `data` (host values; DEVICE_KEYS among them keep their place, their
        values are filled later) and, unread, `device_values`: loss_sum (this step's loss
        summed over the global batch's `num_tokens` target tokens), grad_norm, skipped,
        loss_scale (0-d tensors, or numbers the host already knew). `later`: keys -> (a
        device tensor, fn(its host copy) -> {key: value}), more keys filled when read (the
        MoE layers' counts)."""
        later = later or {}
        wait = {k for keys in later for k in keys}
        data = {**data, **{k: None for k in (*DEVICE_KEYS, *wait) if k not in data}}
        rec = StepMetrics({k: _PENDING if k in DEVICE_KEYS or k in wait else v
                           for k, v in data.items()}, self)
        rec.bad_in_a_row = 0  # set when read: this step's place in a run of bad steps
        rec.later = list(later.values())
        self.pending.append((rec, device_values, num_tokens, tokens))
        return rec

    def settle(self, check: bool = True) -> list[StepMetrics]:
        """Read every pending record (one wait per device), fill them in step order, and
        return them; then stop the run (`check_bad_steps`) if they hold a run of
        `max_bad_steps` bad steps, unless `check` is False (the caller logs them first)."""
        pending, self.pending = self.pending, []
        out = self._fill(pending)
        if check:
            self.check_bad_steps()
        return out

    def check_bad_steps(self) -> None:
        """Stop the run (`on_bad_run` raises) if the records read hold a bad run."""
        if self.bad_run is not None:
            self.on_bad_run(*self.bad_run)

    def _fill(self, pending) -> list[StepMetrics]:
        if not pending:
            return []
        read = _read_all([values for _, values, _, _ in pending])
        tps, mfu, elapsed = self.throughput.lap(sum(tokens for *_, tokens in pending))
        for (rec, _, num_tokens, _), values in zip(pending, read):
            skipped = bool(values["skipped"])
            bad = skipped and self.counts_bad
            rec._data.update({
                "loss": values["loss_sum"] / num_tokens,
                "grad_norm": float("nan") if skipped else values["grad_norm"],
                "skipped": skipped, "bad": bad, "loss_scale": values["loss_scale"],
                "tokens_per_s": tps, "step_time_s": elapsed / len(pending), "mfu": mfu})
            for tensor, make in rec.later:  # the device has finished them: copies only
                rec._data.update(make(tensor.detach().cpu()))
            rec.later = []
            self.bad_steps = self.bad_steps + 1 if bad else 0
            rec.bad_in_a_row = self.bad_steps
            if self.bad_run is None and self.bad_steps >= self.max_bad_steps:
                self.bad_run = (rec._data["step"] - self.bad_steps + 1, rec._data["step"])
        return [rec for rec, *_ in pending]


def _read_all(records: list[dict]) -> list[dict]:
    """Each record's values as Python floats: the tensors of each device stacked (as float64,
    which holds every fp32 value and flag exactly) and read with one `.tolist()`."""
    out = [dict(values) for values in records]
    by_device: dict[torch.device, list[tuple[dict, str, torch.Tensor]]] = {}
    for values in out:
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append((values, key, value))
            else:
                values[key] = float(value)
    for entries in by_device.values():
        numbers = torch.stack([t.detach().reshape(()).to(torch.float64)
                               for _, _, t in entries]).tolist()
        for (values, key, _), number in zip(entries, numbers):
            values[key] = number
    return out
