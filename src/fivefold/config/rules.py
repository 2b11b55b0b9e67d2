"""The small rules every section's checks are written with: a choice among names, a
positive number, a writable directory or file. Each raises ConfigError with one line."""

from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

from fivefold.errors import ConfigError


def suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key} = '{value}' is not one of {', '.join(choices)}"
                          f"{suggest(value, choices)}")


def positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} = {value} must be {'>= 0' if allow_zero else '> 0'}")


def writable_dir(key: str, path: str) -> None:
    """An output directory must be one (or creatable) and writable, before training starts:
    the first save is too late to find out."""
    p = Path(path)
    named = f"{key} {path}" if key.startswith("-") else f"{key} = '{path}'"
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{named} is a file, not a directory; give a directory path")
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{named} cannot be created: {existing} is a file; give "
                          f"another directory path")
    try:  # a real probe: permission bits say nothing for root or on a read-only mount
        tempfile.TemporaryDirectory(dir=existing, prefix=".fivefold-probe-").cleanup()
    except OSError as e:
        raise ConfigError(f"{named} is not writable ({e.strerror} in {existing}); "
                          f"give a directory you can write to") from None


def writable_file(key: str, path: str) -> None:
    """An output file's path must not be a directory, and its directory must be writable."""
    if Path(path).is_dir():
        raise ConfigError(f"{key} {path} is a directory; give a file name inside it")
    writable_dir(key, str(Path(path).parent))


# The manifest `fivefold quantize` writes (quant/io.py): its directory holds frozen packed
# weights, which nothing can train from.
QUANTIZED_MARKER = "quantized.json"


def not_quantized(key: str, path: str) -> None:
    """Training must start from float weights, never from a quantised checkpoint."""
    if path and (Path(path) / QUANTIZED_MARKER).is_file():
        raise ConfigError(f"{key} = '{path}' is a quantised checkpoint (fivefold quantize), "
                          f"which cannot be trained; give the float checkpoint or model it "
                          f"was made from")
