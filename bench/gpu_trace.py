"""bench/gpu.py's item `trace_vs_measured`: `fivefold trace`'s predicted step time beside the
step times the train items measured in the same run (same overrides, same precision).

On CUDA the GPU is the catalog's entry for the device's name (plan/hardware.py); a device
the catalog lacks is named in the reason. A dry run (CPU) predicts an H100 and says so:
there is no measured GPU step to set beside it, only the CPU's, which the trace does not
model (`vs_measured` is then the CPU step over the predicted H100 one).
"""

from __future__ import annotations

import torch

JOBS = (("train_default", "default_overrides"), ("train_8b_blocks", "blocks_overrides"))


def trace_vs_measured(ctx) -> dict:
    from gpu_items import NotRun, load_config

    from fivefold.plan.hardware import hardware_for_device_name
    from fivefold.trace import trace_step

    if ctx.device.type == "cuda":
        name = torch.cuda.get_device_name(ctx.device)
        hw = hardware_for_device_name(name)
        if hw is None:
            raise NotRun(f"the planner's catalog has no entry for {name}")
        gpu = hw.name
    else:
        gpu = "h100"
    out = {"gpu": None, "measured_on": "gpu" if ctx.device.type == "cuda" else "cpu (dry run)"}
    for item, shape in JOBS:
        run = ctx.results.get(item, {})
        cfg = load_config(ctx, "trace-" + item, ["--train.precision", "bf16",
                                                 *ctx.shape(shape)])
        t = trace_step(cfg, gpu=gpu)
        row = {"predicted_step_s": t.timeline.step_s, "bound": t.timeline.bound,
               "device_busy_s": t.timeline.device_busy_s, "host_s": t.timeline.host_s,
               "kernels": t.kernels, "syncs": t.syncs, "loss_kernels": t.part("loss").kernels,
               "planner_step_s": (t.planner or {}).get("step_time_s")}
        if run.get("status") == "ok":
            row["measured_step_s"] = run["step_time_s"]
            row["measured_over_predicted"] = run["step_time_s"] / t.timeline.step_s
        else:
            row["measured_step_s"] = None
            row["note"] = f"{item} did not run: {run.get('reason', 'not reached')}"
        out[item], out["gpu"] = row, t.gpu
    return out
