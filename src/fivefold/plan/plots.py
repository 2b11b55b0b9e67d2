"""PNG pictures of plans: stacked memory bars and step-time breakdowns.

matplotlib is imported inside the functions, with the Agg backend, so that planning never
needs it (or a display).
"""

from __future__ import annotations

from pathlib import Path

from fivefold.plan.evaluate import LayoutPlan
from fivefold.plan.hardware import GIB
from fivefold.plan.memory import MEMORY_ITEMS
from fivefold.plan.report import MEMORY_LABELS, TIME_LABELS

COLORS = {"params": "#4e79a7", "grads": "#a0cbe8", "master": "#f28e2b", "optimizer": "#ffbe7d",
          "grad_accum": "#8cd17d", "grad_buffer": "#b6992d", "activations": "#e15759",
          "logits_loss": "#ff9d9a", "split_grads": "#d37295", "comm_buffers": "#79706e",
          "overhead": "#bab0ac",
          "compute": "#4e79a7", "tp_comm": "#f28e2b", "cp_comm": "#ffbe7d",
          "ep_comm": "#8cd17d", "pp_comm": "#b6992d", "bubble": "#e15759",
          "dp_comm": "#76b7b2", "optimizer_t": "#bab0ac", "straggler": "#9c755f"}


def _pyplot():
    from fivefold.extras import require

    matplotlib = require("matplotlib", "plot", "--plot (PNG charts)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labels(plans: list[LayoutPlan]) -> list[str]:
    return [p.layout.short().replace(" ", "\n", 3) for p in plans]


def plot_memory(plans: list[LayoutPlan], path: str | Path, title: str = "") -> Path:
    """One stacked bar per layout (GiB by item), with the GPU's memory as a dashed line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(plans) + 2), 5.0))
    xs = range(len(plans))
    bottom = [0.0] * len(plans)
    for key in MEMORY_ITEMS:
        values = [p.memory[key] / GIB for p in plans]
        if any(values):
            ax.bar(xs, values, bottom=bottom, color=COLORS[key], label=MEMORY_LABELS[key],
                   width=0.7)
            bottom = [b + v for b, v in zip(bottom, values)]
    limit = plans[0].memory_limit / GIB if plans else 0
    ax.axhline(limit, color="black", linestyle="--", linewidth=1)
    ax.text(len(plans) - 0.5, limit, f" {limit:g} GiB", va="bottom", ha="right", fontsize=8)
    for x, total, p in zip(xs, bottom, plans):
        ax.text(x, total, f"{total:.0f}" + ("" if p.fits else " ✗"), ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(xs), _labels(plans), fontsize=7)
    ax.set_ylabel("GiB on the most-loaded GPU")
    ax.set_title(title or "memory per GPU by item", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_time(plans: list[LayoutPlan], path: str | Path, title: str = "") -> Path:
    """One stacked bar per layout: seconds per step by part."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(plans) + 2), 5.0))
    xs = range(len(plans))
    bottom = [0.0] * len(plans)
    for key, label in TIME_LABELS.items():
        values = [p.time.parts()[key] for p in plans]
        if any(values):
            color = COLORS["optimizer_t" if key == "optimizer" else key]
            ax.bar(xs, values, bottom=bottom, color=color, label=label, width=0.7)
            bottom = [b + v for b, v in zip(bottom, values)]
    for x, total, p in zip(xs, bottom, plans):
        ax.text(x, total, f"MFU {p.mfu:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), _labels(plans), fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(title or "step time by part", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
