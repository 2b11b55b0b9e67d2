"""The GPU cost of a training step, counted on any machine (`fivefold trace`).

    from fivefold.trace import trace_step, trace_callable
    t = trace_step(["--model.num_layers", "2"], gpu="h100")   # -> StepTrace
    t.kernels, t.bytes, t.flops, t.syncs, t.syncs_by_kind()  # the whole step
    t.part("loss").kernels, t.matching("layers.0").ops        # per part (record.PartRecord)
    t.timeline.step_s, t.timeline.bound, t.planner["step_time_s"]

counter.py says what a kernel, a byte and a sync are; parts.py how ops get their part;
roofline.py how the time on a GPU is predicted; step.py what a trace covers.
"""

from fivefold.trace.counter import SYNC_KINDS, Event, OpCounter
from fivefold.trace.parts import PartTracker, part_name
from fivefold.trace.record import PartRecord, StepTrace
from fivefold.trace.roofline import (
    DEFAULT_LAUNCH_US,
    DEFAULT_VIEW_US,
    Timeline,
    device_for,
    simulate,
)
from fivefold.trace.step import load_config, trace_callable, trace_step

__all__ = ["DEFAULT_LAUNCH_US", "DEFAULT_VIEW_US", "SYNC_KINDS", "Event", "OpCounter", "PartRecord",
           "PartTracker", "StepTrace", "Timeline", "device_for", "load_config", "part_name",
           "simulate", "trace_callable", "trace_step"]
