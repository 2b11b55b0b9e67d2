"""NVMe offload of the sharded optimizer (`parallel.offload = "nvme"`), after ZeRO-Infinity.

ZeRO-Infinity (Rajbhandari et al., SC 2021, §5-6) keeps the optimizer states of each rank's
shard on NVMe and streams them through a few pinned staging buffers: each rank moves only
its own shard (bandwidth-centric partitioning), and the next chunk is read while the current
one is updated (overlap-centric design). Here, per rank, three files under
`parallel.offload_dir` hold this rank's flat shard of the fp32 master, Adam's exp_avg and
exp_avg_sq. A step walks the shard in chunks of `CHUNK_NUMEL` values: a single background
thread reads chunk i+1 into one staging slot while the AdamW update runs on chunk i in the
other, then writes chunk i back (one worker, so its reads and writes run in the order they
were asked for, and a slot is never read into before its previous write has finished).
The updated master chunk is copied into the rank's parameter shard as it goes, so nothing
of the states is resident but the staging slots.

Bit-identical to the resident optimizer: AdamW is elementwise and each chunk runs torch's
own AdamW (`update.adamw`, the kernel the resident path picks) on a view of the staging
slot. Chunks start at multiples of `ALIGN` values from the start of a parameter piece, so
the vectorised kernel sees each value in the same lane as on the whole piece (cut at other
offsets, CPU fused AdamW's exp_avg_sq differed in the last bit here).

A failed read or write (a full disk: ENOSPC) ends the run in one line (`OffloadIOError`,
exit 1), agreed by every rank of the group so that none waits in a collective for a peer
that has given up; the run's last checkpoint is untouched. The files are removed by
`close()`, which the trainer calls on every exit path.

A rank killed with SIGKILL runs no exit path: its directory (12 bytes per value of its
shard) stays. So a directory is named by run and rank, `fivefold-offload-RUN-GROUP-rankR`
(RUN: a digest of the run's checkpoint.dir, the same at every restart of the run), not by a
random temporary name: the restarted rank finds its own leftover and removes it before it
writes, and rank 0 removes the run's directories of ranks the restart no longer has. Other
runs' directories under the same offload_dir have another RUN and are left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from fivefold.errors import ConfigError, RunError
from fivefold.parallel import comm
from fivefold.parallel.update import adamw, decays

CHUNK_NUMEL = 1 << 20  # fp32 values per state per chunk: 4 MiB, 12 MiB per staging slot
ALIGN = 64  # chunk starts within a piece: a multiple of every SIMD width's lane count
NUM_SLOTS = 2  # staging slots: one being updated, one being read (or written back)
KINDS = ("master", "exp_avg", "exp_avg_sq")


class OffloadIOError(RunError):
    """The offload files could not be read or written: one line, exit code 1."""

    exit_code = 1


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (os.pwrite may write less than asked)."""
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def read_at(fd: int, data: memoryview, offset: int) -> None:
    """Fill `data` from `offset`; a short file is an error, not zeros."""
    while len(data):
        done = os.preadv(fd, [data], offset)
        if done == 0:
            raise OSError(f"offload file ends early at byte {offset}")
        data, offset = data[done:], offset + done


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def offload_dir_name(run: str, group: str, rank: int) -> str:
    return f"fivefold-offload-{run}-{group}-rank{rank}"


def run_tag(checkpoint_dir: str) -> str:
    """The run's name in offload directories: the same at every restart of the run."""
    return hashlib.sha1(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:12]


def sweep_stale(root: str, run: str, group: str, rank: int, world: int) -> None:
    """Remove this rank's leftover directory of this run (a killed predecessor's); rank 0
    also the run's directories of ranks >= world (a restart with fewer ranks)."""
    shutil.rmtree(Path(root) / offload_dir_name(run, group, rank), ignore_errors=True)
    if rank == 0:
        prefix = f"fivefold-offload-{run}-{group}-rank"
        for path in Path(root).glob(prefix + "*"):
            tail = path.name.removeprefix(prefix)
            if tail.isdigit() and int(tail) >= world:
                shutil.rmtree(path, ignore_errors=True)


