"""The planner's offload tiers: where the states that offload moves off the device live, and
the NVMe tier's time (`parallel.offload = "nvme"`, parallel/nvme.py).

A layout's `offload` is False (resident), True (CPU offload: host memory) or "nvme" (files).

Memory: what CPU offload moves off the GPU (the fp32 master and the optimizer moments of
the rank's shard) NVMe moves off host memory too, into files; host memory keeps only the
staging slots (2 slots × 3 states × a chunk of fp32 values), the GPU keeps what it keeps
under CPU offload. On a CPU device (`Hardware.device_is_host`) the device's memory is the
host's: CPU offload moves nothing off it (its bytes count where they were), NVMe offload
leaves the staging slots in it. With `Hardware.host_memory_gib` set, the host bytes of a
rank must fit in it as well (CPU offload of a large model does not fit a small host).

Time (ZeRO-Infinity, Rajbhandari et al. 2021, §6 "overlap-centric design"): each step reads
and writes every offloaded byte once, a chunk at a time, while the update runs on the chunk
before it, so the step pays the update (the CPU offload's optimizer time; on a CPU device
the resident one) plus only the I/O the update does not hide: max(0, io - update),
io = 2 · disk bytes / `Hardware.nvme_gbps` (`fivefold calibrate --offload-dir` measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.plan.hardware import GIB, Hardware
from fivefold.plan.layout import tier

CHUNK_NUMEL = 1 << 20  # parallel/nvme.py's chunk (this module imports no torch)
STAGING_BYTES = 2 * 3 * CHUNK_NUMEL * 4  # its two staging slots of three fp32 states
@dataclass(frozen=True)
class NvmeStates:
    """Per rank: bytes moved off the GPU, off host memory (into files), and the staging."""

    off_gpu: float  # master + moments no longer in GPU memory (as under CPU offload)
    disk: float  # the same bytes, in this rank's files
    host: float  # host memory it still takes: the staging slots


def nvme_states(cpu_bytes: float) -> NvmeStates:
    """From the host bytes CPU offload books for the same layout (`ModelStates.cpu`):
    they go to disk instead."""
    staging = 2 * 3 * CHUNK_NUMEL * 4
    return NvmeStates(off_gpu=cpu_bytes, disk=cpu_bytes,
                      host=min(staging, 2 * cpu_bytes))  # slots of up to 12 B/value


@dataclass(frozen=True)
class TierBytes:
    """Where a rank's states are, by tier: the device's items, host bytes, disk bytes."""

    items: dict[str, float]
    host: float
    disk: float


def tier_memory(items: dict[str, float], offloaded: float, offload,
                hw: Hardware) -> TierBytes:
    """`items` and `offloaded` as memory_items gives them (the states offload moved off the
    device) placed by the layout's tier on `hw`."""
    host, disk = offloaded, 0.0
    if tier(offload) == "nvme":
        moved = nvme_states(offloaded)
        host, disk = moved.host, moved.disk
    if hw.device_is_host and host:  # the device's memory is the host's: still held
        items = {**items, "optimizer": items["optimizer"] + host}
    return TierBytes(items, host, disk)


def host_fits(host: float, hw: Hardware) -> bool:
    """Whether a rank's host bytes fit `hw.host_memory_gib` (always, where not modelled)."""
    return hw.device_is_host or hw.host_memory_gib <= 0 or host <= hw.host_memory_gib * GIB


@dataclass(frozen=True)
class NvmeTime:
    io: float  # seconds of disk traffic per step (read + write every offloaded byte)
    update: float  # the optimizer step the I/O overlaps with
    exposed: float  # max(0, io - update): what the step waits for the disk

    @property
    def step(self) -> float:
        return self.update + self.exposed


def nvme_time(disk_bytes: float, update_s: float, hw: Hardware) -> NvmeTime:
    """The optimizer step with its states streamed from disk, overlapped chunk by chunk."""
    io = 2 * disk_bytes / (hw.nvme_gbps * 1e9)
    return NvmeTime(io=io, update=update_s, exposed=max(0.0, io - update_s))


def describe_nvme(disk: float, host: float, t: NvmeTime, hw: Hardware) -> str:
    """The line `fivefold plan --config` adds for a config with offload = "nvme"."""
    where = ("the profile's measured disk" if hw.profile and hw.profile.get("nvme_gbps")
             else "--hw nvme_gbps=...")
    return (f"NVMe tier (parallel.offload = nvme): {disk / GIB:.2f} GiB per GPU of "
            f"master and optimizer states on disk instead of host memory (host keeps "
            f"{host / 2**20:.0f} MiB of staging); per step {t.io:.3f} s of I/O at "
            f"{hw.nvme_gbps:g} GB/s ({where}) beside a {t.update:.3f} s update: "
            f"the step waits {t.exposed:.3f} s more than with offload = cpu")
