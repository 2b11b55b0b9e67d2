"""The source tree of another git revision, for benches that run it beside this one."""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def baseline_src(rev: str, into: Path) -> Path:
    """Extract `rev`'s src/ under `into`; returns the src directory (for PYTHONPATH)."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    with tempfile.NamedTemporaryFile(suffix=".tar") as f:
        f.write(archive)
        f.flush()
        with tarfile.open(f.name) as tar:
            tar.extractall(into, filter="data")
    return into / "src"
