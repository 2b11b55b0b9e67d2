"""`fivefold calibrate`: measure this machine for the planner and write a hardware profile.

    fivefold calibrate --out profile.json            # GPUs if present, else CPU/gloo
    fivefold calibrate --out p.json --quick --world 2  # tiny shapes (what CI runs)
    fivefold calibrate --out p.json --offload-dir /nvme/offload  # and the disk under it
    fivefold plan --model llama-3.1-8b --hw-profile profile.json ...

Measured (median of timed repeats after a warm-up):
- matmul throughput over GEMM shapes, (tokens × h) @ (h × 4h) from small to large h, so
  the planner's GEMM efficiency becomes a function of the shape's thinnest side;
- attention throughput of `scaled_dot_product_attention` (causal) over sequence lengths;
- memory bandwidth of an elementwise add (two reads, one write of 64 MiB tensors): the rate
  of norms, activations and the optimizer step (`memory_gbps`);
- bus bandwidth of all_reduce, all_gather, reduce_scatter, all_to_all and point-to-point
  per group size, through the engine's own communication door (`parallel/comm.py`), in
  NCCL-tests' convention: algorithm bandwidth × 2(n−1)/n for all-reduce, × (n−1)/n for
  all-gather, reduce-scatter and all-to-all, × 1 for send/recv;
- the latency of one collective call per group size (`latency_us`): an all-reduce of one
  element, whose time is all start-up and synchronisation. On a CPU whose ranks outnumber
  its cores it includes waiting for a descheduled peer, which small bandwidth-bound messages
  do not show and which a tensor-parallel step pays at every one of its collectives;
- the host time per layer (`host_layer_ms`): one micro-batch's forward and backward through
  the engine's own block at a width whose kernels do next to no arithmetic, per layer
  added; on a CPU, whose cores run that Python and dispatch between the kernels, it adds
  to every layer of every micro-batch, and small micro-batches pay it most often;
- the time of one call of each collective per group size over a sweep of message sizes,
  4 KiB to 16 MiB and the bandwidth message (`call_us`: [[bytes, µs], ...] in the ledger's
  convention of a call's bytes), as NCCL-tests sweeps them: between the one-element latency
  and the large-message bandwidth lies a range where neither alone gives a call's time
  (gloo's 512 KiB all-reduce over 4 CPU ranks takes several times what latency plus
  bytes over the 64 MiB bandwidth say), and a tensor-parallel step's activations live
  there;
- with `--offload-dir DIR` (the `parallel.offload_dir` NVMe offload would write), the disk:
  one file of `--disk-mib` MiB (256 by default) written sequentially in the engine's chunks
  (parallel/nvme.py: 4 MiB of fp32 values), then fsync'ed, the fsync inside the timing, so
  the page cache cannot pass memory speed off as the disk's; then its cached pages dropped
  (posix_fadvise DONTNEED, where the platform has it: the profile says whether it ran) and
  the file read back in the same chunks. The offload step reads and writes every byte of
  the states once, one after the other on one I/O thread, so the rate the planner uses is
  what that costs, 2 bytes over (1/read + 1/write): `nvme_gbps`. A run whose states fit in
  the page cache may see faster writes than this sustained rate (its writes are not
  fsync'ed); the states NVMe offload exists for do not fit there. On tmpfs the "disk" is
  memory, and the profile names the file system so that it shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from fivefold.config import ArgumentParser, ConfigError
from fivefold.config.rules import writable_dir, writable_file
from fivefold.host import cpu_label, cpu_model

# Message sizes of the call-time sweep (bytes; the bandwidth message is added to them).
SWEEP_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 24)
QUICK_SWEEP = (1 << 10, 1 << 13)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "send_recv": lambda n: 1.0}


def _timed(fn, sync, min_s: float, repeats: int = 5, inner: int | None = None) -> float:
    """Median seconds of one call of fn (calls are batched to last at least min_s / repeats,
    or `inner` calls per sample: collectives need the same count on every rank)."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - start, 1e-7)
    inner = inner or max(1, int(min_s / repeats / one))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def measure_memory(device: str, quick: bool, sync) -> float:
    """GB/s of `out = a + b` (12 bytes moved per fp32 element: two reads and a write)."""
    import torch

    elems = (1 << 16) if quick else (1 << 24)
    a, b, out = (torch.ones(elems, device=device) for _ in range(3))
    t = _timed(lambda: torch.add(a, b, out=out), sync, 0.05 if quick else 0.5)
    return 12 * elems / t / 1e9


