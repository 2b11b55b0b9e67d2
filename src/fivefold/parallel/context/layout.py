"""Where each token of a sequence lives under context parallelism, and which block pairs of
causal attention each rank computes. Pure Python: no torch, so the planner and the pictures
use the very function the engine runs.

A sequence of S tokens is cut into 2·cp chunks of c = S / (2·cp) tokens. Rank r holds two:

    zigzag       chunks r and 2·cp − 1 − r   ("head-tail": every rank gets one early and
                 one late chunk, so causal attention costs the same on every rank)
    contiguous   chunks 2r and 2r + 1        (rank cp − 1 holds the latest tokens and does
                 cp times the work of rank 0 at cp ≥ 2; kept for comparison)

Its local sequence is the two chunks in order (first chunk id < second), so causal attention
of the local queries over the local keys is plain causal attention over 2c tokens.

Attention of a query chunk i over a key chunk j is: full if j < i, causal (the diagonal) if
j == i, and skipped if j > i. Under ring attention rank r meets the keys of every source
rank once; `block_calls` turns the chunk pairs of (r, source) into at most one kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("zigzag", "contiguous")


def local_chunks(layout: str, cp: int, rank: int) -> tuple[int, int]:
    """The two chunk ids (of 2·cp) that `rank` holds, in sequence order."""
    if layout == "zigzag":
        return rank, 2 * cp - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"context-parallel layout '{layout}' is not one of {', '.join(LAYOUTS)}")


def local_positions(layout: str, cp: int, rank: int, seq_len: int) -> list[int]:
    """Global positions (0 … seq_len − 1) of the rank's local tokens, in local order."""
    c = seq_len // (2 * cp)
    return [chunk * c + i for chunk in local_chunks(layout, cp, rank) for i in range(c)]


@dataclass(frozen=True)
class BlockCall:
    """One attention kernel call: local query rows [q0, q1) · c over the source rank's key
    rows [k0, k1) · c, in chunk units (0, 1 or 2), causal on the diagonal or full."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool

    def score_pairs(self, chunk: int) -> int:
        """(query, key) pairs the call computes for chunks of `chunk` tokens."""
        nq, nk = (self.q1 - self.q0) * chunk, (self.k1 - self.k0) * chunk
        return nq * (nq + 1) // 2 if self.causal else nq * nk


def block_calls(layout: str, cp: int, rank: int, source: int) -> list[BlockCall]:
    """The kernel calls of `rank`'s queries over `source`'s keys (empty: nothing unmasked)."""
    if source == rank:  # the local chunks are in order: one causal call over both
        return [BlockCall(0, 2, 0, 2, True)]
    q_chunks = local_chunks(layout, cp, rank)
    k_chunks = local_chunks(layout, cp, source)
    # For each local query chunk, the source's key chunks it sees (all earlier: full).
    needs = [tuple(j for j, kc in enumerate(k_chunks) if kc < qc) for qc in q_chunks]
    calls = []
    if needs[0] == needs[1] and needs[0]:
        keys = needs[0]
        return [BlockCall(0, 2, keys[0], keys[-1] + 1, False)]
    for i, keys in enumerate(needs):
        if keys:  # key chunks a source holds are in order, so `keys` is a contiguous run
            calls.append(BlockCall(i, i + 1, keys[0], keys[-1] + 1, False))
    return calls


def ring_sources(cp: int, rank: int) -> list[int]:
    """The source rank whose keys `rank` holds at each ring step: its own first, then the
    rank before it, and so on (K/V travel to the next rank every step)."""
    return [(rank - step) % cp for step in range(cp)]


def score_pairs_per_rank(layout: str, cp: int, seq_len: int) -> list[int]:
    """Causal (query, key) pairs each rank computes for one sequence, from `block_calls`."""
    c = seq_len // (2 * cp)
    return [sum(call.score_pairs(c) for src in ring_sources(cp, r)
                for call in block_calls(layout, cp, r, src)) for r in range(cp)]
