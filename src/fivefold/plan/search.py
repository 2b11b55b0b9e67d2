"""Search: enumerate dp × tp × pp × cp × ep × zero × mbs × recompute × schedule, drop what
breaks a constraint or does not fit, rank the rest by predicted throughput.

Speed comes from a bound, not from approximation: every layout first gets a lower bound on
its step time (its pipeline's compute, m·(t_f + t_b), and a bubble of its quickest stage's
micro-batches, which every other part only adds to). Layouts are then planned exactly in
order of that bound, and the search stops when the bound passes the step time of the last
layout it must show. A layout whose recompute sibling with less recomputation already fits
is skipped too: it holds more FLOPs for nothing.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fivefold.errors import ConfigError
from fivefold.plan.bounds import memory_check, peak_bytes, step_time_bound
from fivefold.plan.evaluate import LayoutPlan, plan_layout
from fivefold.plan.hardware import Assumptions, Hardware, usable_memory
from fivefold.plan.layout import (
    LIGHTER_OPTIMIZERS,
    RECOMPUTE,
    SCHEDULES,
    Layout,
    Workload,
    check_layout,
)
from fivefold.plan.validated import ValidatedRange, rank_key

SPACE_KEYS = ("tp", "pp", "cp", "ep", "zero", "mbs", "recompute", "schedule",
              "virtual_stages", "sp", "offload", "cp_comm", "sp_saved")
CP_COMMS = ("ring", "allgather")


@dataclass
class SearchSpace:
    """Choices per dimension; None means every value the constraints allow."""

    tp: tuple | None = None
    pp: tuple | None = None
    cp: tuple | None = None
    ep: tuple | None = None
    zero: tuple = (0, 1, 2, 3)
    mbs: tuple | None = None
    recompute: tuple = ("none", "selective", "full")  # "auto" when asked (--space)
    schedule: tuple = SCHEDULES
    virtual_stages: tuple = (2, 4, 8)
    sp: tuple = (True,)  # with tp > 1; SP halves nothing in time and saves memory
    offload: tuple = (False,)
    cp_comm: tuple = CP_COMMS  # with cp > 1
    sp_saved: tuple = ("full",)  # with sp: "full", "shard" or both (parallel.sp_saved_input)
    max_mbs: int = 16
    min_cp_tokens: int = 1024  # keep at least this many tokens per cp rank
    strict_layers: bool = True  # num_layers divisible by the pipeline chunks
    fixed: dict = field(default_factory=dict)  # Layout fields every layout gets (a convention)
    # Layouts to rank, e.g. only what the engine runs today (plan --config); None: all.
    # Asked only of the layouts the search reaches, not of every one enumerated.
    allowed: Callable[[Layout], bool] | None = None
    # The convention's validated range (plan/validated.py): layouts inside it rank first
    # when predicted times are within validated.CLOSE; None: time alone.
    validated: ValidatedRange | None = None

    @classmethod
    def parse(cls, text: str) -> SearchSpace:
        """'tp=2,4,8 pp=1,2 zero=1,3 recompute=selective uneven_pp=true' → SearchSpace."""
        space = cls()
        for item in text.replace(";", " ").split():
            if "=" not in item:
                raise ConfigError(f"--space item {item!r} needs the form key=v1,v2")
            key, values = item.split("=", 1)
            vals = [v for v in values.split(",") if v]
            if key == "uneven_pp":
                space.strict_layers = vals[0].lower() not in ("1", "true", "yes")
                continue
            if key in ("max_mbs", "min_cp_tokens"):
                setattr(space, key, int(vals[0]))
                continue
            if key not in SPACE_KEYS:
                raise ConfigError(f"--space key {key!r} is unknown; use {', '.join(SPACE_KEYS)}")
            if key in ("recompute", "schedule", "cp_comm", "sp_saved"):
                allowed = {"recompute": RECOMPUTE, "schedule": SCHEDULES,
                           "cp_comm": CP_COMMS, "sp_saved": ("full", "shard")}[key]
                bad = [v for v in vals if v not in allowed]
                if bad:
                    raise ConfigError(f"--space {key}={bad[0]} is not one of {', '.join(allowed)}")
                setattr(space, key, tuple(vals))
            elif key in ("sp", "offload"):  # offload: true (CPU), false or nvme
                setattr(space, key, tuple("nvme" if key == "offload" and v.lower() == "nvme"
                                          else v.lower() in ("1", "true", "yes") for v in vals))
            else:
                try:
                    setattr(space, key, tuple(int(v) for v in vals))
                except ValueError:
                    raise ConfigError(f"--space {key}={values} must be whole numbers") from None
        return space


@dataclass
class SearchResult:
    top: list[LayoutPlan]  # fitting layouts, fastest first (inside the validated range first
    #                        when within validated.CLOSE: `validated.rank_key`)
    faster_but_too_big: list[LayoutPlan]  # layouts faster than the best that do not fit
    num_gpus: int
    considered: int  # layouts meeting every constraint
    planned: int  # layouts planned exactly
    dropped: int  # layouts found not to fit
    bounded_out: int  # layouts the lower bound proved slower than the shown ones
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    # which constraint removed how many layouts: {kind: [count, first example]}
    removed: dict[str, list] = field(default_factory=dict)
    smallest: tuple[float, Layout] | None = None  # when none fits: the least memory needed
    validated: ValidatedRange | None = None  # the range the ranking preferred


def _note(removed: dict | None, problem: str, count: int = 1) -> None:
    """Count a removed layout under its kind of constraint (the problem, digits masked)."""
    if removed is not None:
        kind = re.sub(r"\d+", "#", problem)
        entry = removed.setdefault(kind, [0, problem])
        entry[0] += count


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(work: Workload, num_gpus: int, hw: Hardware,
                      space: SearchSpace, removed: dict | None = None) -> list[Layout]:
    """Every layout of `num_gpus` GPUs that meets the constraints (tp within a node; heads,
    kv heads, MLP width, layers and batch divisible; gbs = dp·mbs·m; schedule rules)."""
    mc = work.model
    tps = space.tp or [t for t in _divisors(hw.gpus_per_node)]
    cps = space.cp or [c for c in _powers_of_two(num_gpus)
                       if c == 1 or work.seq_len // c >= space.min_cp_tokens]
    eps = space.ep or ([e for e in _divisors(mc.num_experts)] if mc.num_experts else [1])
    out: list[Layout] = []
    for tp in tps:
        for cp in cps:
            if num_gpus % (tp * cp):
                _note(removed, f"tp·cp = {tp * cp} does not divide the {num_gpus} GPUs")
                continue
            rest = num_gpus // (tp * cp)
            for pp in space.pp or [p for p in _divisors(rest) if p <= mc.num_layers]:
                if rest % pp:
                    continue
                dp = rest // pp
                if work.gbs % dp:
                    _note(removed, f"gbs = {work.gbs} is not divisible by dp = {dp}")
                    continue
                per_dp = work.gbs // dp
                mbss = space.mbs or [b for b in _divisors(per_dp) if b <= space.max_mbs]
                schedules = [("1f1b", 1)] if pp == 1 else [
                    (s, v) for s in space.schedule
                    for v in (space.virtual_stages if s == "interleaved" else (1,))]
                for mbs in mbss:
                    if per_dp % mbs:
                        continue
                    for sched, v in schedules:
                        for ep in eps:
                            # experts replicate over tp without SP (models/moe.py)
                            sps = space.sp if tp > 1 and not mc.num_experts else (False,)
                            saved = ((space.fixed["sp_saved"],) if "sp_saved" in space.fixed
                                     else space.sp_saved)
                            for sp, kept in [(s, k) for s in sps
                                             for k in (saved if s else saved[:1])]:
                                fixed = {**space.fixed, "sp_saved": kept}
                                base = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, mbs=mbs,
                                              schedule=sched, virtual_stages=v, sp=sp,
                                              **fixed)
                                problems = check_layout(work, base, hw.gpus_per_node,
                                                        space.strict_layers)
                                if problems:
                                    _note(removed, problems[0])
                                    continue
                                # one rank has nothing to shard: stage 0, unless one is
                                # asked, and stage 1 as what carries offload (ZeRO-Offload)
                                alone = dp * cp == 1 and len(space.zero) > 1
                                zeros = space.zero if not alone else (0, 1) if any(
                                    space.offload) and 1 in space.zero else (0,)
                                for zero in zeros:
                                    for off in space.offload:
                                        if off and zero == 0 or alone and zero and not off:
                                            continue
                                        for rc in space.recompute:
                                            for comm in space.cp_comm if cp > 1 else ("ring",):
                                                out.append(Layout(
                                                    dp, tp, pp, cp, ep, zero, mbs, rc, sched, v,
                                                    sp, off, cp_comm=comm, **fixed))
    return out


PROGRESS_EVERY_S = 2.0  # a search still going after this long reports, and again as often


def search(work: Workload, num_gpus: int, hw: Hardware, assume: Assumptions,
           space: SearchSpace | None = None, top: int = 10,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """The `top` fastest layouts that fit, with the faster ones that do not. `progress`, when
    given, gets a line every PROGRESS_EVERY_S seconds once the search has run that long."""
    space = space or SearchSpace()
    start = time.perf_counter()
    next_report = start + PROGRESS_EVERY_S

    def report(what: str) -> None:
        nonlocal next_report
        now = time.perf_counter()
        if progress is not None and now >= next_report:
            next_report = now + PROGRESS_EVERY_S
            progress(f"searching: {what} ({now - start:.0f} s)")

    removed: dict[str, list] = {}
    layouts = enumerate_layouts(work, num_gpus, hw, space, removed)
    smallest: tuple[float, Layout] | None = None
    compute_cache: dict[tuple, float] = {}

    bounds = []
    for i, lay in enumerate(layouts):
        bounds.append((step_time_bound(work, lay, hw, assume, compute_cache), i))
        report(f"bounded {i + 1:,} of {len(layouts):,} layouts")
    order = sorted(bounds)
    best: list[tuple[float, int, LayoutPlan]] = []  # max-heap by time (negated)
    too_big: list[tuple[float, Layout]] = []
    fitting_siblings: dict[tuple, int] = {}  # layout without recompute → lowest level fitting
    planned = dropped = bounded = 0
    seen: set[tuple] = set()
    # auto (per-layer choices under the budget) is never ruled out by a sibling that fits
    level = {rc: i for i, rc in enumerate(RECOMPUTE)} | {"auto": -1}
    for pos, (bound, i) in enumerate(order):
        if len(best) >= top and bound >= -best[0][0]:
            bounded = len(order) - pos
            break
        report(f"{pos:,} of {len(order):,} layouts in bound order, {planned} planned, "
               f"{dropped} do not fit")
        lay = layouts[i]
        if space.allowed is not None and not space.allowed(lay):  # asked late: it costs
            continue
        sibling = (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.mbs, lay.schedule,
                   lay.virtual_stages, lay.sp, lay.offload, lay.cp_comm, lay.sp_saved)
        if fitting_siblings.get(sibling, 99) < level[lay.recompute]:
            bounded += 1
            continue
        # The first pipeline rank alone over the limit settles it (peak = max over ranks);
        # offloaded states count where their tier puts them (plan/bounds.py).
        memory = memory_check(work, lay, hw, assume)
        first_total = memory.first_rank_bytes
        if not memory.fits:
            dropped += 1
            if not best and (smallest is None or first_total < smallest[0]):
                smallest = (first_total, lay)
            twin = (bound, round(first_total / 2**30, 1))
            if not best and len(too_big) < 3 and twin not in seen:
                seen.add(twin)
                too_big.append((bound, lay))
            continue
        fitting_siblings[sibling] = min(fitting_siblings.get(sibling, 99), level[lay.recompute])
        plan = plan_layout(work, lay, hw, assume)
        planned += 1
        # Identical predictions (e.g. ZeRO-2 next to ZeRO-1 when gradients sync once per
        # step, to 0.1 GiB) are shown once: the first enumerated (lower stage) stands for both.
        twin = (round(plan.time.total, 9), round(plan.memory_total / 2**30, 1))
        if twin in seen:
            continue
        seen.add(twin)
        key = rank_key(plan.time.total, lay, space.validated)  # ≥ the time ≥ its bound
        entry = (-key, -i, plan)
        if len(best) < top:
            heapq.heappush(best, entry)
        elif key < -best[0][0]:
            heapq.heapreplace(best, entry)
    ranked = [p for _, _, p in sorted(best, key=lambda e: (-e[0], -e[1]))]
    notes = [note for note in [gbs_note(work.gbs, num_gpus, removed)] if note]
    if not ranked:  # memory binds: would a lighter optimizer's states fit? (plan/optimizer.py)
        notes += lighter_optimizer_note(work, num_gpus, hw, assume, space, top)
    fastest = min((p.time.total for p in ranked), default=float("inf"))
    too_big_plans = [plan_layout(work, lay, hw, assume) for _, lay in too_big]
    too_big_plans = [p for p in too_big_plans if p.time.total < fastest]
    return SearchResult(
        top=ranked, faster_but_too_big=too_big_plans, num_gpus=num_gpus,
        considered=len(layouts), planned=planned + len(too_big_plans), dropped=dropped,
        bounded_out=bounded, elapsed_s=time.perf_counter() - start, removed=removed,
        smallest=None if ranked else smallest, notes=notes, validated=space.validated)


def gbs_note(gbs: int, num_gpus: int, removed: dict) -> str:
    """When the global batch is what ruled data-parallel sizes out, say which and what batch
    would allow them ('' when it ruled nothing out)."""
    kind = next((k for k in removed if k.startswith("gbs = # is not divisible by dp")), None)
    if kind is None:
        return ""
    blocked = [d for d in _divisors(num_gpus) if gbs % d]
    near = sorted({max(num_gpus, gbs // num_gpus * num_gpus), (gbs // num_gpus + 1) * num_gpus})
    return (f"note: gbs = {gbs} sequences is not divisible by dp = "
            f"{', '.join(map(str, blocked))}: {removed[kind][0]:,} (tp, cp, pp) choices with "
            f"those dp were ruled out before planning; --gbs {' or '.join(map(str, near))} "
            f"(multiples of the {num_gpus} GPUs) allows every dp")


# The training-config key of each layout field, for suggestions a person can paste.
CONFIG_KEYS = {"tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp",
               "ep": "parallel.ep", "zero": "parallel.zero", "mbs": "parallel.mbs",
               "recompute": "train.recompute", "schedule": "parallel.schedule",
               "virtual_stages": "parallel.virtual_stages", "sp": "parallel.sp",
               "offload": "parallel.offload", "dp": "parallel.dp", "cp_comm": "parallel.cp_comm"}


def _format_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"'{value}'" if isinstance(value, str) else str(value)


def suggest_fix(work: Workload, layout: Layout, num_gpus: int, hw: Hardware,
                assume: Assumptions, allowed: Callable[[Layout], bool] | None = None) -> str:
    """The fitting layout on the same GPUs and batch with the fewest changed config keys
    (fastest among equals), as 'train.recompute = 'selective' (fits: 61.2 of 80 GiB, …)'.
    `allowed` keeps only the layouts it accepts (what the engine runs)."""
    space = SearchSpace(strict_layers=False, sp=(True, False), offload=(False, True))
    fields = [k for k in CONFIG_KEYS if k != "dp"]  # dp follows from the others

    def changed(c: Layout) -> list[str]:
        return [k for k in fields if getattr(c, k) != getattr(layout, k)]

    candidates = sorted(enumerate_layouts(work, num_gpus, hw, space),
                        key=lambda c: len(changed(c)))
    best: LayoutPlan | None = None
    best_changes = 0
    for cand in candidates:
        n = len(changed(cand))
        if best is not None and n > best_changes:
            break
        if peak_bytes(work, cand, hw, assume) > usable_memory(hw, assume):
            continue
        if allowed is not None and not allowed(cand):
            continue
        plan = plan_layout(work, cand, hw, assume)
        if best is None or plan.time.total < best.time.total:
            best, best_changes = plan, n
    if best is None:
        return ""
    keys = changed(best.layout) + (["dp"] if best.layout.dp != layout.dp else [])
    text = ", ".join(f"{CONFIG_KEYS[k]} = {_format_value(getattr(best.layout, k))}"
                     for k in keys)
    return f"{text} ({best.why}, {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU)"


def lighter_optimizer_note(work, num_gpus, hw, assume, space, top) -> list[str]:
    """When no layout fits with AdamW's states, the first lighter optimizer with which one
    does, as a note for the search's report (the search tries each in turn)."""
    if work.optimizer not in ("adamw", "adam"):
        return []
    for name in LIGHTER_OPTIMIZERS:
        result = search(dataclasses.replace(work, optimizer=name), num_gpus, hw, assume,
                        space, top)
        if result.top:
            best = result.top[0]
            return [f"nothing fits with {work.optimizer}'s 8 bytes of states per parameter; "
                    f"with train.optimizer = {name} {len(result.top)} layouts fit, fastest "
                    f"{best.layout.short()} ({best.memory_total / 2**30:.1f} GiB, "
                    f"{best.time.total:.2f} s/step)"]
    return []
