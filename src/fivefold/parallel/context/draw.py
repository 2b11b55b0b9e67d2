"""Pictures of context parallelism (PNG, matplotlib's Agg backend, imported lazily), drawn
from `layout.py`: the same `local_chunks`, `ring_sources` and `block_calls` the engine runs.

    layout   the causal attention square in chunks of s / (2·cp), each block coloured by the
             rank that computes it (hatched: the diagonal, computed causally; white: masked,
             never computed), zig-zag beside contiguous, with each rank's share of the work
    ring     for each ring step (rows) and rank (columns): whose K/V the rank holds and
             which of its query chunks attend to which key chunks in that step

    python -m fivefold.parallel.context.draw --cp 4 --out docs/cp-layout.png --what layout
    python -m fivefold.parallel.context.draw --cp 4 --out docs/cp-ring.png --what ring
"""

from __future__ import annotations

import sys

from fivefold.config import ArgumentParser
from fivefold.parallel.context.layout import (
    block_calls,
    local_chunks,
    ring_sources,
    score_pairs_per_rank,
)

_RANK_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                 "#b07aa1", "#ff9da7")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def computed_blocks(layout: str, cp: int) -> dict[tuple[int, int], tuple[int, bool]]:
    """{(query chunk, key chunk): (rank, diagonal)} for every block some rank computes."""
    out = {}
    for rank in range(cp):
        q_chunks = local_chunks(layout, cp, rank)
        for src in ring_sources(cp, rank):
            k_chunks = local_chunks(layout, cp, src)
            for call in block_calls(layout, cp, rank, src):
                for qi in range(call.q0, call.q1):
                    for ki in range(call.k0, call.k1):
                        qc, kc = q_chunks[qi], k_chunks[ki]
                        if kc <= qc:  # a causal call over both chunks skips the masked one
                            out[(qc, kc)] = (rank, qc == kc)
    return out


def _square(axes, layout: str, cp: int) -> None:
    from matplotlib.patches import Rectangle

    n = 2 * cp
    blocks = computed_blocks(layout, cp)
    for (qc, kc), (rank, diagonal) in blocks.items():
        colour = _RANK_COLOURS[rank % len(_RANK_COLOURS)]
        axes.add_patch(Rectangle((kc, n - 1 - qc), 1, 1, facecolor=colour, edgecolor="white",
                                 hatch="//" if diagonal else None, linewidth=1))
    axes.set_xlim(0, n)
    axes.set_ylim(0, n)
    axes.set_aspect("equal")
    axes.set_xticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)])
    axes.set_yticks([n - 0.5 - i for i in range(n)], [str(i) for i in range(n)])
    axes.set_xlabel("key chunk")
    axes.set_ylabel("query chunk")
    pairs = score_pairs_per_rank(layout, cp, 2 * cp * 256)
    share = ", ".join(f"{p / max(pairs):.2f}" for p in pairs)
    axes.set_title(f"{layout}: work per rank / max = {share}", fontsize=9)


def draw_layout(cp: int, path: str) -> None:
    plt = _pyplot()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(1, 2, figsize=(10, 5.4))
    for ax, layout in zip(axes, ("zigzag", "contiguous")):
        _square(ax, layout, cp)
    handles = [Patch(color=_RANK_COLOURS[r], label=f"cp rank {r}") for r in range(cp)]
    fig.legend(handles=handles, loc="lower center", ncol=cp, fontsize=9)
    fig.suptitle(f"Causal attention blocks at cp={cp} (2·cp chunks; hatched: diagonal, causal "
                 f"inside; white: masked, skipped)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_ring(cp: int, path: str, layout: str = "zigzag") -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(figsize=(2.4 * cp + 1, 1.15 * cp + 1.2))
    for rank in range(cp):
        q_chunks = local_chunks(layout, cp, rank)
        for step, src in enumerate(ring_sources(cp, rank)):
            k_chunks = local_chunks(layout, cp, src)
            calls = block_calls(layout, cp, rank, src)
            lines = [f"K/V of rank {src} {k_chunks}"]
            for call in calls:
                q = q_chunks[call.q0:call.q1]
                k = k_chunks[call.k0:call.k1]
                kind = "causal" if call.causal else "full"
                lines.append(f"q{list(q)} × k{list(k)} {kind}")
            if not calls:
                lines.append("nothing unmasked")
            colour = _RANK_COLOURS[src % len(_RANK_COLOURS)]
            y = cp - 1 - step
            axes.add_patch(plt.Rectangle((rank, y), 0.96, 0.9, facecolor=colour, alpha=0.35))
            axes.text(rank + 0.48, y + 0.45, "\n".join(lines), ha="center", va="center",
                      fontsize=7)
    axes.set_xlim(0, cp)
    axes.set_ylim(0, cp)
    axes.set_xticks([r + 0.48 for r in range(cp)],
                    [f"rank {r}\nholds {local_chunks(layout, cp, r)}" for r in range(cp)])
    axes.set_yticks([cp - 1 - s + 0.45 for s in range(cp)], [f"step {s}" for s in range(cp)])
    axes.set_title(f"Ring attention, {layout}, cp={cp}: K/V move to the next rank each step "
                   f"(the transfer for step s+1 runs during step s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m fivefold.parallel.context.draw",
                            description="Draw context-parallel layouts and ring steps.")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--what", choices=("layout", "ring"), default="layout")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag",
                        help="the split the ring picture shows")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.cp < 2:
        parser.error(f"--cp {args.cp}: draw a layout with cp ≥ 2")
    if args.what == "layout":
        draw_layout(args.cp, args.out)
    else:
        draw_ring(args.cp, args.out, args.layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
