"""How far the planner's time model has been checked against measured runs, per convention.

A plan outside that range is an extrapolation: `describe` says how far the range goes and
where the plan lies outside it, and the search prefers layouts inside it when predicted
times are close (`CLOSE`). The ranges are the runs docs/planner-validation.md scores:
- nanotron: the Ultra-Scale Playbook's 1,130 runs (bench/data/usp-calibration.csv: 16 and
  128 H100s, i.e. 2 and 16 nodes; tp up to 32, pp up to 32; no cp);
- megatron: Narayanan et al. 2021 Table 1 (32 to 3,072 A100s) and Llama 3's Table 4
  (8,192 and 16,384 H100s): tp up to 8, pp up to 64, cp up to 16;
- torchtitan: its H100 benchmarks @9dec370 (8 to 512 H100s): tp up to 8, pp up to 8, cp up
  to 2;
- deepspeed: no published run is scored;
- fivefold (the engine itself): its ranking checked on 4 CPU ranks (bench/parallel/auto_layout.py),
  on no GPU run.
Inside the range, a convention may name regimes where its scored runs spread far beyond
the rest (`Regime`): a plan there is as uncertain as one outside, and ranks the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CLOSE = 0.05  # a layout outside the range (or in an uncertain regime) must be predicted
#               this much faster to rank first


@dataclass(frozen=True)
class Regime:
    """Layouts inside the range whose scored runs the time model misses far more often than
    the rest's, for a cause that is not a function of the layout: `applies(layout)`."""

    name: str
    applies: Callable
    evidence: str


def _ddp_pipeline(layout) -> bool:
    return layout.zero == 0 and layout.dp > 1 and layout.pp > 1


# nanotron wraps the model in DDP only for ZeRO-0 with dp > 1 (trainer.py @004a89c
# `_init_model`); under its blocking pipeline such runs stall on a share of their messages,
# 0.25-0.3 s each, which no term plans (bench/plan/usp_pipeline_stall.py). On either half of
# the file alone that share is the highest of the pipeline runs whose TP stays in a node:
# 16 GPUs 3 of 10 (ZeRO-1 5 of 50, ZeRO-0 with dp 1 0 of 20), 128 GPUs 17 of 32 (24 of 151,
# 0 of 10).
DDP_PIPELINE = Regime(
    "ZeRO-0 with dp > 1 and pp > 1 (DDP under nanotron's blocking pipeline)", _ddp_pipeline,
    "20 of its 42 runs with TP in a node lost over 0.15 s per pipeline message (0.25-0.3 s "
    "as a rule), against 29 of 231 other pipeline runs (bench/plan/usp_pipeline_stall.py)")


@dataclass(frozen=True)
class ValidatedRange:
    source: str
    gpus: tuple[int, int]  # the fewest and the most GPUs (or ranks) of a scored run
    nodes: tuple[int, int]
    tp: int  # the largest degree a scored run used
    pp: int
    cp: int
    unit: str = "GPUs"
    uncertain: tuple[Regime, ...] = ()  # regimes inside it where the scored runs spread

    def regimes(self, layout) -> list[Regime]:
        """The uncertain regimes `layout` lies in."""
        return [r for r in self.uncertain if r.applies(layout)]

    def layout_outside(self, layout) -> list[str]:
        """The layout dimensions beyond the range: ['tp 64 > 32', ...]."""
        return [f"{d} {getattr(layout, d)} > {limit}"
                for d, limit in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
                if getattr(layout, d) > limit]

    def outside(self, layout, gpus_per_node: int = 8) -> list[str]:
        """Where a plan lies outside the range: its GPU count, nodes and layout dimensions."""
        world = layout.world_size
        nodes = -(-world // gpus_per_node)
        out = []
        if not self.gpus[0] <= world <= self.gpus[1]:
            side = "above" if world > self.gpus[1] else "below"
            out.append(f"{world:,} GPUs {side} the {self.gpus[0]:,}-{self.gpus[1]:,} "
                       f"{self.unit} validated")
        if self.unit == "GPUs" and not self.nodes[0] <= nodes <= self.nodes[1]:
            side = "above" if nodes > self.nodes[1] else "below"
            out.append(f"{nodes:,} nodes {side} {self.nodes[0]:,}-{self.nodes[1]:,}")
        return out + self.layout_outside(layout)

    def describe(self) -> str:
        return (f"{self.gpus[0]:,}-{self.gpus[1]:,} {self.unit}"
                + (f" ({self.nodes[0]:,}-{self.nodes[1]:,} nodes)" if self.unit == "GPUs"
                   else "")
                + f", tp ≤ {self.tp}, pp ≤ {self.pp}, cp ≤ {self.cp}; {self.source}")


RANGES: dict[str, ValidatedRange | None] = {
    "nanotron": ValidatedRange("bench/data/usp-calibration.csv", (16, 128), (2, 16), 32, 32, 1,
                               uncertain=(DDP_PIPELINE,)),
    "megatron": ValidatedRange("docs/planner-validation.md (Narayanan et al. 2021, Llama 3)",
                               (32, 16384), (4, 2048), 8, 64, 16),
    "torchtitan": ValidatedRange("docs/planner-validation.md (torchtitan's H100 benchmarks)",
                                 (8, 512), (1, 64), 8, 8, 2),
    "deepspeed": None,
    "fivefold": ValidatedRange("bench/parallel/auto_layout.py, CPU ranks; no GPU run", (1, 4),
                               (1, 1), 4, 4, 4, unit="ranks"),
}


def validated_range(convention: str) -> ValidatedRange | None:
    return RANGES.get(convention)


def describe(convention: str, layout, gpus_per_node: int = 8) -> list[str]:
    """Lines for a plan: the validated range of `convention` and where `layout` lies
    outside it."""
    rng = validated_range(convention)
    if rng is None:
        return [f"validated range ({convention} convention): no measured run scored; every "
                f"plan under it is an extrapolation"]
    outside = rng.outside(layout, gpus_per_node)
    where = ("outside it: " + "; ".join(outside) + " (an extrapolation)") if outside \
        else "inside it"
    lines = [f"validated range ({convention} convention): {rng.describe()}",
             f"this plan lies {where}"]
    lines += [f"its regime, {r.name}, is one the validation found uncertain: {r.evidence}"
              for r in rng.regimes(layout)]
    if rng.unit != "GPUs":  # the time terms it shares with the conventions scored on GPUs
        lines.append("its time terms scored on GPUs under other conventions: " + "; ".join(
            f"{name} {r.gpus[0]:,}-{r.gpus[1]:,} GPUs" for name, r in RANGES.items()
            if r is not None and r.unit == "GPUs"))
    return lines


def to_dict(convention: str, layout, gpus_per_node: int = 8) -> dict:
    """The range and where `layout` lies outside it, for --json."""
    rng = validated_range(convention)
    return {"convention": convention, "range": rng.describe() if rng else None,
            "outside": rng.outside(layout, gpus_per_node) if rng else ["no scored run"],
            "uncertain": [r.name for r in rng.regimes(layout)] if rng else []}


def rank_key(time_s: float, layout, rng: ValidatedRange | None) -> float:
    """The search's ranking key: predicted time, raised by CLOSE for a layout whose
    dimensions lie outside the validated range or in one of its uncertain regimes (so one
    inside ranks first unless the other is predicted more than CLOSE faster; once, whatever
    the reasons). Never below the time itself."""
    if rng is None or not (rng.layout_outside(layout) or rng.regimes(layout)):
        return time_s
    return time_s * (1 + CLOSE)