def measure_compute(device: str, quick: bool, max_hidden: int = 8192) -> dict:
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    min_s = 0.05 if quick else 0.5
    tokens = 128 if quick else 4096
    hiddens = (32, 64, 128) if quick else tuple(
        h for h in (128, 256, 512, 1024, 2048, 4096, 8192) if h <= max_hidden)
    matmul = []
    for h in hiddens:
        progress(f"matmul ({tokens} x {h}) @ ({h} x {4 * h})")
        a = torch.randn(tokens, h, device=device, dtype=dtype)
        b = torch.randn(h, 4 * h, device=device, dtype=dtype)
        t = _timed(lambda a=a, b=b: a @ b, sync, min_s)
        matmul.append({"m": tokens, "k": h, "n": 4 * h, "thin": min(tokens, h),
                       "flops_per_s": 2 * tokens * h * 4 * h / t})
    attention = []
    heads, dim = (2, 16) if quick else (16, 128)
    for s in ((64, 128) if quick else tuple(n for n in (256, 512, 1024, 2048, 4096, 8192)
                                           if n <= max(1024, max_hidden))):
        progress(f"attention, {s} tokens")
        q, k, v = (torch.randn(1, heads, s, dim, device=device, dtype=dtype) for _ in range(3))
        t = _timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   sync, min_s)
        attention.append({"seq_len": s, "heads": heads, "head_dim": dim,
                          "flops_per_s": 4 * heads * s * s * dim * 0.5 / t})
    progress("memory bandwidth")
    memory = measure_memory(device, quick, sync)
    progress("host time per layer")
    return {"dtype": str(dtype).replace("torch.", ""), "matmul": matmul, "attention": attention,
            "memory_gbps": memory, "host_layer_ms": measure_host(device, quick, sync)}


def measure_host(device: str, quick: bool, sync) -> float:
    """Milliseconds of host time one transformer layer adds to a micro-batch's forward and
    backward: the engine's own block (models/llama.py) at a width so small that its kernels
    do next to no arithmetic, timed at 2 and at 2 + k layers, the difference over k. It is
    Python, autograd and dispatch (and kernel launches on a GPU): what the GEMM, attention
    and bandwidth timings leave out, and what a micro-batch pays per layer whatever its
    size."""
    import dataclasses

    import torch

    from fivefold.models.llama import Llama
    from fivefold.models.presets import preset

    def one(layers: int) -> float:
        cfg = dataclasses.replace(preset("nano"), num_layers=layers, vocab_size=64,
                                  hidden_size=64, intermediate_size=128, num_heads=2,
                                  num_kv_heads=2)
        torch.manual_seed(0)
        model = Llama(cfg).to(device)
        tokens = torch.randint(0, 64, (1, 8), device=device)
        for _ in range(3):  # warm-up
            model(tokens, tokens).backward()
        sync()
        samples = []
        for _ in range(7 if quick else 15):
            start = time.perf_counter()
            for _ in range(5):
                model(tokens, tokens).backward()
            sync()
            samples.append((time.perf_counter() - start) / 5)
        return min(samples)  # other work on the machine only adds time: the least is its own

    k = 8 if quick else 16
    base = one(2)
    return max(0.0, (one(2 + k) - base) / k * 1e3)


def progress(what: str) -> None:
    """One line on stderr as each measurement starts: a full calibration takes minutes."""
    print(f"calibrate: {what}", file=sys.stderr, flush=True)


