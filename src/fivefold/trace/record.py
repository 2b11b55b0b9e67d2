"""The records a trace gives: per part, per op, the whole step (JSON-ready)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fivefold.trace.counter import SYNC_KINDS, Event


@dataclass
class PartRecord:
    """One part's share of a step (a kernel is an `Event` with kind "kernel")."""

    name: str
    kernels: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    flops: float = 0.0
    syncs: int = 0
    seconds: float = 0.0  # device time on the traced GPU (roofline, efficiencies applied)
    ops: Counter = field(default_factory=Counter)  # kernels by op ("aten.add_" -> n)
    sync_ops: Counter = field(default_factory=Counter)  # syncs by "kind op"

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def add(self, e: Event) -> None:
        if e.kind == "kernel":
            self.kernels += 1
            self.bytes_read += e.bytes_read
            self.bytes_written += e.bytes_written
            self.flops += e.flops
            self.seconds += e.seconds
            self.ops[e.op] += 1
        if e.sync:
            self.syncs += 1
            self.sync_ops[f"{e.sync} {e.op}"] += 1

    def to_json(self) -> dict:
        return {"kernels": self.kernels, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "flops": self.flops,
                "syncs": self.syncs, "device_s": self.seconds, "ops": dict(self.ops),
                "sync_ops": dict(self.sync_ops)}


def summarize(events: list[Event]) -> dict[str, PartRecord]:
    """Per part, in the order the parts first ran."""
    parts: dict[str, PartRecord] = {}
    for e in events:
        if e.kind in ("kernel", "sync") or e.sync:
            parts.setdefault(e.part, PartRecord(e.part)).add(e)
    return parts


NOT_MODEL = ("optimizer", "zero_grad", "grad_sync", "step")


def versus_planner(trace: StepTrace) -> dict | None:
    """Where the trace's predicted time and the planner's disagree, and by how much: the
    whole step, the model's kernels against the planner's compute, the optimizer's kernels
    against its optimizer time, and the host time the planner does not model."""
    p, t = trace.planner, trace.timeline
    if not p or t is None or not p.get("step_time_s"):
        return None
    model = sum(r.seconds for n, r in trace.parts.items()
                if n not in NOT_MODEL and not n.startswith("collective."))
    parts = p["parts_s"]
    out = {"step": (t.step_s, p["step_time_s"]),
           "model_kernels_vs_compute": (model, parts.get("compute", 0.0)),
           "optimizer": (trace.part("optimizer").seconds, parts.get("optimizer", 0.0)),
           "host_not_in_planner": (t.host_s, 0.0)}
    return {k: {"trace_s": a, "planner_s": b, "ratio": a / b if b else None}
            for k, (a, b) in out.items()}


def _versus(trace):
    return versus_planner(trace)


@dataclass
class StepTrace:
    """What one traced step (or callable) launched, moved, computed and waited for.

    `events` holds every aten op in order (kernels, views, host ops, syncs); `parts` the
    kernels and syncs summed by part; `timeline` (a roofline.Timeline) the predicted time
    on `gpu`; `planner` the planner's own prediction for the same config (None for a
    callable)."""

    events: list[Event]
    parts: dict[str, PartRecord]
    gpu: str | None = None
    timeline: object | None = None
    planner: dict | None = None
    setup: dict = field(default_factory=dict)  # what was traced (config summary)
    first_step: dict | None = None  # totals of step 1 when a later step is the one kept

    @classmethod
    def from_events(cls, events: list[Event], **kw) -> StepTrace:
        return cls(events, summarize(events), **kw)

    # --- totals ----------------------------------------------------------------------
    @property
    def kernels(self) -> int:
        return sum(p.kernels for p in self.parts.values())

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts.values())

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.parts.values())

    @property
    def syncs(self) -> int:
        return sum(p.syncs for p in self.parts.values())

    def syncs_by_kind(self) -> dict[str, int]:
        c = Counter(e.sync for e in self.events if e.sync)
        return {k: c.get(k, 0) for k in SYNC_KINDS}

    @property
    def ops(self) -> Counter:
        """Kernels by op name over the whole step ("aten.add_" -> n)."""
        c: Counter = Counter()
        for p in self.parts.values():
            c.update(p.ops)
        return c

    def part(self, name: str) -> PartRecord:
        """One part's record (an empty one for a part that launched nothing)."""
        return self.parts.get(name, PartRecord(name))

    def matching(self, prefix: str) -> PartRecord:
        """The parts whose names start with `prefix`, summed ("layers.0" is its block)."""
        out = PartRecord(prefix)
        for e in self.events:
            if e.part == prefix or e.part.startswith(prefix + ".") or (
                    prefix.endswith(".") and e.part.startswith(prefix)):
                if e.kind in ("kernel", "sync") or e.sync:
                    out.add(e)
        return out

    def to_json(self) -> dict:
        t = self.timeline
        return {
            "setup": self.setup, "gpu": self.gpu,
            "totals": {"kernels": self.kernels, "bytes": self.bytes, "flops": self.flops,
                       "syncs": self.syncs, "syncs_by_kind": self.syncs_by_kind()},
            "time": None if t is None else {
                "step_s": t.step_s, "device_busy_s": t.device_busy_s, "host_s": t.host_s,
                "device_idle_s": t.device_idle_s, "host_wait_s": t.host_wait_s,
                "roofline_s": t.roofline_s, "bound": t.bound},
            "planner": self.planner, "versus_planner": _versus(self),
            "first_step": self.first_step,
            "parts": {k: v.to_json() for k, v in self.parts.items()},
            "ops": dict(self.ops.most_common()),
        }
