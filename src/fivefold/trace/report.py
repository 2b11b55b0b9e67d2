"""The terminal table of a trace, and its summary lines."""

from __future__ import annotations

import re

from fivefold.trace.record import PartRecord, StepTrace, versus_planner

_LAYER = re.compile(r"^layers\.\d+")


def grouped(trace: StepTrace, max_layers: int = 4) -> dict[str, PartRecord]:
    """The parts, with the blocks' parts summed over layers ("layers.*.mlp") when there are
    more than `max_layers` of them."""
    layers = {m.group(0) for name in trace.parts if (m := _LAYER.match(name))}
    if len(layers) <= max_layers:
        return trace.parts
    out: dict[str, PartRecord] = {}
    for name, rec in trace.parts.items():
        key = _LAYER.sub("layers.*", name)
        acc = out.setdefault(key, PartRecord(key))
        for f in ("kernels", "bytes_read", "bytes_written", "flops", "syncs", "seconds"):
            setattr(acc, f, getattr(acc, f) + getattr(rec, f))
        acc.ops.update(rec.ops)
        acc.sync_ops.update(rec.sync_ops)
    return out


def table(trace: StepTrace) -> str:
    rows = [("part", "kernels", "GB moved", "GFLOP", "syncs", "device ms", "top kernels")]
    for name, p in grouped(trace).items():
        top = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in p.ops.most_common(2))
        rows.append((name, f"{p.kernels:,}", f"{p.bytes / 1e9:.3f}", f"{p.flops / 1e9:.1f}",
                     str(p.syncs), f"{p.seconds * 1e3:.2f}", top))
    rows.append(("total", f"{trace.kernels:,}", f"{trace.bytes / 1e9:.3f}",
                 f"{trace.flops / 1e9:.1f}", str(trace.syncs),
                 f"{sum(p.seconds for p in trace.parts.values()) * 1e3:.2f}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1])]
        lines.append("  ".join(cells + [r[-1]]).rstrip())
        if j == 0 or j == len(rows) - 2:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)


def summary(trace: StepTrace) -> str:
    """The setup, the predicted time and the planner's beside it."""
    s, t = trace.setup, trace.timeline
    lines = []
    if s:
        lines.append(f"traced: {s['model']}, {s['num_layers']} layer(s), hidden "
                     f"{s['hidden_size']}, vocab {s['vocab_size']}, seq {s['seq_len']}, gbs "
                     f"{s['gbs']}, mbs {s['mbs']}, {s['precision']}, one rank, eager, step "
                     f"{s['steps_run']} of {s['steps_run']}")
    kinds = ", ".join(f"{k} {n}" for k, n in trace.syncs_by_kind().items() if n)
    lines.append(f"syncs: {trace.syncs}" + (f" ({kinds})" if kinds else ""))
    if t is not None:
        lines.append(f"on {trace.gpu}: step {t.step_s * 1e3:.1f} ms predicted, "
                     f"{t.bound}-bound (device busy {t.device_busy_s * 1e3:.1f} ms; host "
                     f"{t.host_s * 1e3:.1f} ms at {s.get('launch_us', 0):g} us a kernel, "
                     f"{s.get('view_us', 0):g} us a view; device idle "
                     f"{t.device_idle_s * 1e3:.1f} ms; roofline floor "
                     f"{t.roofline_s * 1e3:.1f} ms)")
    p = trace.planner
    if p and t is not None:
        ratio = t.step_s / p["step_time_s"] if p["step_time_s"] else float("inf")
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p["parts_s"].items() if v)
        lines.append(f"planner: step {p['step_time_s'] * 1e3:.1f} ms ({parts}); the trace "
                     f"predicts {ratio:.2f}x the planner's time; memory {p['memory']}")
        v = versus_planner(trace)
        lines.append("  where they differ: " + "; ".join(
            f"{k.replace('_', ' ')} {d['trace_s'] * 1e3:.1f} vs {d['planner_s'] * 1e3:.1f} ms"
            + (f" ({d['ratio']:.2f}x)" if d["ratio"] else "") for k, d in v.items()))
    return "\n".join(lines)