def _collective_rank(rank: int, world: int, init_file: str, out: str, backend: str,
                     quick: bool) -> None:
    import torch
    import torch.distributed as dist

    from fivefold.parallel.comm import Group, Ledger

    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sizes = [n for n in (2, 4, 8, 16, 32, 64) if n <= world]
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # collective: every rank
    nbytes = (1 << 16) if quick else (1 << 26)
    results: dict = {op: {} for op in OPS}
    results["latency_us"] = {}
    results["call_us"] = {op: {} for op in OPS}
    for n in sizes:
        if rank < n:
            group = Group(f"calib{n}", list(range(n)), groups[n], Ledger())
            for size in (*(QUICK_SWEEP if quick else SWEEP_BYTES), nbytes):
                for op, (sent, seconds) in _measure_group(group, size, device, sync,
                                                          quick).items():
                    results["call_us"][op].setdefault(str(n), []).append([sent, seconds * 1e6])
                    if size == nbytes:
                        results[op][str(n)] = sent / seconds * BUS_FACTOR[op](n) / 1e9
            results["latency_us"][str(n)] = _latency_us(group, device, sync, quick)
        dist.barrier()
    results["call_us"] = {op: by_n for op, by_n in results["call_us"].items() if by_n}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _measure_group(group, nbytes: int, device: str, sync,
                   quick: bool) -> dict[str, tuple[int, float]]:
    """(bytes of one call in the ledger's convention, seconds of one call) of each
    collective over `group`, messages of about `nbytes`."""
    import torch

    from fivefold.parallel import comm

    n = group.size
    elems = max(n, nbytes // 4)
    elems -= elems % n
    x = torch.ones(elems, device=device)
    full, shard = torch.empty(elems, device=device), torch.empty(elems // n, device=device)
    calls = {
        "all_reduce": lambda: comm.all_reduce(x, group),
        "all_gather": lambda: comm.all_gather(full, x[:elems // n], group),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, x, group),
        "all_to_all": lambda: comm.all_to_all(full, x, group),
    }
    if n == 2:
        peer = 1 - group.rank
        calls["send_recv"] = lambda: [h.wait() for h in comm.batch_p2p(
            [comm.P2P("send", x, peer), comm.P2P("recv", full, peer)], group)]
    inner = 4 if quick else 20 if elems * 4 <= (1 << 20) or elems * 4 >= (1 << 26) else 8
    out = {}
    for op, fn in calls.items():
        comm.barrier(group)
        out[op] = (elems * 4, _timed(fn, sync, 0.0, repeats=3, inner=inner))
    return out


def _latency_us(group, device: str, sync, quick: bool) -> float:
    """Microseconds of one all-reduce of a single element over `group`."""
    import torch

    from fivefold.parallel import comm

    x = torch.zeros(1, device=device)
    comm.barrier(group)
    return _timed(lambda: comm.all_reduce(x, group), sync, 0.0, repeats=5,
                  inner=10 if quick else 100) * 1e6


def measure_collectives(world: int, backend: str, quick: bool) -> dict:
    import torch.multiprocessing as mp

    progress(f"collectives over {world} ranks ({backend})")
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "bus.json")
        # Fresh interpreters, on a CPU too: a rank forked after the matmul timings inherits
        # their OpenMP pool in a state it cannot resume, and its first parallel fill
        # (torch.ones of 16M floats) waited forever, idle.
        mp.start_processes(_collective_rank, args=(world, init, out, backend, quick),
                           nprocs=world, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def _collectives(world: int, device: str, quick: bool) -> dict:
    """`bus_gbps`, `latency_us` and `call_us` of the profile (empty on one rank)."""
    if world < 2:
        return {"bus_gbps": {}}
    bus = measure_collectives(world, "nccl" if device == "cuda" else "gloo", quick)
    return {"latency_us": bus.pop("latency_us"), "call_us": bus.pop("call_us"), "bus_gbps": bus}


DISK_CHUNK = 4 << 20  # bytes per write and read: parallel/nvme.py's chunk of fp32 values


def file_system(path: Path) -> str:
    """The type of the file system holding `path` (Linux /proc/self/mounts), or "unknown"."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    best, kind = "", "unknown"
    target = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def measure_disk(directory: str | Path, size_mib: int) -> dict:
    """Sequential write (fsync'ed) and read rates, GB/s, of one `size_mib` file under
    `directory` (created if missing, and then removed again with the file)."""
    root = Path(directory).resolve()
    made = not root.exists()  # removed again at the end, as the engine does its offload_dir
    root.mkdir(parents=True, exist_ok=True)
    chunks = max(1, size_mib * (1 << 20) // DISK_CHUNK)
    data = memoryview(os.urandom(DISK_CHUNK))  # incompressible, as fp32 states are
    path = Path(tempfile.mkstemp(prefix="fivefold-calibrate-", suffix=".bin", dir=root)[1])
    dropped = hasattr(os, "posix_fadvise")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            start = time.perf_counter()
            for i in range(chunks):
                done = 0
                while done < DISK_CHUNK:
                    done += os.pwrite(fd, data[done:], i * DISK_CHUNK + done)
            os.fsync(fd)
            write_s = time.perf_counter() - start
            if dropped:  # clean after the fsync, so the kernel may drop them
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        buf = memoryview(bytearray(DISK_CHUNK))
        fd = os.open(path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            for i in range(chunks):
                done = 0
                while done < DISK_CHUNK:
                    got = os.preadv(fd, [buf[done:]], i * DISK_CHUNK + done)
                    if got == 0:
                        raise OSError(f"{path} ends early")
                    done += got
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    except OSError as e:
        raise ConfigError(f"--offload-dir {directory}: the disk could not be measured "
                          f"({e.strerror or e}); give a writable directory with "
                          f"{size_mib} MiB free") from None
    finally:
        path.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                root.rmdir()
    nbytes = chunks * DISK_CHUNK
    write, read = nbytes / write_s / 1e9, nbytes / read_s / 1e9
    return {"dir": str(root), "filesystem": file_system(root),
            "file_mib": nbytes >> 20, "chunk_mib": DISK_CHUNK >> 20,
            "write_gbps": write, "read_gbps": read,
            "page_cache": "dropped before the read (posix_fadvise DONTNEED)" if dropped else
            "not dropped (no posix_fadvise here): the read may come from memory",
            # the offload step's I/O: every byte read once and written once, in turn
            "nvme_gbps": 2 / (1 / read + 1 / write)}


def calibrate(out: str | Path, world: int | None = None, device: str = "auto",
              quick: bool = False, max_hidden: int = 8192, offload_dir: str | None = None,
              disk_mib: int = 256) -> dict:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no GPU is visible; use --device cpu")
    if world is None:
        world = torch.cuda.device_count() if device == "cuda" else 2
    if device == "cuda" and world > torch.cuda.device_count():
        raise ConfigError(f"--world {world} is more than the {torch.cuda.device_count()} "
                          f"visible GPUs")
    profile = {
        "machine": cpu_label(), "platform": platform.platform(),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "cpu_model": cpu_model(),
        "torch": torch.__version__, "quick": quick, "world": world,
        "threads": torch.get_num_threads(),
        **measure_compute(device, quick, max_hidden),
        **_collectives(world, device, quick),
    }
    if offload_dir:
        progress(f"disk: write (fsync) and read {disk_mib} MiB in {offload_dir}")
        profile["disk"] = measure_disk(offload_dir, disk_mib)
        profile["nvme_gbps"] = profile["disk"]["nvme_gbps"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def disk_words(profile: dict, given_dir: str | None) -> str:
    """What the closing line says of the disk (measured under `given_dir`, as given)."""
    disk = profile.get("disk")
    if not disk:
        return ("no disk measured (--offload-dir DIR measures the one NVMe offload would "
                "write, for parallel.layout = auto)")
    memory = " (tmpfs: memory, not a disk)" if disk["filesystem"] in ("tmpfs", "ramfs") else ""
    return (f"disk {disk['nvme_gbps']:.3g} GB/s for offload (write {disk['write_gbps']:.3g},"
            f" read {disk['read_gbps']:.3g}) in {given_dir}, {disk['filesystem']}{memory}")


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="fivefold calibrate", description="Measure matmul, attention, "
                        "collective bandwidth and (--offload-dir) the disk here; write a "
                        "profile for fivefold plan and train --hw-profile.")
    ap.add_argument("--out", required=True, help="the profile JSON to write")
    ap.add_argument("--world", type=int, help="ranks for the collectives (default: the GPUs, "
                    "or 2 on CPU)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes and messages (CI)")
    ap.add_argument("--max-hidden", type=int, default=8192, help="the widest GEMM measured, "
                    "(4096 × h) @ (h × 4h) (default 8192; lower it on a CPU, where 8192 takes "
                    "minutes, to the widths of the models you plan)")
    ap.add_argument("--offload-dir", help="also measure the disk under this directory: the "
                    "parallel.offload_dir NVMe offload writes (default: no disk measured)")
    ap.add_argument("--disk-mib", type=int, help="MiB written and read back for the disk "
                    "(default 256; 8 with --quick)")
    ap.add_argument("--threads", type=int, help="CPU threads for the matmul and attention "
                    "timings (default torch's; 1 when each rank of a CPU run has one)")
    args = ap.parse_args(argv)
    if args.world is not None and not 1 <= args.world <= 64:
        raise ConfigError(f"--world {args.world} must lie in [1, 64]")
    if args.max_hidden < 128:
        raise ConfigError(f"--max-hidden {args.max_hidden} must be >= 128")
    writable_file("--out", args.out)  # before minutes of measuring, not after
    if args.offload_dir:
        writable_dir("--offload-dir", args.offload_dir)
    disk_mib = args.disk_mib if args.disk_mib is not None else 8 if args.quick else 256
    if disk_mib < 4:
        raise ConfigError(f"--disk-mib {disk_mib} must be >= 4 (one chunk of 4 MiB)")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads {args.threads} must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    profile = calibrate(args.out, args.world, args.device, args.quick, args.max_hidden,
                        args.offload_dir, disk_mib)
    best = max(m["flops_per_s"] for m in profile["matmul"]) / 1e12
    print(f"wrote {args.out}: matmul up to {best:.3g} TFLOP/s ({profile['dtype']}), "
          f"{len(profile['attention'])} attention shapes, memory "
          f"{profile['memory_gbps']:.3g} GB/s, collectives over "
          f"{profile['world']} ranks, {disk_words(profile, args.offload_dir)}")
    return 0
