"""`parallel.offload = "nvme"`: ZeRO's optimizer states in files, streamed in chunks.

dp 2 × ZeRO-1, 2 and 3 with the states on disk against the same runs with them resident
(offload none) and on the CPU (offload cpu): fp32 losses and every parameter, master and
Adam moment bit-identical (tolerance 0: AdamW is elementwise and the chunks are aligned,
parallel/nvme.py); the bytes held by the optimizer counted from tensor storages; the files
gone when the run ends; a checkpoint written under nvme resumed without offload (and with
it); an unwritable offload_dir refused before training; a disk error mid-run ending it in
one line with the last checkpoint intact.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch
from common import small_config, tiny_train_argv
from harness import run_ranks

from fivefold.cli import main
from fivefold.config import ConfigError, load
from fivefold.parallel import nvme
from fivefold.parallel.mesh import ParallelDims
from fivefold.plan.hardware import get_hardware
from fivefold.plan.model_states import model_state_bytes
from fivefold.plan.nvme import STAGING_BYTES, nvme_states, nvme_time
from fivefold.train.manifest import verify_step
from fivefold.train.trainer import Trainer

STEPS = 3
CHUNK = 4096  # values per chunk: small enough that the tiny model's shard spans many chunks
STATES = ("param", "master", "exp_avg", "exp_avg_sq")


def nvme_args(root: Path, offload: str, zero: int, *more: str) -> list[str]:
    return ["--parallel.dp", "2", "--parallel.zero", str(zero), "--parallel.offload", offload,
            "--parallel.offload_dir", str(root / "offload"), "--train.gbs", "4",
            "--parallel.timeout_s", "60", *more]


def offload_files(root: Path) -> list[str]:
    where = root / "offload"
    return sorted(str(p) for p in where.rglob("*")) if where.exists() else []


def _parity(rank, world, tmp):
    nvme.CHUNK_NUMEL = CHUNK
    root, out = Path(tmp), {}
    for zero in (1, 2, 3):
        for offload in ("none", "cpu", "nvme"):
            work = root / f"z{zero}-{offload}"
            cfg = small_config(work, *nvme_args(root, offload, zero))
            with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as t:
                losses = [t.train_step()["loss"] for _ in range(STEPS)]
                during = offload_files(root)
                file_bytes = sum(Path(f).stat().st_size for f in during if Path(f).is_file())
                out[zero, offload] = {"losses": losses, "states": t.optimizer.param_states(),
                                      "memory": t.optimizer.memory_bytes(),
                                      "shard": t.optimizer.layout.total // world,
                                      "files_during": len(during), "file_bytes": file_bytes}
            torch.distributed.barrier()
            out[zero, offload]["files_after"] = offload_files(root)
    return out


def test_nvme_offload_is_bit_identical_and_holds_less(tmp_path):
    for rank_out in run_ranks(_parity, 2, str(tmp_path)):
        for zero in (1, 2, 3):
            ref = rank_out[zero, "none"]
            for offload in ("cpu", "nvme"):
                got = rank_out[zero, offload]
                assert got["losses"] == ref["losses"], (zero, offload)
                for name, states in ref["states"].items():
                    for key in STATES:
                        assert torch.equal(got["states"][name][key], states[key]), \
                            (zero, offload, name, key)
            disk = rank_out[zero, "nvme"]
            # Resident bytes: offload none (fp32) holds exp_avg and exp_avg_sq for its shard
            # (the master is the parameter); nvme holds only 2 staging slots × 3 states.
            staging = nvme.NUM_SLOTS * 3 * CHUNK * 4
            assert ref["memory"]["optimizer"] == 2 * ref["shard"] * 4
            assert disk["memory"]["optimizer"] == staging
            assert disk["memory"]["master"] == 0
            assert ref["shard"] * 2 * 4 > staging  # the test's shard does move bytes to disk
            for key in ("params", "grads"):
                assert disk["memory"][key] == ref["memory"][key]
            # three files per rank while it ran (a directory each), none after close()
            assert disk["files_during"] == 2 * 4, disk["files_during"]
            assert disk["files_after"] == [], disk["files_after"]
            # on disk: 3 fp32 states of each rank's shard (both ranks' files counted), as
            # the planner says
            assert disk["file_bytes"] == 2 * 12 * disk["shard"]
            model = small_config(tmp_path / "plan").model.resolve()
            states = model_state_bytes(model, dp=2, zero=zero, offload=True, precision="fp32")
            planned = nvme_states(states.cpu)
            # the planner counts no padding (under dp values per bucket): 1% here
            assert 2 * planned.disk == pytest.approx(disk["file_bytes"], rel=0.01)
            assert planned.host == min(STAGING_BYTES, 2 * states.cpu)


def _resume(rank, world, tmp):
    nvme.CHUNK_NUMEL = CHUNK
    root = Path(tmp)
    ck = ["--checkpoint.dir", str(root / "ck")]
    cfg = small_config(root / "a", *nvme_args(root, "nvme", 3, *ck))
    with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as t:
        for _ in range(2):
            t.train_step()
        t.save_checkpoint()
        full = [t.train_step()["loss"] for _ in range(2)]
        final = t.optimizer.param_states()
    out = {"full": full}
    for offload in ("none", "nvme"):
        cfg = small_config(root / f"b-{offload}", *nvme_args(root, offload, 3, *ck))
        with Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True) as t:
            t.resume(str(root / "ck"), "auto")
            losses = [t.train_step()["loss"] for _ in range(2)]
            states = t.optimizer.param_states()
            out[offload] = {"losses": losses, "same_states": all(
                torch.equal(states[n][k], final[n][k]) for n in final for k in STATES)}
    return out


def test_a_checkpoint_written_under_nvme_resumes_with_and_without_offload(tmp_path):
    """Saved at step 2 under nvme; steps 3-4 resumed without offload, and with nvme (the
    states restored into files), equal the run that never stopped, bit for bit."""
    for out in run_ranks(_resume, 2, str(tmp_path)):
        for offload in ("none", "nvme"):
            assert out[offload]["losses"] == out["full"], (offload, out)
            assert out[offload]["same_states"], offload


def train_args(root: Path, offload_dir: Path) -> list[str]:
    return tiny_train_argv(root) + ["--parallel.zero", "1", "--parallel.offload", "nvme",
                                    "--parallel.offload_dir", str(offload_dir)]


def test_an_unwritable_offload_dir_is_one_line_and_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(train_args(tmp_path, blocker / "offload"))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "parallel.offload_dir" in err, err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "log").exists()


def test_offload_keeps_its_booleans_and_names_its_choices(tmp_path):
    assert load(None, ["--parallel.offload", "true"]).parallel.offload == "cpu"
    assert load(None, ["--parallel.offload", "false"]).parallel.offload == "none"
    for bad, words in ((["--parallel.offload", "disk"], "parallel.offload"),
                       (["--parallel.offload", "nvme", "--parallel.zero", "1"],
                        "parallel.offload_dir"),
                       (["--parallel.offload", "nvme", "--parallel.offload_dir",
                         str(tmp_path)], "parallel.zero")):
        try:
            load(None, bad)
        except ConfigError as e:
            assert words in str(e) and "\n" not in str(e), str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_a_disk_error_mid_run_is_one_line_and_the_last_checkpoint_stays(tmp_path, capsys,
                                                                        monkeypatch):
    """Step 2's write-back raises ENOSPC in the I/O thread: the run stops with one line and
    exit 1 (docs/runs.md: a write that failed), step 1's checkpoint intact, no files left."""
    steps, real_step, real_write = [0], nvme.NvmeAdamW.step, nvme.write_at

    def counted_step(self):
        steps[0] += 1
        return real_step(self)

    def failing_write(fd, data, offset):
        if steps[0] >= 2 and threading.current_thread().name.startswith("fivefold-nvme"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data, offset)

    monkeypatch.setattr(nvme.NvmeAdamW, "step", counted_step)
    monkeypatch.setattr(nvme, "write_at", failing_write)
    code = main(train_args(tmp_path, tmp_path / "offload"))
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "No space left on device" in err and "optimizer step 2" in err, err
    ck = tmp_path / "ck"
    assert (ck / "latest").read_text() == "step_00000001"
    assert verify_step(ck / "step_00000001", strict=True) is None
    assert offload_files(tmp_path) == []


