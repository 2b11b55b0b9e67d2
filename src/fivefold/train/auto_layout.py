"""`fivefold train --parallel.layout auto`: what the engine tells the planner (ranks launched,
device, precision, memory per rank, hardware profile, the layout a resumed run started with),
and the check that every rank took the same choice. The choice is plan/auto_layout.py's.

Every rank chooses on its own, before any process group exists (a bad input is one line and
exit 2, nothing written); the search is deterministic, so ranks agree when their inputs do.
Free memory is the one input that differs between ranks: it is rounded down to 1/8 GiB, and
after the process group is up `check_agreement` compares the choices (a mismatch is one line
asking for train.memory_budget_gib).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import torch

from fivefold.config import Config, ConfigError, RunError, validate_layout
from fivefold.plan import auto_layout as planner
from fivefold.plan.hardware import hardware_for_device_name, load_profile
from fivefold.train.precision import resolve_precision
from fivefold.train.rundir import available_memory_bytes

ROUND_GIB = 1 / 8  # free memory is rounded down to this, so ranks see the same budget


def _device(cfg: Config) -> torch.device:
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def memory_budget(cfg: Config, device: torch.device, local_ranks: int) -> tuple[float, str]:
    """(GiB per rank, where it comes from): train.memory_budget_gib, or the device's free
    memory (a CPU's available memory shared by the ranks on this machine)."""
    if cfg.train.memory_budget_gib > 0:
        return cfg.train.memory_budget_gib, "train.memory_budget_gib"
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        source = "free device memory"
    else:
        free = (available_memory_bytes() or 0) / max(local_ranks, 1)
        source = f"available memory / {local_ranks} local rank(s)"
    gib = math.floor(free / 2**30 / ROUND_GIB) * ROUND_GIB
    if gib <= 0:
        raise ConfigError(f"parallel.layout = 'auto' found no free memory to plan for ({source})"
                          f"; set train.memory_budget_gib, the GiB each rank may hold")
    return gib, source


def host_memory_gib(local_ranks: int) -> float:
    """On a GPU machine: the host memory per local rank that CPU-offloaded states may take
    (available memory over the ranks, rounded down to whole GiB so ranks reading it a moment
    apart agree); 0 (not modelled) where the platform does not say."""
    free = available_memory_bytes()
    return float(math.floor(free / 2**30 / max(local_ranks, 1))) if free else 0.0


def disk_elsewhere(profile: dict | None, offload_dir: str) -> str:
    """A note when the profile measured a disk on another file system than the run's
    parallel.offload_dir (its rate then says little of the run's)."""
    measured = (profile or {}).get("disk", {}).get("dir")
    if not measured or not offload_dir:
        return ""

    def device(path: str) -> int | None:
        target = Path(path).absolute()
        while not target.exists() and target != target.parent:
            target = target.parent
        try:
            return target.stat().st_dev
        except OSError:
            return None

    if device(measured) == device(offload_dir):
        return ""
    return (f"note: the profile measured the disk under {measured}, on another file system "
            f"than parallel.offload_dir = {offload_dir}; NVMe offload is timed at its rate: "
            f"`fivefold calibrate --offload-dir {offload_dir}` measures the run's")


def _saved_record(cfg: Config) -> dict | None:
    """The auto record of the checkpoint a resume would start from (None: fresh, or a run
    that did not choose with auto). Only read here; the trainer checks the checkpoint."""
    from fivefold.train import checkpoint as ckpt

    if cfg.checkpoint.resume in ("", "never"):
        return None
    try:
        path = ckpt.resolve(cfg.checkpoint.dir, cfg.checkpoint.resume)
        meta = json.loads((path / "meta.json").read_text()) if path else None
    except (OSError, ValueError, ConfigError):
        return None
    return meta.get("auto_layout") if isinstance(meta, dict) else None


def resolve(cfg: Config, hw_profile: str | None, first_rank: bool) -> Config:
    """The config with the planner's layout for the launched ranks, printed on the first
    rank with the runner-up; `cfg.auto_layout` holds the record the checkpoints keep."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    device = _device(cfg)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no GPU is visible; use 'cpu' or 'auto'")
    precision = resolve_precision(cfg.train.precision, device)
    budget, source = memory_budget(cfg, device, local)
    profile = load_profile(hw_profile) if hw_profile else None
    on_cpu = device.type == "cpu"
    base = None if on_cpu else hardware_for_device_name(torch.cuda.get_device_name(device))
    hw, assume = planner.auto_hardware(base, local, budget, profile, on_cpu,
                                       0.0 if on_cpu else host_memory_gib(local))
    words = f"the profile {hw_profile}" if profile else f"the catalog's {hw.name}"
    notes = [note for note in [disk_elsewhere(profile, cfg.parallel.offload_dir)] if note]
    if on_cpu and not profile:
        notes.append(f"note: no --hw-profile: layouts are ranked with the catalog's {hw.name} "
                     f"speeds, not this CPU's; `fivefold calibrate --out profile.json` "
                     f"measures them")
    # on a CPU the ranks of this machine share its cores (planner.shared_cores_time)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    cores = cores if on_cpu else 0
    saved = _saved_record(cfg)
    if saved is not None:
        plan, why = planner.kept(cfg, saved, world, hw, assume, precision)
        if plan is not None:
            pick = planner.AutoPick(plan, None, world, budget, source, words, 1,
                                    cores if 0 < cores < local else 0)
            notes.append(f"auto layout: resuming with the layout the run started with, "
                         f"{plan.layout.short()} (predicted step {pick.step_time(plan):.4g} s, "
                         f"peak {plan.memory_total / 2**30:.3g} GiB)")
            return _finish(cfg, pick, saved, notes, first_rank)
        notes.append(f"auto layout: the run started with {saved.get('chosen', {}).get('layout')}"
                     f" and chooses again: {why}")
    pick = planner.choose(cfg, world, hw, assume, precision, source, words, on_cpu, cores)
    return _finish(cfg, pick, planner.record(pick), notes + planner.describe(pick), first_rank)


def _finish(cfg: Config, pick, record: dict, lines: list[str], first_rank: bool) -> Config:
    out = planner.apply(cfg, pick.best, pick.budget_gib)
    validate_layout(out)  # the engine's own checks, as for a layout set by hand
    out.auto_layout = record
    if first_rank:
        for line in lines:
            print(line, flush=True)
    return out


def check_agreement(cfg: Config) -> None:
    """After the process group is up: every rank chose the same layout, or a one-line stop."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    key = json.dumps(cfg.auto_layout.get("fields"), sort_keys=True) + cfg.parallel.grad_sync
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([zlib.crc32(key.encode())], dtype=torch.float64, device=device)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low.item() != high.item():
        raise RunError("parallel.layout = 'auto': the ranks chose different layouts (their "
                       "free memory differed); set train.memory_budget_gib so all plan for "
                       "the same budget")
