"""The time of a traced step on a named GPU: a roofline per kernel, a host that launches them.

Device time of one kernel (the GPU's figures from the planner's catalog, plan/hardware.py):

    max(FLOPs / (peak × efficiency), bytes / (HBM bandwidth × hbm_efficiency))

with the peak of the GEMM's input type (bf16/fp16, fp8 for float8 operands, fp32) and the
planner's own efficiencies (`Hardware.matmul_efficiency`; attention kernels also
`Assumptions.attention_efficiency`; `Assumptions.hbm_efficiency` for bytes), so the trace
and the planner price a FLOP and a byte alike. `roofline_s` is the same sum at the bare
peaks (efficiency 1): the floor no kernel beats.

Host: each kernel costs the host `launch_us` to dispatch and launch, each op that launches
nothing (a view, a host op) `view_us` to dispatch. The defaults come from the torch.profiler
table of the 8B-shaped 2-block step on an H100 (bench/results/gpu-profile-nvidia-h100-80gb-
hbm3-efcc609.txt, CPU total / calls): 10.9 us per `aten::add_` (dispatch and its
`cudaLaunchKernel`; 345.2 ms over 31,575 calls) and 2.3 us per `aten::slice` (218.6 ms over
95,285). Both were measured under the profiler, which adds its own cost per op; Python's
own time between ops is not counted.

The step is a timeline: the host issues kernels in order, each starting on the device when
both the host has launched it and the device has finished the one before; at a sync the
host waits until the device is idle. The step time is when both are done. It is
host-bound when launching its kernels takes the host longer than running them takes the
device.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_OPS = ("attention", "flash", "efficient_attention", "cudnn_attention")
DEFAULT_LAUNCH_US = 10.9
DEFAULT_VIEW_US = 2.3


@dataclass(frozen=True)
class Device:
    """What the roofline needs of a GPU (from `device_for`)."""

    name: str
    peaks: dict  # FLOP/s by "bf16" | "fp32" | "fp8" (efficiency applied)
    bare_peaks: dict
    bytes_per_s: float  # HBM, efficiency applied
    bare_bytes_per_s: float
    attention_efficiency: float
    memory_gib: float
    launch_s: float
    view_s: float = DEFAULT_VIEW_US * 1e-6


def device_for(gpu: str, launch_us: float = DEFAULT_LAUNCH_US, overrides: dict | None = None,
               view_us: float = DEFAULT_VIEW_US):
    """The catalog's GPU `gpu` (an alias such as "h100" or a catalog name); a ConfigError
    naming the known ones for any other name. Returns (Device, Hardware, Assumptions)."""
    from fivefold.plan.hardware import get_hardware

    hw, assume = get_hardware(gpu, overrides)
    bare = {"bf16": hw.bf16_tflops * 1e12, "fp32": hw.fp32_tflops * 1e12,
            "fp8": (hw.fp8_tflops or hw.bf16_tflops) * 1e12}
    eff = hw.matmul_efficiency
    dev = Device(hw.name, {k: v * eff for k, v in bare.items()}, bare,
                 hw.hbm_tbps * 1e12 * assume.hbm_efficiency, hw.hbm_tbps * 1e12,
                 assume.attention_efficiency, hw.memory_gib, launch_us * 1e-6, view_us * 1e-6)
    return dev, hw, assume


def kernel_seconds(event, dev: Device, bare: bool = False) -> float:
    """One kernel's device time on `dev` (at the bare peaks with bare=True)."""
    peaks = dev.bare_peaks if bare else dev.peaks
    bw = dev.bare_bytes_per_s if bare else dev.bytes_per_s
    t_bytes = (event.bytes_read + event.bytes_written) / bw
    if not event.flops:
        return t_bytes
    rate = peaks.get(event.dtype or "bf16", peaks["bf16"])
    if not bare and any(k in event.name for k in ATTENTION_OPS):
        rate *= dev.attention_efficiency
    return max(event.flops / rate, t_bytes)


@dataclass
class Timeline:
    """The simulated step: totals in seconds."""

    step_s: float  # predicted step time
    device_busy_s: float  # sum of kernel times
    host_s: float  # host dispatch and launch time (no waits)
    device_idle_s: float  # device waiting for the host
    host_wait_s: float  # host waiting at syncs
    roofline_s: float  # kernels at the bare peaks, no host
    bound: str  # "host" | "device"


def simulate(events, dev: Device) -> Timeline:
    """Run the events through the host/device timeline; sets `event.seconds`."""
    host = device = busy = idle = wait = floor = 0.0
    launch = dev.launch_s
    dispatched = 0.0
    for e in events:
        if e.kind in ("view", "host"):
            host += dev.view_s
            dispatched += dev.view_s
        if e.kind == "kernel":
            e.seconds = kernel_seconds(e, dev)
            floor += kernel_seconds(e, dev, bare=True)
            host += launch
            start = max(host, device)
            idle += max(0.0, host - device)
            device = start + e.seconds
            busy += e.seconds
        if e.sync:
            if e.kind == "sync":  # .item(): the copy of one value, launched like a kernel
                host += launch
            wait += max(0.0, device - host)
            host = max(host, device)
    step = max(host, device)
    launched = dispatched + launch * sum(1 for e in events if e.kind in ("kernel", "sync"))
    return Timeline(step, busy, launched, idle, wait, floor,
                    "host" if launched > busy else "device")
