"""Checkpoint integrity: a manifest of every file in a step directory, checked before loading.

The save writes `manifest.json` last, just before the step directory is published: the size
and sha256 of every file in it (shards, metadata, RNG states, meta.json), whatever the shard
files are called. Loading checks sizes first (a truncated shard after a full disk), then
checksums (random bytes over a shard would otherwise load as garbage weights and train into
NaN). A step without a manifest, or with one that does not list every file beside it, is
incomplete for `fivefold generate` and `convert` (`strict`): nothing vouches for its bytes.
Training stays lenient there (a step written before manifests existed is checked for its
meta.json only; a damaged one fails to load and the run falls back to the step before it).

This module imports no torch, so a check is cheap to call from anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

MANIFEST = "manifest.json"
STEP_NAME = re.compile(r"step_(\d+)")


def _sha256(path: Path) -> str:
    # One reused buffer: `f.read` would allocate a new 1 MB chunk while the last is still
    # bound, two at once in a load that promises to hold about one saved chunk.
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(1 << 20))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(buffer[:n])
    return digest.hexdigest()


def write_manifest(step_path: str | os.PathLike) -> None:
    """Record size and sha256 of every file under `step_path` (call it after the last file)."""
    step_path = Path(step_path)
    files = {}
    for f in sorted(step_path.rglob("*")):
        if f.is_file() and f.name not in (MANIFEST, MANIFEST + ".tmp"):
            files[f.relative_to(step_path).as_posix()] = {"size": f.stat().st_size,
                                                          "sha256": _sha256(f)}
    tmp = step_path / (MANIFEST + ".tmp")
    with open(tmp, "w") as out:
        json.dump({"files": files}, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, step_path / MANIFEST)


def verify_step(path: str | os.PathLike, strict: bool = False) -> str | None:
    """What is wrong with the checkpoint step directory `path`, or None when it is whole.

    The answer is a short phrase for a one-line error, e.g. "__0_0.distcp is 5000000 bytes
    but 6140416 were written (truncated)". `strict`: a missing manifest, or a file the
    manifest does not list, is a problem too (see the module docstring).
    """
    p = Path(path)
    if not p.is_dir():
        return "it is not a directory"
    if not (p / "meta.json").is_file():
        return "it has no meta.json (its save did not finish)"
    manifest = p / MANIFEST
    if not manifest.is_file():
        # Without strict: saved before manifests existed, nothing more to compare against.
        return (f"it is incomplete: it has no {MANIFEST}, so nothing vouches for its files"
                if strict else None)
    try:
        files = json.loads(manifest.read_text())["files"]
        expected = {name: (int(e["size"]), str(e["sha256"])) for name, e in files.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is garbled"
    if strict:
        unlisted = [f.relative_to(p).as_posix() for f in sorted(p.rglob("*"))
                    if f.is_file() and f.name != MANIFEST
                    and f.relative_to(p).as_posix() not in expected]
        if unlisted:
            return (f"it is incomplete: its {MANIFEST} does not list {unlisted[0]}"
                    + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""))
    for name, (size, _) in expected.items():
        f = p / name
        if not f.is_file():
            return f"{name} is missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{name} is {actual} bytes but {size} were written (truncated or overwritten)"
    for name, (_, sha) in expected.items():
        if _sha256(p / name) != sha:
            return f"{name} does not match its checksum (the file is corrupted)"
    return None


def step_number(path: Path) -> int | None:
    """N of a published `step_N` directory; None for anything else (`.tmp`, `.old`, files)."""
    m = STEP_NAME.fullmatch(path.name)
    return int(m.group(1)) if m and path.is_dir() else None


def published_steps(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every published step directory under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step_number(p), p) for p in root.iterdir()]
    return sorted((n, p) for n, p in found if n is not None)


def newest_good(root: str | os.PathLike, before: int | None = None,
                strict: bool = False) -> Path | None:
    """The newest step directory under `root` that passes `verify_step`, among the steps
    numbered below `before` when given (the ones a run could fall back to)."""
    for step, path in reversed(published_steps(root)):
        if (before is None or step < before) and verify_step(path, strict) is None:
            return path
    return None


def damaged_message(path: str | os.PathLike, problem: str, fix: str,
                    strict: bool = False) -> str:
    """One line: which step is bad, why, and the newest good one to use instead.

    `fix` names where to put that path, e.g. "checkpoint.resume" or "--checkpoint"."""
    p = Path(path)
    m = STEP_NAME.match(p.name)
    good = newest_good(p.parent, before=int(m.group(1)) if m else None, strict=strict)
    state = "damaged"
    if problem.startswith("it is incomplete: "):
        state, problem = "incomplete", problem.removeprefix("it is incomplete: ")
    if good is not None:
        return (f"checkpoint {p} is {state}: {problem}; the newest good one before it is "
                f"{good} (give it as {fix})")
    return f"checkpoint {p} is {state}: {problem}; no good checkpoint precedes it"
