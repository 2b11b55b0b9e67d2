"""Timeline pictures of pipeline schedules (PNG, matplotlib's Agg backend, imported lazily).

One row per rank, time to the right. F, B and W boxes in distinct colours carry their
micro-batch number (and chunk, when a rank has several); grey is time spent waiting for a
transfer, white is idle. The title gives the simulated bubble fraction.

    python -m fivefold.parallel.pipeline.draw --schedule 1f1b --pp 4 --microbatches 8 --out x.png
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fivefold.config import ArgumentParser, writable_file
from fivefold.parallel.pipeline.check import Costs, Simulation, simulate
from fivefold.parallel.pipeline.schedules import SCHEDULE_NAMES, Schedule, build_schedule

# Forward blue; backward-input (or full backward) green; backward-weight orange. The second
# chunk of a rank gets a lighter shade so interleaved and V layouts read at a glance.
_COLOURS = {
    "F": ("#1f5fa8", "#7fb0e6"),
    "B": ("#2e8b3d", "#8fd19a"),
    "W": ("#d9822b", "#f2c089"),
}
_WAIT_COLOUR = "#d0d0d0"


def _pyplot():
    from fivefold.extras import require

    matplotlib = require("matplotlib", "plot", "drawing a schedule (PNG)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(simulation: Simulation) -> str:
    schedule = simulation.schedule
    virtual = f", v={schedule.virtual_stages}" if schedule.virtual_stages > 1 else ""
    # peak_inflight counts chunk activations; a chunk holds 1/v of the rank's layers.
    stored = max(simulation.peak_inflight) / schedule.virtual_stages
    return (
        f"{schedule.name}: pp={schedule.pp}, m={schedule.num_microbatches}{virtual}  "
        f"bubble {simulation.bubble:.1%}, peak stored {stored:g} micro-batches"
    )


def _draw_axes(axes, simulation: Simulation) -> None:
    from matplotlib.patches import Patch

    schedule = simulation.schedule
    for rank, row in enumerate(simulation.timeline):
        y = schedule.pp - 1 - rank  # rank 0 on top
        for timed in row:
            width = timed.end - timed.start
            if timed.action is None:
                if width > 0:
                    axes.barh(y, width, left=timed.start, height=0.8, color=_WAIT_COLOUR)
                continue
            action = timed.action
            shade = _COLOURS[action.kind][action.chunk % 2]
            axes.barh(
                y,
                width,
                left=timed.start,
                height=0.8,
                color=shade,
                edgecolor="white",
                linewidth=0.6,
            )
            label = str(action.microbatch)
            if schedule.virtual_stages > 1 and width >= 0.9:
                label += f".{action.chunk}"
            size = 7 if len(label) < 3 else 6
            text_colour = "white" if action.chunk % 2 == 0 else "black"
            axes.text(
                timed.start + width / 2,
                y,
                label,
                ha="center",
                va="center",
                fontsize=size,
                color=text_colour,
            )
    axes.set_yticks(range(schedule.pp))
    axes.set_yticklabels([f"rank {r}" for r in reversed(range(schedule.pp))])
    axes.set_xlim(0, simulation.makespan)
    axes.set_ylim(-0.6, schedule.pp - 0.4)
    axes.set_xlabel("time (F = 1 unit per micro-batch per rank)")
    axes.set_title(_title(simulation), fontsize=10)
    axes.spines[["top", "right"]].set_visible(False)
    names = {
        "F": "forward",
        "B": "backward" + (" (input)" if schedule.split_backward else ""),
        "W": "backward (weights)",
    }
    kinds = ["F", "B", "W"] if schedule.split_backward else ["F", "B"]
    handles = [Patch(color=_COLOURS[k][0], label=names[k]) for k in kinds]
    if schedule.virtual_stages > 1:
        handles.append(Patch(color=_COLOURS["F"][1], label="lighter: chunk 1"))
    handles.append(Patch(color=_WAIT_COLOUR, label="waiting on a transfer"))
    axes.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False
    )


def draw_timeline(schedule: Schedule, path: str, costs: Costs | None = None) -> Simulation:
    """Simulate `schedule` with `costs` and write its timeline to `path` (PNG)."""
    simulation = simulate(schedule, costs)
    plt = _pyplot()
    width = min(22.0, 4.0 + simulation.makespan * 0.28)
    figure, axes = plt.subplots(figsize=(width, 0.9 + 0.45 * schedule.pp))
    _draw_axes(axes, simulation)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return simulation


def draw_side_by_side(
    schedules: Sequence[Schedule], path: str, costs: Costs | None = None
) -> list[Simulation]:
    """One panel per schedule, stacked, on a shared time axis, so bubbles compare directly."""
    simulations = [simulate(schedule, costs) for schedule in schedules]
    plt = _pyplot()
    longest = max(simulation.makespan for simulation in simulations)
    heights = [0.9 + 0.45 * simulation.schedule.pp for simulation in simulations]
    figure, axes_list = plt.subplots(
        len(simulations),
        1,
        figsize=(min(22.0, 4.0 + longest * 0.28), sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for axes, simulation in zip(axes_list[:, 0], simulations):
        _draw_axes(axes, simulation)
        axes.set_xlim(0, longest)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return simulations


def main(argv: Sequence[str] | None = None) -> int:
    """Draw one schedule; returns an exit code (2 for bad input, with a one-line reason)."""
    parser = ArgumentParser(
        prog="fivefold schedule",
        description="Draw the timeline of a pipeline schedule.",
    )
    parser.add_argument("--schedule", required=True,
                        help=f"one of {', '.join(SCHEDULE_NAMES)} (zb = zb-h1)")
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--forward", type=float, default=1.0, help="cost of F")
    parser.add_argument("--backward", type=float, default=1.0, help="cost of B (input part)")
    parser.add_argument("--weight", type=float, default=1.0, help="cost of W")
    args = parser.parse_args(argv)
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches),
                        ("--virtual", args.virtual)):
        if value < 1:
            print(f"error: {flag} {value} must be >= 1; give {flag} 1 or more",
                  file=sys.stderr)
            return 2
    writable_file("--out", args.out)
    _pyplot()  # a missing matplotlib is one line before any work
    virtual = args.virtual
    if args.schedule.lower() == "interleaved" and virtual == 1:
        virtual = 2
    try:
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, virtual)
        costs = Costs(args.forward, args.backward, args.weight)
        simulation = draw_timeline(schedule, args.out, costs)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{args.out}: {_title(simulation)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
