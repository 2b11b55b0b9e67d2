"""Accelerator catalog and the modelling assumptions the planner's clock runs on.

Every figure is a default: `get_hardware(name, {"memory_gib": 94, ...})` overrides any field
of `Hardware` or `Assumptions` by name. Peaks are *dense* (no 2:4 sparsity) vendor figures;
bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the node it sits in."""

    name: str
    memory_gib: float  # usable HBM as the driver reports it (nvidia-smi total / 1024)
    bf16_tflops: float  # dense bf16/fp16 tensor-core peak
    fp8_tflops: float  # dense fp8 peak; 0 where the device has none
    fp32_tflops: float  # non-tensor-core fp32 peak (what plain fp32 training gets)
    hbm_tbps: float  # HBM bandwidth, TB/s
    intra_node_gbps: float  # NVLink / xGMI per GPU, one direction
    inter_node_gbps: float  # NIC bandwidth per GPU, one direction (8×400 Gb/s → 50)
    gpus_per_node: int = 8
    # Nodes under one leaf switch (one rail group): a group spread over more crosses the
    # spine (plan/network.py). DGX SuperPOD's scalable unit: 32 nodes per leaf group
    # (NVIDIA DGX SuperPOD reference architecture, H100). 0: a single switch tier.
    leaf_nodes: int = 32
    host_link_gbps: float = 32.0  # PCIe to the host, one direction (offload traffic)
    # NVMe per GPU (offload = "nvme"): one PCIe Gen4 x4 drive per GPU, its slower sequential
    # rate (writes): e.g. Samsung PM1733 data sheet, 7.0 GB/s read, 3.8 GB/s write. Override
    # with --hw nvme_gbps=..., or measure the disk: `fivefold calibrate --offload-dir DIR`
    # writes the rate into the profile, and --hw-profile sets this field from it.
    nvme_gbps: float = 3.8
    # Host memory per GPU that offloaded states may take (0: not modelled); auto layout sets
    # it from the machine's available memory, so CPU offload of states larger than the host
    # does not fit and NVMe offload (staging slots in host memory) may (plan/nvme.py).
    host_memory_gib: float = 0.0
    # The device is the CPU (a CPU run): its memory is the host's, so CPU offload moves
    # nothing off it and NVMe offload's staging slots stay in it (plan/nvme.py).
    device_is_host: bool = False
    # Share of the bf16 peak that large GEMMs reach on this part (cuBLAS/hipBLASLt measured
    # figures are 0.7-0.85 for 8k×8k×8k bf16; end-to-end training sees less).
    matmul_efficiency: float = 0.75
    # A measured profile (`fivefold calibrate`, read by --hw-profile): matmul and attention
    # throughput by shape and bus bandwidth per collective and group size; None: the peaks.
    profile: dict | None = field(default=None, compare=False, repr=False)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for the precision the GEMMs run in."""
        tflops = {"fp32": self.fp32_tflops, "bf16": self.bf16_tflops, "fp16": self.bf16_tflops,
                  "fp8": self.fp8_tflops}[precision]
        if tflops <= 0:
            raise ConfigError(f"{self.name} has no {precision} tensor cores; pick another "
                              f"precision or override with --hw {precision}_tflops=...")
        return tflops * 1e12


@dataclass(frozen=True)
class Assumptions:
    """How achieved speed relates to the peaks. Defaults are deliberately plain; override them
    when a measurement says otherwise (each is a field name `--hw` accepts)."""

    attention_efficiency: float = 0.60  # flash attention vs. the GEMM efficiency
    # Kernel launches, synchronisation, data loading, stragglers: a share added to compute.
    compute_overhead: float = 0.10
    bandwidth_efficiency: float = 0.80  # NCCL bus bandwidth / link bandwidth
    hbm_efficiency: float = 0.80  # elementwise kernels and the optimizer step vs. HBM peak
    # Latency of a collective (plan/network.py), NCCL's own model's figures for large
    # messages (its Simple protocol; NVIDIA/nccl src/graph/tuning.cc baseLat, hwLat): a
    # fixed time per call, and per ring step over NVLink and over the network.
    base_latency_us: float = 8.4  # per call
    intra_latency_us: float = 3.4  # per collective step inside a node
    inter_latency_us: float = 9.6  # per collective step across nodes
    cpu_adam_gbps: float = 100.0  # host memory bandwidth per node for an offloaded step
    tp_overlap: float = 0.0  # share of TP/SP communication hidden behind GEMMs (async TP)
    context_gib: float = 1.5  # CUDA context, cuBLAS workspace, NCCL buffers
    # Reserved beyond the allocator model (allocator.allocator_waste), as a share of allocated.
    fragmentation: float = 0.0
    # Reserved beyond the allocator model per byte of saved activations, and per byte of the
    # loss's logits buffers (fitted per engine: plan/conventions.py; 0 for the engine itself).
    activation_reserve: float = 0.0
    loss_reserve: float = 0.0
    # ... and bytes per token per hidden unit on the head's rank, whatever tp is: cache that
    # holds no tensor, given back where it passes the rank's limit (allocator.released_cache).
    head_token_bytes: float = 0.0
    # Host time per layer per micro-batch (forward + backward, ms): an eager engine's Python
    # and kernel launches, which the GPU hides only when its own work takes longer.
    host_layer_ms: float = 0.0
    # Fixed time per pipeline send or receive (ms), exposed: an engine whose point-to-point
    # calls block and exchange metadata first waits this long per message beyond the bytes.
    pp_message_ms: float = 0.0
    # Share of a node's NICs a group that crosses nodes uses beyond one per GPU: 0 counts one
    # NIC per GPU (the default), 1 every member's NIC in the node (NCCL's rail-optimised
    # rings and trees over one NIC per GPU; plan/timing.py rail_gbps).
    inter_node_rails: float = 0.0
    # GiB a run needs free beyond the planned peak reserved + context to survive (fitted per
    # engine: what the planner does not trace, e.g. NCCL's lazily created communicators and
    # point-to-point buffers, the spread of fragmentation between ranks). 0: the engine's own.
    memory_headroom_gib: float = 0.0
    # Uplinks of a leaf switch per downlink, inverted: a group crossing the spine gets
    # 1/spine_oversubscription of its nodes' NIC bandwidth (1: non-blocking fat tree, as
    # DGX SuperPOD's; plan/network.py spine_share).
    spine_oversubscription: float = 1.0
    # Latency a ring step adds when it crosses the spine (µs): two more switch hops, and the
    # queues of every group crossing at once.
    spine_latency_us: float = 0.0
    # Spread per ring step of a TP collective of the host's wait while the pipeline engine
    # holds it on its point-to-point messages (pp > 1): each step waits
    # pp_blocking_latency_us·√(2 ln N) for the slowest of N ranks, host time
    # (plan/network.py blocked_host_s; fitted per engine, 0 for the engine itself, whose
    # pipeline posts its messages without waiting on them).
    pp_blocking_latency_us: float = 0.0
    # Spread of a rank's step time (its relative standard deviation): the step waits for
    # the slowest of N ranks, E[max] ≈ mean·(1 + σ·√(2 ln N)) for N normal times (the
    # extreme value of N Gaussians; e.g. Cramér 1946 §28.6). 0: every rank alike.
    straggler_sigma: float = 0.0
    # Time a TP call's ring step between nodes takes beyond the network's hop latency (µs):
    # a TP group that spans k nodes pays it on k − 1 steps of each all-gather or
    # reduce-scatter (2(k − 1) of an all-reduce), every call on the critical path
    # (plan/network.py hop_latency_s; fitted per engine, 0 for the engine itself).
    tp_inter_step_us: float = 0.0
    # Host time each pipeline send or receive of a rank takes when ZeRO-0 runs data
    # parallel under DDP (dp > 1, pp > 1), in ms, on every micro-batch's critical path: an
    # engine whose pipeline passes one blocking message at a time pays it 2 times per
    # micro-batch on its first and last stage, 4 times in between (plan/network.py
    # call_time; fitted per engine, 0 for the engine itself).
    ddp_pp_message_ms: float = 0.0
    price_per_gpu_hour: float = 0.0  # for the whole-run cost (--tokens); 0: not priced


# Sources: NVIDIA A100/H100/H200/B200/L40S and AMD MI300X/MI325X data sheets (dense peaks);
# node networks as in DGX A100 (8×200 Gb/s), DGX H100/H200/B200 (8×400 Gb/s).
CATALOG: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", 40, 312, 0, 19.5, 1.555, 300, 25, host_link_gbps=25,
                          matmul_efficiency=0.80),
    "a100-80gb": Hardware("a100-80gb", 80, 312, 0, 19.5, 2.039, 300, 25, host_link_gbps=25,
                          matmul_efficiency=0.80),
    "h100-sxm": Hardware("h100-sxm", 80, 989.4, 1978.9, 67, 3.35, 450, 50, host_link_gbps=50,
                         matmul_efficiency=0.70),
    "h100-pcie": Hardware("h100-pcie", 80, 756.5, 1513, 51, 2.0, 50, 25, host_link_gbps=50,
                          matmul_efficiency=0.70),
    "h200": Hardware("h200", 140, 989.4, 1978.9, 67, 4.8, 450, 50, host_link_gbps=50,
                     matmul_efficiency=0.70),
    "b200": Hardware("b200", 179, 2250, 4500, 75, 8.0, 900, 50, host_link_gbps=50,
                     matmul_efficiency=0.70),
    "mi300x": Hardware("mi300x", 192, 1307.4, 2614.9, 163.4, 5.3, 448, 50, host_link_gbps=50,
                       matmul_efficiency=0.60),
    "mi325x": Hardware("mi325x", 256, 1307.4, 2614.9, 163.4, 6.0, 448, 50, host_link_gbps=50,
                       matmul_efficiency=0.60),
    "l40s": Hardware("l40s", 48, 362, 733, 91.6, 0.864, 25, 12.5, host_link_gbps=25,
                     matmul_efficiency=0.70),
}
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "mi300": "mi300x"}

_HW_FIELDS = {f.name: f for f in dataclasses.fields(Hardware)
              if f.name not in ("profile", "device_is_host")}
_ASSUME_FIELDS = {f.name: f for f in dataclasses.fields(Assumptions)}


def _coerce(key: str, value, typ):
    try:
        if typ in (int, "int"):
            return int(value)
        if typ in (float, "float"):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--hw {key}={value!r} is not a number; give e.g. {key}=80") from None
    return value


# --hw values that may be 0 (a device without fp8, no latency, no overhead), and shares.
_MAY_BE_ZERO = ("fp8_tflops", "compute_overhead", "intra_latency_us", "inter_latency_us",
                "base_latency_us",
                "context_gib", "tp_overlap", "fragmentation", "price_per_gpu_hour",
                "activation_reserve", "loss_reserve", "head_token_bytes", "host_layer_ms",
                "pp_message_ms", "host_memory_gib", "inter_node_rails", "memory_headroom_gib",
                "leaf_nodes", "spine_latency_us", "straggler_sigma", "pp_blocking_latency_us",
                "tp_inter_step_us", "ddp_pp_message_ms")
_AT_MOST_ONE = ("tp_overlap", "inter_node_rails")


def _check_range(key: str, value: float) -> None:
    """Finite, and in range: an efficiency in (0, 1], a share in [0, 1], others > 0 (or >= 0
    where zero means "none"). nan would make everything fit; 0 would divide by zero."""
    low_ok = value >= 0 if key in _MAY_BE_ZERO else value > 0
    if key.endswith("_efficiency"):
        ok, want = 0 < value <= 1, "in (0, 1]"
    elif key in _AT_MOST_ONE:
        ok, want = 0 <= value <= 1, "in [0, 1]"
    elif key == "fragmentation":
        ok, want = 0 <= value < 1, "in [0, 1)"
    elif key == "gpus_per_node":
        ok, want = value >= 1, ">= 1"
    elif key == "spine_oversubscription":
        ok, want = value >= 1, ">= 1 (uplinks never exceed downlinks' share)"
    else:
        ok, want = low_ok, ">= 0" if key in _MAY_BE_ZERO else "> 0"
    if not (math.isfinite(value) and ok):
        raise ConfigError(f"--hw {key}={value:g} must be a finite number {want}")


def get_hardware(name: str, overrides: dict | None = None) -> tuple[Hardware, Assumptions]:
    """The catalog entry `name` (or an alias) with `overrides` applied to either dataclass."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in CATALOG:
        close = difflib.get_close_matches(key, list(CATALOG) + list(ALIASES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown GPU '{name}'{hint}; known: {', '.join(CATALOG)}")
    hw, assume = CATALOG[key], Assumptions()
    hw_changes, assume_changes = {}, {}
    for k, v in (overrides or {}).items():
        if k in _HW_FIELDS and k != "name":
            hw_changes[k] = _coerce(k, v, _HW_FIELDS[k].type)
        elif k in _ASSUME_FIELDS:
            assume_changes[k] = _coerce(k, v, _ASSUME_FIELDS[k].type)
        else:
            names = [n for n in _HW_FIELDS if n != "name"] + list(_ASSUME_FIELDS)
            close = difflib.get_close_matches(k, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"--hw {k}: unknown hardware field{hint}; fields: "
                              f"{', '.join(names)}")
    for k, v in {**hw_changes, **assume_changes}.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _check_range(k, v)
    hw = dataclasses.replace(hw, **hw_changes)
    assume = dataclasses.replace(assume, **assume_changes)
    check_memory_budget(hw, assume)
    return hw, assume


def check_memory_budget(hw: Hardware, assume: Assumptions) -> None:
    """The device's memory less the CUDA context and the headroom must leave something to
    plan into: otherwise every layout's budget is negative and the plan could only say that
    nothing fits, whatever the layout."""
    left = hw.memory_gib - assume.context_gib - assume.memory_headroom_gib
    if not left > 0:
        raise ConfigError(f"--hw: memory_gib {hw.memory_gib:g} less context_gib "
                          f"{assume.context_gib:g} and memory_headroom_gib "
                          f"{assume.memory_headroom_gib:g} leaves {left:g} GiB to plan; it "
                          f"must stay > 0")


def parse_overrides(items: list[str]) -> dict:
    """['memory_gib=94', 'inter_node_gbps=100'] → dict; also accepts comma-joined items."""
    out = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"--hw {part!r} needs the form key=value, e.g. memory_gib=94")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def usable_memory(hw: Hardware, assume: Assumptions) -> float:
    """Bytes the plan's most loaded rank may fill (reserved + context): the device's memory
    less the headroom the engine's unplanned allocations need."""
    return hw.memory_bytes - assume.memory_headroom_gib * GIB


def group_bandwidth(hw: Hardware, group_size: int, stride: int) -> tuple[float, bool]:
    """Bytes/s per GPU for a group of `group_size` ranks spaced `stride` apart in the rank grid,
    and whether it crosses nodes: a group stays inside a node when stride·size ≤ GPUs per
    node (the stride comes from the rank order, `Layout.stride`)."""
    inside = stride * group_size <= hw.gpus_per_node
    gbps = hw.intra_node_gbps if inside else hw.inter_node_gbps
    return gbps * 1e9, not inside


def hardware_for_device_name(device_name: str) -> Hardware | None:
    """The catalog entry for a name as `torch.cuda.get_device_name` reports it
    ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "AMD Instinct MI300X", ...)."""
    name = device_name.lower().replace("-", " ")
    for key, words in (("h100-pcie", ("h100", "pcie")), ("h100-sxm", ("h100",)),
                       ("h200", ("h200",)), ("b200", ("b200",)),
                       ("a100-40gb", ("a100", "40gb")), ("a100-80gb", ("a100",)),
                       ("mi325x", ("mi325",)), ("mi300x", ("mi300",)), ("l40s", ("l40s",))):
        if all(w in name for w in words):
            return CATALOG[key]
    return None


def peak_for_device_name(device_name: str, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a named device, or None when the catalog does not know it."""
    hw = hardware_for_device_name(device_name)
    return hw.peak_flops(precision) if hw else None


PROFILE_KEYS = ("matmul", "attention", "bus_gbps")


def load_profile(path: str | Path) -> dict:
    """A profile written by `fivefold calibrate` (one-line error if it is not one)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--hw-profile {p} does not exist; write one with fivefold calibrate")
    try:
        profile = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--hw-profile {p} is not valid JSON ({e})") from None
    missing = [k for k in PROFILE_KEYS if k not in profile]
    if missing or not profile["matmul"]:
        raise ConfigError(f"--hw-profile {p} has no {(missing or ['matmul'])[0]}; write it "
                          f"with fivefold calibrate")
    disk = profile.get("nvme_gbps")  # absent in profiles of no disk (or written before)
    if disk is not None and not (isinstance(disk, (int, float)) and math.isfinite(disk)
                                 and disk > 0):
        raise ConfigError(f"--hw-profile {p}: nvme_gbps = {disk!r} is not a positive rate; "
                          f"measure the disk again with fivefold calibrate --offload-dir DIR")
    return profile


def with_profile(hw: Hardware, profile: dict | None, overridden: tuple = ()) -> Hardware:
    """`hw` with a calibrate profile's measured speeds: the profile itself (matmul,
    attention, collectives, read where the clock asks) and the disk's rate, `nvme_gbps`,
    where the profile measured one and `--hw nvme_gbps=` (in `overridden`) did not set it."""
    changes: dict = {"profile": profile}
    if profile and profile.get("nvme_gbps") and "nvme_gbps" not in overridden:
        changes["nvme_gbps"] = float(profile["nvme_gbps"])
    return dataclasses.replace(hw, **changes)


def measured_disk(hw: Hardware) -> bool:
    """Whether `hw.nvme_gbps` is a rate measured here (a profile's), not the data sheet's."""
    return bool(hw.profile and hw.profile.get("nvme_gbps"))


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise log-log interpolation, flat beyond the measured ends."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def profile_matmul_rate(hw: Hardware, thin: float) -> float | None:
    """Measured FLOP/s of a GEMM whose thinnest side is `thin` (None without a profile)."""
    if not hw.profile:
        return None
    return _interpolate([(m["thin"], m["flops_per_s"]) for m in hw.profile["matmul"]], thin)


def profile_attention_rate(hw: Hardware, seq_len: float) -> float | None:
    if not hw.profile or not hw.profile.get("attention"):
        return None
    return _interpolate([(a["seq_len"], a["flops_per_s"]) for a in hw.profile["attention"]],
                        seq_len)


def _nearest(by_size: dict, group_size: int):
    """The value measured at the group size nearest `group_size` (log scale; the smaller of
    two equally near), None when nothing was measured."""
    sizes = {int(n): v for n, v in (by_size or {}).items()}
    if not sizes:
        return None
    return sizes[min(sizes, key=lambda n: (abs(math.log(n / group_size)), n))]


def profile_host_layer_ms(hw: Hardware) -> float | None:
    """Measured host time per layer per micro-batch (ms, forward and backward), None without
    a profile that took it (calibrate's `host_layer_ms`)."""
    ms = (hw.profile or {}).get("host_layer_ms")
    return float(ms) if isinstance(ms, (int, float)) and math.isfinite(ms) and ms >= 0 else None


def runs_on_host(hw: Hardware) -> bool:
    """Whether the device computes on the host's cores (a CPU run, or a CPU's profile)."""
    return hw.device_is_host or (hw.profile or {}).get("device") == "cpu"


def profile_latency_s(hw: Hardware, group_size: int) -> float | None:
    """Measured seconds of one collective call (a one-element all-reduce) at the nearest
    measured group size; None without a profile or one written before calibrate took it."""
    us = _nearest((hw.profile or {}).get("latency_us"), group_size)
    return None if us is None else us * 1e-6


def profile_bus_gbps(hw: Hardware, op: str, group_size: int) -> float | None:
    """Measured bus bandwidth (GB/s) of `op` at the nearest measured group size."""
    if not hw.profile:
        return None
    key = "send_recv" if op in ("send", "recv") else op
    return _nearest(hw.profile["bus_gbps"].get(key), group_size)


def profile_call_s(hw: Hardware, op: str, group_size: int, nbytes: float) -> float | None:
    """Measured seconds of one call of `op` moving `nbytes` (the ledger's bytes of a call)
    at the nearest measured group size: linear in bytes between the sizes calibrate swept
    (a call's time is latency plus bytes over bandwidth, both varying with the size), the
    smallest size's time below them, the largest size's bandwidth above. None without a
    profile's `call_us` (one written before calibrate swept sizes)."""
    key = "send_recv" if op in ("send", "recv") else op
    points = _nearest(((hw.profile or {}).get("call_us") or {}).get(key), group_size)
    if not points:
        return None
    points = sorted((float(b), float(us) * 1e-6) for b, us in points)
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    b, t = points[-1]
    return t * nbytes / b
