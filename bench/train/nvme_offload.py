"""Step time with the optimizer states resident, on the CPU, and on disk (parallel.offload).

One process, ZeRO-1, llama-25m (examples/bench-25m.toml) in fp32, the same steps for
offload = none, cpu and nvme in this process, their steps interleaved: the median step
time of each and its ratio to none, and for nvme the time the step waited for its I/O
thread (reads not yet done when an update wanted them, the last writes) as a share of the
step. The files go through the OS
page cache (no O_DIRECT), so on a machine with free memory the "disk" may be memory: the
results record where offload_dir was and a plain write+read of the same bytes with fsync,
timed, to show what the disk itself does.

    python bench/train/nvme_offload.py [--steps 4] [--offload-dir DIR]

Writes bench/results/nvme_offload.json with the machine, versions and git revision.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fivefold import config as fconfig
from fivefold.train.bench import git_revision, machine
from fivefold.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def config(tmp: str, offload: str, offload_dir: str) -> fconfig.Config:
    return fconfig.load(ROOT / "examples" / "bench-25m.toml", [
        "--train.steps", "1000", "--train.eval_every", "0", "--train.precision", "fp32",
        "--train.device", "cpu", "--checkpoint.dir", f"{tmp}/ckpt", "--checkpoint.every", "0",
        "--log.dir", f"{tmp}/log", "--log.progress", "false", "--log.tensorboard", "false",
        "--parallel.zero", "1", "--parallel.offload", offload,
        "--parallel.offload_dir", offload_dir])


def run_all(steps: int, offload_dir: str) -> list[dict]:
    """The three runs side by side, their steps interleaved (none, cpu, nvme, none, ...), so
    that other work on a shared machine slows each of them alike."""
    offloads = ("none", "cpu", "nvme")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        trainers = [stack.enter_context(Trainer(config(f"{tmp}/{o}", o, offload_dir),
                                                quiet=True)) for o in offloads]
        for t in trainers:
            t.train_step()  # warm-up: allocations, first reads
        times = {o: [] for o in offloads}
        waits = {o: [] for o in offloads}
        for _ in range(steps):
            for o, t in zip(offloads, trainers):
                store = getattr(t.optimizer.optimizer, "store", None)
                if store is not None:
                    store.wait_s = 0.0
                start = time.perf_counter()
                t.train_step()
                times[o].append(time.perf_counter() - start)
                waits[o].append(store.wait_s if store is not None else 0.0)
        rows = []
        for o, t in zip(offloads, trainers):
            memory = t.optimizer.memory_bytes()
            shard = t.optimizer.layout.total // t.optimizer.layout.shards
            rows.append({
                "offload": o, "step_s_median": statistics.median(times[o]),
                "step_s": times[o], "io_wait_s_median": statistics.median(waits[o]),
                "io_wait_share": statistics.median(w / s for w, s in zip(waits[o], times[o])),
                "resident_master_mib": memory["master"] / MIB,
                "resident_optimizer_mib": memory["optimizer"] / MIB,
                "disk_mib": 12 * shard / MIB if o == "nvme" else 0.0})
    return rows


def disk_rate(offload_dir: str, nbytes: int) -> dict:
    """A plain write (fsync) and read of `nbytes` in 4 MiB pieces: GB/s each way."""
    Path(offload_dir).mkdir(parents=True, exist_ok=True)
    path = Path(offload_dir) / f"rate-probe-{os.getpid()}"
    piece = os.urandom(4 * MIB)
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(nbytes // len(piece)):
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        write = time.perf_counter() - start
        start = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(len(piece)):
                pass
        read = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": nbytes, "write_gbps_fsync": nbytes / write / 1e9,
            "read_gbps_page_cache_likely": nbytes / read / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--offload-dir", default=None,
                    help="where the nvme files go (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as default_dir:
        offload_dir = args.offload_dir or default_dir
        rows = run_all(args.steps, offload_dir)
        rate = disk_rate(offload_dir, 256 * MIB)
    base = rows[0]["step_s_median"]
    for r in rows:
        r["time_vs_none"] = r["step_s_median"] / base
    print("llama-25m, ZeRO-1, one process, fp32, 1 thread:")
    print(f"{'offload':<8} {'step s':>7} {'vs none':>7} {'io wait':>8} {'share':>6} "
          f"{'master MiB':>10} {'optim MiB':>9} {'disk MiB':>8}")
    for r in rows:
        print(f"{r['offload']:<8} {r['step_s_median']:>7.3f} {r['time_vs_none']:>7.2f} "
              f"{r['io_wait_s_median']:>8.3f} {r['io_wait_share']:>6.1%} "
              f"{r['resident_master_mib']:>10.1f} {r['resident_optimizer_mib']:>9.1f} "
              f"{r['disk_mib']:>8.1f}")
    print(f"offload_dir's file system: write {rate['write_gbps_fsync']:.2f} GB/s (fsync), "
          f"read {rate['read_gbps_page_cache_likely']:.2f} GB/s (likely the page cache)")
    result = {"machine": machine(torch.device("cpu")), "git_revision": git_revision(),
              "offload_dir": args.offload_dir or "a tempfile.TemporaryDirectory",
              "steps": args.steps, "rows": rows, "disk_rate": rate}
    out = ROOT / "bench" / "results" / "nvme_offload.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