def test_the_planner_pays_only_the_io_the_update_does_not_hide():
    """io = read + write of every offloaded byte at nvme_gbps; the step waits max(0, io -
    update); --hw nvme_gbps overrides the data-sheet default."""
    hw, _ = get_hardware("h100-sxm")
    fast, _ = get_hardware("h100-sxm", {"nvme_gbps": 38.0})
    disk = 7.6e9  # bytes per rank
    slow_disk = nvme_time(disk, update_s=1.0, hw=hw)
    assert slow_disk.io == pytest.approx(2 * disk / 3.8e9)  # 4 s
    assert slow_disk.exposed == pytest.approx(3.0) and slow_disk.step == pytest.approx(4.0)
    hidden = nvme_time(disk, update_s=1.0, hw=fast)
    assert hidden.io == pytest.approx(0.4) and hidden.exposed == 0.0 and hidden.step == 1.0


def test_fivefold_plan_config_gives_the_nvme_tier(tmp_path, capsys):
    """Llama-3.1-8B, dp 4 × tp 2, ZeRO-3, bf16: 1.0e9 parameters per GPU × 12 B (fp32
    master + two moments) on disk, read and written once per step at 3.8 GB/s."""
    example = Path(__file__).resolve().parents[1] / "examples" / "llama-8b-h100.toml"
    code = main(["plan", "--config", str(example), "--parallel.zero", "3",
                 "--parallel.offload", "nvme", "--parallel.offload_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("NVMe tier"))
    disk_gib = float(line.split(": ")[1].split(" GiB")[0])
    assert disk_gib == pytest.approx(8.03e9 / 8 * 12 / 2**30, rel=0.01), line
    io_s = float(line.split("per step ")[1].split(" s")[0])
    assert io_s == pytest.approx(2 * disk_gib * 2**30 / 3.8e9, rel=0.01), line


def test_a_disk_too_small_for_the_states_is_refused_before_training(tmp_path, capsys):
    """offload_dir on a real 64 KiB tmpfs (mounted by the test; skipped, saying why, where it
    may not mount one): writing the states' files at the start fails, one line, exit 2, no
    run directory, the tmpfs left as it was. The files are written whole when the run
    starts, so later steps overwrite in place (on a file system that is not copy-on-write,
    they ask for no more room)."""
    from test_full_disk import tmpfs

    with tmpfs(tmp_path / "fs", "64k") as fs:
        code = main(train_args(tmp_path / "run", fs / "offload"))
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert len(err.splitlines()) == 1 and "parallel.offload_dir" in err, err
        assert "No space left on device" in err, err
        assert not (tmp_path / "run").exists()
        assert list(fs.iterdir()) == []
