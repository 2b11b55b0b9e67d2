"""NVMe offload directories are named by run and rank: a restart sweeps its own leftovers
(a SIGKILLed rank's), and only its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from fivefold.parallel.nvme import NvmeStore, offload_dir_name, run_tag

KILLED = """
import os, signal, sys
from fivefold.parallel.nvme import NvmeStore
store = NvmeStore(sys.argv[1], 1, 1000, False, 256, run=sys.argv[2], world=2)
store.write_flat("master", __import__("torch").ones(1000))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_restart_sweeps_its_own_stale_offload_dirs_only(tmp_path):
    run = run_tag(str(tmp_path / "checkpoints"))
    assert run == run_tag(str(tmp_path / "checkpoints"))  # the same at every restart
    root = str(tmp_path / "offload")
    killed = subprocess.run([sys.executable, "-c", KILLED, root, run], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    stale = tmp_path / "offload" / offload_dir_name(run, "dp_cp", 1)
    assert (stale / "master.bin").stat().st_size == 4000  # left behind by the kill
    gone = tmp_path / "offload" / offload_dir_name(run, "dp_cp", 3)  # a rank the restart lacks
    peer = tmp_path / "offload" / offload_dir_name(run, "dp_cp", 0)  # rank 0 of the restart
    other = tmp_path / "offload" / offload_dir_name("0123456789ab", "dp_cp", 1)  # another run
    for d in (gone, other):
        d.mkdir()
        (d / "master.bin").write_bytes(b"x" * 8)

    restarted = NvmeStore(root, 1, 1000, False, 256, run=run, world=2)
    assert restarted.dir == str(stale) and os.listdir(stale) != []
    assert (stale / "master.bin").stat().st_size == 0  # a fresh file, not the old one
    first = NvmeStore(root, 0, 1000, False, 256, run=run, world=2)
    assert first.dir == str(peer) and not gone.exists()  # rank 0 swept rank 3's
    assert other.exists() and stale.exists()  # another run's, and a live peer's: kept
    restarted.close()
    first.close()
    assert not stale.exists() and not peer.exists() and other.exists()