class NvmeStore:
    """This rank's flat fp32 states in files, and the staging slots that stream them."""

    def __init__(self, root: str, rank: int, numel: int, pin: bool, chunk_numel: int,
                 run: str | None = None, world: int = 1, group: str = "dp_cp"):
        self.root, self.made_root = root, not Path(root).exists()  # removed at close if so
        Path(root).mkdir(parents=True, exist_ok=True)
        if run is None:  # built outside a run (tests, benchmarks): a name of its own
            self.dir = tempfile.mkdtemp(prefix=f"fivefold-offload-rank{rank}-", dir=root)
        else:
            self.dir = str(Path(root) / offload_dir_name(run, group, rank))
            sweep_stale(root, run, group, rank, world)
            os.mkdir(self.dir)
        self.numel, self.chunk_numel = numel, chunk_numel
        self.fds = {k: os.open(os.path.join(self.dir, f"{k}.bin"),
                               os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for k in KINDS}
        size = min(chunk_numel, max(numel, 1))
        self.slots = [{k: torch.empty(size, dtype=torch.float32, pin_memory=pin)
                       for k in KINDS} for _ in range(NUM_SLOTS)]
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fivefold-nvme")
        self.wait_s = 0.0  # time the step spent waiting for the disk (for the benchmark)

    def staging(self) -> list[torch.Tensor]:
        return [t for slot in self.slots for t in slot.values()]

    def _io(self, write: bool, slot: int, lo: int, hi: int) -> None:
        for kind in KINDS:
            view = _bytes(self.slots[slot][kind][:hi - lo])
            (write_at if write else read_at)(self.fds[kind], view, lo * 4)

    def write_flat(self, kind: str, flat: torch.Tensor) -> None:
        """Replace a whole state file (start, checkpoint load), a chunk at a time."""
        flat = flat.detach().to("cpu", torch.float32).contiguous()
        for lo in range(0, self.numel, self.chunk_numel):
            write_at(self.fds[kind], _bytes(flat[lo:lo + self.chunk_numel]), lo * 4)

    def read_flat(self, kind: str) -> torch.Tensor:
        """A whole state as one tensor (checkpoint save, tests)."""
        flat = torch.empty(self.numel, dtype=torch.float32)
        for lo in range(0, self.numel, self.chunk_numel):
            read_at(self.fds[kind], _bytes(flat[lo:lo + self.chunk_numel]), lo * 4)
        return flat

    def stream(self, ranges: list[tuple[int, int]], update) -> None:
        """update(i, {kind: chunk}) on each shard range [lo, hi) in turn, range i+1 read
        while range i is updated, each written back after its update."""
        pending: list[Future] = []
        reads = {0: self.worker.submit(self._io, False, 0, *ranges[0])} if ranges else {}
        try:
            for i, (lo, hi) in enumerate(ranges):
                if i + 1 < len(ranges):
                    reads[i + 1] = self.worker.submit(self._io, False, (i + 1) % NUM_SLOTS,
                                                      *ranges[i + 1])
                self._wait(reads.pop(i))
                slot = self.slots[i % NUM_SLOTS]
                update(i, {k: slot[k][:hi - lo] for k in KINDS})
                pending.append(self.worker.submit(self._io, True, i % NUM_SLOTS, lo, hi))
            for f in pending:
                self._wait(f)
        finally:  # after a failure: no worker may still touch a slot
            for f in [*reads.values(), *pending]:
                f.cancel() or f.exception()

    def _wait(self, future: Future) -> None:
        start = time.perf_counter()
        future.result()
        self.wait_s += time.perf_counter() - start

    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.made_root:
            with contextlib.suppress(OSError):  # another rank's files may still be there
                os.rmdir(self.root)


class NvmeAdamW:
    """AdamW over a data-parallel optimizer's shard whose states live in an `NvmeStore`.

    Plays the part of the resident torch AdamW for `update.clipped_step`: `param_groups`
    (the rate is set there) and `step()`; the gradients of the pieces come in `grads` (a
    `step_grads.StepGrads`, set for the step by `update.clipped_step`), each chunk's fp32
    copy made as the chunk is updated."""

    def __init__(self, opt, root: str):
        self.opt, self.tr = opt, opt.tr
        self.param_groups = [{"lr": opt.tr.lr}]
        self.defaults: dict = {}
        self.state: dict = {}
        self.grads = None  # the step's StepGrads
        self.step_count = 0
        numel = opt.layout.total // opt.layout.shards
        pin = opt.device.type == "cuda"
        try:
            self.store = NvmeStore(root, opt.dims.rank, numel, pin, CHUNK_NUMEL,
                                   getattr(opt, "nvme_run", None), opt.dims.world_size,
                                   getattr(opt, "group_name", "dp_cp"))
            self.store.write_flat("master", opt._param_shard_flat())
            zeros = torch.zeros(numel, dtype=torch.float32)
            self.store.write_flat("exp_avg", zeros)
            self.store.write_flat("exp_avg_sq", zeros)
        except OSError as e:
            if getattr(self, "store", None) is not None:
                self.store.close()
            raise ConfigError(f"parallel.offload_dir = {root!r} cannot take the optimizer "
                              f"states ({e.strerror or e}); give a writable directory with "
                              f"room for them") from None
        # (piece, start, end) chunks in shard order, each start ALIGN-aligned in its piece
        self.chunks = []
        step = max(self.store.chunk_numel // ALIGN * ALIGN, ALIGN)
        for i, pc in enumerate(opt.pieces):
            n = pc.hi - pc.lo
            self.chunks += [(i, a, min(a + step, n)) for a in range(0, n, step)]
        self.weight_decay = [self.tr.weight_decay if decays(opt.layout.params[pc.slot].name,
                                                            opt.layout.params[pc.slot].param)
                             else 0.0 for pc in opt.pieces]

    def _destination(self, i: int) -> tuple[torch.Tensor, int]:
        """Where piece i's parameter values live on this rank: the ZeRO-3 shard or the flat
        ZeRO-1/2 buffer."""
        opt, pc = self.opt, self.opt.pieces[i]
        if opt.gatherer is not None:
            return opt.gatherer.shard, pc.shard
        return opt.param_flat, pc.flat

    def step(self) -> None:
        lr = self.param_groups[0]["lr"]
        ranges = [(self.opt.pieces[i].shard + a, self.opt.pieces[i].shard + b)
                  for i, a, b in self.chunks]

        def update(k: int, states: dict[str, torch.Tensor]) -> None:
            i, a, b = self.chunks[k]
            master = states["master"]
            optimizer = adamw([{"params": [master], "weight_decay": self.weight_decay[i]}],
                              self.tr, master.device)
            optimizer.param_groups[0]["lr"] = lr
            fused = optimizer.defaults.get("fused")
            optimizer.state[master] = {
                "step": torch.tensor(float(self.step_count), device=master.device if fused
                                     else "cpu"),
                "exp_avg": states["exp_avg"], "exp_avg_sq": states["exp_avg_sq"]}
            master.grad = self.grads.make([i], a, b)[0]  # its fp32 copy, made now
            optimizer.step()
            master.grad = None
            dest, at = self._destination(i)
            with torch.no_grad():
                dest[at + a:at + b].copy_(master)

        failed = None
        try:
            self.store.stream(ranges, update)
        except OSError as e:
            failed = e
        self._agree(failed)
        self.step_count += 1

    def _agree(self, failed: OSError | None) -> None:
        """Every rank of the group stops together when any rank's disk failed."""
        flag = torch.tensor([0.0 if failed is None else 1.0], device=self.opt.device)
        group, ledger = self.opt.group, self.opt.dims.ledger
        if group.size > 1:
            was, ledger.enabled = ledger.enabled, False  # not the step's own traffic
            try:
                comm.all_reduce(flag, group, op="max")
            finally:
                ledger.enabled = was
        if flag.item():
            cause = (f"{failed.strerror or failed}" if failed is not None
                     else "another rank's offload failed")
            raise OffloadIOError(
                f"the optimizer states in parallel.offload_dir = {self.store.dir} could not "
                f"be written at optimizer step {self.step_count + 1} ({cause}); the run "
                f"stops and its last checkpoint is intact. Free space or pick another "
                f"offload_dir, then rerun: it resumes from that checkpoint")

    def read_states(self) -> dict[str, torch.Tensor]:
        return {k: self.store.read_flat(k) for k in KINDS}

    def load_states(self, flats: dict[str, torch.Tensor] | None, step: int) -> None:
        for kind, flat in (flats or {}).items():
            self.store.write_flat(kind, flat)
        self.step_count = step

    def close(self) -> None:
        self.store.close()
