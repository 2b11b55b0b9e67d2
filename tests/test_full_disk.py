"""A full disk during a checkpoint save is one line, exit 1, and the previous step intact.

On a real small file system (a tmpfs mounted by the test; root is needed) and, wherever it
runs, with what torch raises there: the zip writer's RuntimeError (no errno) inside DCP's
CheckpointException, a BaseException neither `except Exception` nor an OSError check sees.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist
from common import small_config, tiny_train_argv
from harness import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

from fivefold.cli import main
from fivefold.parallel.mesh import ParallelDims
from fivefold.train import checkpoint as ckpt
from fivefold.train.lifecycle import CheckpointWriteError
from fivefold.train.manifest import verify_step
from fivefold.train.trainer import Trainer

# What torch 2.13's DCP writer raised on a full 4 MiB tmpfs (measured here).
WRITER_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
LAYOUT = ("--parallel.dp", "2", "--parallel.zero", "1", "--train.gbs", "4",
          "--checkpoint.keep", "5", "--parallel.timeout_s", "60")


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` at `path`, unmounted afterwards; skips (saying why) where the test
    may not mount one."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(path)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the CheckpointException cases below "
                    f"still run")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}: needs root); the "
                    f"CheckpointException cases below still run")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(root: Path, leave: int) -> None:
    """Take all but `leave` bytes of the file system holding `root`."""
    fs = os.statvfs(root)
    with open(root / "ballast", "wb") as f:
        f.write(b"\0" * max(fs.f_bavail * fs.f_frsize - leave, 0))


def check_intact(ck: Path) -> None:
    """`latest` names step 1, which passes its manifest; nothing half written is left."""
    assert (ck / "latest").read_text() == "step_00000001"
    assert verify_step(ck / "step_00000001", strict=True) is None
    assert not list(ck.glob("*.tmp")), sorted(p.name for p in ck.iterdir())


def _fill_then_save(rank, world, tmp):
    root = Path(tmp)
    cfg = small_config(root / "work", *LAYOUT, "--checkpoint.dir", str(root / "ck"))
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as t:
        t.train_step()
        t.save_checkpoint()
        if rank == 0:
            fill(root, leave=64 * 1024)  # room for the write probe, not for the shards
        dist.barrier()
        t.train_step()
        try:
            t.save_checkpoint()
        except CheckpointWriteError as e:
            return str(e)
    return "saved"


def test_a_real_full_file_system_is_one_line_on_every_rank(tmp_path):
    """dp 2 on a 4 MiB tmpfs filled after step 1: saving step 2 fails inside DCP's writer
    (a RuntimeError without errno, wrapped in CheckpointException); every rank raises the
    one line naming the full file system and the intact step 1."""
    with tmpfs(tmp_path / "fs", "4m") as fs:
        for message in run_ranks(_fill_then_save, 2, str(fs)):
            assert "\n" not in message, message
            # Where the shards ran out of room torch's writer fails without errno (named from
            # statvfs); where a plain file did, an OSError ENOSPC: the same words either way.
            assert "saving step 2" in message, message
            assert "no space left on device" in message.lower(), message
            assert "step_00000001 is intact" in message, message
        check_intact(fs / "ck")


def test_fivefold_train_on_a_file_system_with_room_for_one_checkpoint(tmp_path, capsys):
    """The command as a user runs it, nothing injected: a tmpfs with room for one step's
    checkpoint. Step 2's save fails: one line on stderr, exit code 1 (docs/runs.md: a
    checkpoint that could not be written), step 1 intact."""
    probe = tmp_path / "probe"
    assert main(tiny_train_argv(probe)[:-8] + ["--train.steps", "1", "--checkpoint.dir",
                                                 str(probe / "ck"), "--log.dir",
                                                 str(probe / "log")]) == 0
    step_bytes = sum(f.stat().st_size for f in (probe / "ck").rglob("*") if f.is_file())
    capsys.readouterr()
    with tmpfs(tmp_path / "fs", f"{int(step_bytes * 1.6) // 4096 * 4096}") as fs:
        code = main(tiny_train_argv(fs))
        err = capsys.readouterr().err.strip()
        assert code == 1, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "saving step 2" in err and "step_00000001 is intact" in err, err
        check_intact(fs / "ck")


def _writer_fails(rank, world, tmp, on_ranks):
    """torch's writer fails as on a full disk: inside dcp.save as DCP wraps it (every rank),
    or as the per-rank RNG file's torch.save on some ranks only."""
    root = Path(tmp)
    cfg = small_config(root / "work", *LAYOUT, "--checkpoint.dir", str(root / "ck"))
    out = {}
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as t:
        t.train_step()
        t.save_checkpoint()
        t.train_step()
        real_dcp_save, real_torch_save = ckpt.dcp.save, ckpt.torch.save

        def dcp_save(*args, **kwargs):
            raise CheckpointException("write_data", {0: (RuntimeError(WRITER_ERROR), None)})

        def torch_save(obj, f, *args, **kwargs):  # DCP's shard writer uses torch.save too
            if Path(str(f)).name.startswith("rng_rank"):
                raise RuntimeError(WRITER_ERROR)
            return real_torch_save(obj, f, *args, **kwargs)

        for case in ("dcp", "rng"):
            if case == "dcp":
                ckpt.dcp.save = dcp_save
            elif rank in on_ranks:
                ckpt.torch.save = torch_save
            try:
                t.save_checkpoint()
                out[case] = "saved"
            except CheckpointWriteError as e:
                out[case] = str(e)
            finally:
                ckpt.dcp.save, ckpt.torch.save = real_dcp_save, real_torch_save
            dist.barrier()
    return out


@pytest.mark.parametrize("on_ranks", [(0, 1), (1,)])
def test_what_torch_raises_on_a_full_disk_is_one_line_on_every_rank(tmp_path, on_ranks):
    """CheckpointException(RuntimeError) from dcp.save, then the RNG file's RuntimeError on
    every rank or on rank 1 alone: every rank ends with the one line (none is left waiting
    in a barrier), `latest` still names step 1, nothing half written is left."""
    for rank, out in enumerate(run_ranks(_writer_fails, 2, str(tmp_path), on_ranks)):
        for case in ("dcp", "rng"):
            message = out[case]
            assert "saving step 2" in message and "step_00000001 is intact" in message, message
            assert "\n" not in message
        assert "inline_container.cc" in out["dcp"], out["dcp"]
        if rank in on_ranks:
            assert "inline_container.cc" in out["rng"], out["rng"]
        else:
            assert "rank 1 could not write its checkpoint files" in out["rng"], out["rng"]
    check_intact(tmp_path / "ck")


def test_an_errno_free_writer_error_is_a_write_error_only_when_it_is_the_writers():
    from fivefold.train.recovery import is_write_error

    wrapped = CheckpointException("write_data", {1: (RuntimeError(WRITER_ERROR), None)})
    assert is_write_error(wrapped)
    assert is_write_error(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_write_error(CheckpointException("plan", {0: (RuntimeError("gloo"), None)}))
    assert not is_write_error(ValueError("x"))
