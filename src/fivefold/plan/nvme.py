"""The planner's NVMe tier (`parallel.offload = "nvme"`, parallel/nvme.py).

Memory: what CPU offload moves off the GPU (the fp32 master and the optimizer moments of
the rank's shard) moves off host memory too, into files; host memory keeps only the
staging slots (2 slots × 3 states × a chunk of fp32 values), the GPU keeps what it keeps
under CPU offload.

Time (ZeRO-Infinity, Rajbhandari et al. 2021, §6 "overlap-centric design"): each step reads
and writes every offloaded byte once, a chunk at a time, while the update runs on the chunk
before it, so the step pays the update (the CPU offload's optimizer time) plus only the I/O
the update does not hide: max(0, io - update), io = 2 · disk bytes / `Hardware.nvme_gbps`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.plan.hardware import GIB, Assumptions, Hardware
from fivefold.plan.layout import Layout
from fivefold.plan.timing import optimizer_time

CHUNK_NUMEL = 1 << 20  # parallel/nvme.py's chunk (this module imports no torch)
STAGING_BYTES = 2 * 3 * CHUNK_NUMEL * 4  # its two staging slots of three fp32 states


@dataclass(frozen=True)
class NvmeStates:
    """Per rank: bytes moved off the GPU, off host memory (into files), and the staging."""

    off_gpu: float  # master + moments no longer in GPU memory (as under CPU offload)
    disk: float  # the same bytes, in this rank's files
    host: float  # host memory it still takes: the staging slots


def nvme_states(cpu_bytes: float) -> NvmeStates:
    """From the host bytes CPU offload books for the same layout (`ModelStates.cpu`,
    `LayoutPlan.cpu_bytes`): they go to disk instead."""
    return NvmeStates(off_gpu=cpu_bytes, disk=cpu_bytes,
                      host=min(STAGING_BYTES, 2 * cpu_bytes))  # slots of up to 12 B/value


@dataclass(frozen=True)
class NvmeTime:
    io: float  # seconds of disk traffic per step (read + write every offloaded byte)
    update: float  # the CPU optimizer step the I/O overlaps with
    exposed: float  # max(0, io - update): what the step waits for the disk

    @property
    def step(self) -> float:
        return self.update + self.exposed


def nvme_time(disk_bytes: float, update_s: float, hw: Hardware) -> NvmeTime:
    """The optimizer step with its states streamed from disk, overlapped chunk by chunk."""
    io = 2 * disk_bytes / (hw.nvme_gbps * 1e9)
    return NvmeTime(io=io, update=update_s, exposed=max(0.0, io - update_s))


def plan_nvme(work, layout: Layout, hw: Hardware, assume: Assumptions,
              cpu_bytes: float) -> tuple[NvmeStates, NvmeTime]:
    """Memory and time of the NVMe tier for `layout` (`cpu_bytes`: CPU offload's host bytes
    per GPU for it)."""
    moved = nvme_states(cpu_bytes)
    update = optimizer_time(work, replace(layout, offload=True), hw, assume)
    return moved, nvme_time(moved.disk, update, hw)


def describe_nvme(work, layout: Layout, hw: Hardware, assume: Assumptions,
                  cpu_bytes: float) -> str:
    """The lines `fivefold plan --config` adds for a config with offload = "nvme"."""
    moved, t = plan_nvme(work, layout, hw, assume, cpu_bytes)
    return (f"NVMe tier (parallel.offload = nvme): {moved.disk / GIB:.2f} GiB per GPU of "
            f"master and optimizer states on disk instead of host memory (host keeps "
            f"{moved.host / 2**20:.0f} MiB of staging); per step {t.io:.3f} s of I/O at "
            f"{hw.nvme_gbps:g} GB/s (--hw nvme_gbps=...) beside a {t.update:.3f} s update: "
            f"the step waits {t.exposed:.3f} s more than with offload = cpu")
