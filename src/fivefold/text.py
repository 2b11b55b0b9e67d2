"""Small wording helpers for what users read: '1 step', '2 steps', '6.7M params'."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 step', '3 steps', '1 micro-batch', '2 micro-batches' ('1 GPU', '8 GPUs')."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {plural or noun + 's'}"


def params(n: float) -> str:
    """A parameter count at a readable scale: '8.03B', '6.71M', '480k', '96'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}" if unit != "k" else f"{n / scale:.0f}{unit}"
    return f"{n:.0f}"
