"""parallel.layout = auto: the planner picks the layout a training config runs on the ranks
that were launched, and the engine runs it.

    config (model, batch, precision, the parallel keys that are set) + ranks + memory per rank
    + hardware  ->  SearchSpace (set keys are constraints)  ->  search (plan/search.py), only
    the layouts `fivefold train` accepts (config.engine_refusal)  ->  the fastest that fits
    and the runner-up  ->  the config's [parallel] keys and train.recompute

Searched: dp, tp, pp, cp, ep, ZeRO stage, micro-batch size, pipeline schedule, recomputation
(none, selective, full and `auto`'s per-layer choice under the budget), grad_sync (per
layout, plan/grad_sync.py), CPU offload on a GPU, and NVMe offload where the run allows it:
parallel.offload_dir names a writable directory (the engine writes nowhere else), the
optimizer is AdamW (the only one the tier streams) and the disk was measured, a calibrate
profile's `nvme_gbps` (`fivefold calibrate --offload-dir DIR`). Without a measured disk NVMe
is not searched, on a GPU either, and the printed choice says so: the catalog's 3.8 GB/s is
one data sheet's drive, while the directory a run names may be a network volume a hundred
times slower, and the step time of an NVMe layout is mostly that rate. An NVMe layout holds
what CPU offload holds on the device; off it, host memory keeps only the staging slots
(plan/nvme.py). On a GPU the host's memory per rank is a budget too (the machine's
available memory over its ranks): CPU offload fits only where its states fit there, so NVMe
wins where they do not; on a CPU, whose memory is the host's, CPU offload saves nothing
(not searched) and NVMe frees what it moves to disk. Between equal times the search keeps
the states closest: resident, then CPU, then NVMe. A `parallel.offload` the user sets is a
constraint like any other key. Not searched: pp_split and the bucket sizes (kept as set).
The memory each rank may hold is `train.memory_budget_gib`, or the device's free memory; a
budget bounds peak allocated bytes (no CUDA context is added).

Imports no torch: the engine side (free memory, device name, agreement of ranks) is
train/auto_layout.py.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from fivefold import config as fconfig
from fivefold.config.parallel import offload_dir_problem, offload_value
from fivefold.errors import ConfigError
from fivefold.plan.evaluate import LayoutPlan, plan_layout, unhidden_comm
from fivefold.plan.hardware import CATALOG, GIB, Assumptions, Hardware, measured_disk, with_profile
from fivefold.plan.inputs import DEFAULT_GPU, layout_config, training_plan_inputs
from fivefold.plan.layout import Layout, Workload, layout_offload, tier
from fivefold.plan.search import SearchSpace, enumerate_layouts, search
from fivefold.plan.validated import validated_range

# The recomputation the search tries when train.recompute is not set.
RECOMPUTE_CHOICES = ("none", "selective", "full", "auto")
# parallel keys → the SearchSpace field that holds them as a one-value choice
SPACE_FIELDS = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero", "mbs": "mbs",
                "schedule": "schedule", "virtual_stages": "virtual_stages",
                "cp_comm": "cp_comm", "sp_saved_input": "sp_saved"}


@dataclass
class AutoPick:
    best: LayoutPlan
    runner_up: LayoutPlan | None
    world: int
    budget_gib: float
    budget_source: str  # "train.memory_budget_gib" or "free memory"
    hardware: str  # what the speeds come from, in words
    considered: int  # layouts meeting the constraints
    cores: int = 0  # CPU cores the ranks of a node share (0: each rank has its own device)
    nvme_note: str = ""  # why NVMe offload was not searched ("": it was, or it was set)
    host_gib: float = 0.0  # host memory per rank for offloaded states (0: not modelled)

    def step_time(self, plan: LayoutPlan) -> float:
        return shared_cores_time(plan, self.cores)


def auto_hardware(base: Hardware | None, ranks_per_node: int, budget_gib: float,
                  profile: dict | None, on_cpu: bool,
                  host_gib: float = 0.0) -> tuple[Hardware, Assumptions]:
    """The device the search plans for: the catalog entry of the GPU (the default GPU on a
    CPU), holding `budget_gib` per rank, `ranks_per_node` to a node, with a calibrate
    profile's measured speeds when given (its disk's rate too). On a CPU with a profile, the
    peak is its fastest measured matmul (so MFU is against what this machine reaches) and
    elementwise kernels run at its measured memory bandwidth; a CPU's memory is the host's.
    On a GPU, `host_gib` (> 0) is the host memory per rank offloaded states may take. The
    budget bounds allocated bytes: no context."""
    hw = base or CATALOG[DEFAULT_GPU]
    changes: dict = {"memory_gib": budget_gib, "gpus_per_node": max(1, ranks_per_node),
                     "device_is_host": on_cpu, "host_memory_gib": 0.0 if on_cpu else host_gib}
    assume = Assumptions(context_gib=0.0)
    if profile and on_cpu:
        best = max(m["flops_per_s"] for m in profile["matmul"]) / 1e12
        changes.update(fp32_tflops=best, bf16_tflops=best)
        if profile.get("memory_gbps"):  # timing applies hbm_efficiency to hbm_tbps
            changes["hbm_tbps"] = profile["memory_gbps"] / 1e3 / assume.hbm_efficiency
    return with_profile(dataclasses.replace(hw, **changes), profile), assume


def nvme_note(cfg, hw: Hardware) -> str:
    """Why the search leaves NVMe offload out for this run, or "" when it tries it (or the
    user set parallel.offload, which the search keeps as it is)."""
    if "parallel.offload" in fconfig.given_keys(cfg):
        return ""
    if cfg.train.optimizer != "adamw":
        return (f"NVMe offload not searched: it streams AdamW's states only, and "
                f"train.optimizer = {cfg.train.optimizer}")
    if not cfg.parallel.offload_dir:
        return ("NVMe offload not searched: no parallel.offload_dir (the directory on a fast "
                "local disk it would write)")
    problem = offload_dir_problem(cfg.parallel.offload_dir)
    if problem:
        return f"NVMe offload not searched: parallel.offload_dir: {problem}"
    if not measured_disk(hw):
        return ("NVMe offload not searched: no disk measured (no nvme_gbps in a --hw-profile;"
                " `fivefold calibrate --offload-dir DIR` measures it)")
    return ""


def shared_cores_time(plan: LayoutPlan, cores: int) -> float:
    """Predicted seconds per step when the ranks of a node share `cores` CPU cores (a CPU
    run with more ranks than cores; 0: each rank has its own device, the planner's step).
    The planner times each rank as if it had a core of its own; time-shared, the step takes
    at least the compute of all ranks (each pipeline stage's, times the ranks that run it,
    plus every rank's optimizer step) over the cores, plus all of the communication,
    none of it hidden (`unhidden_comm`). So a pipeline bubble costs nothing while other
    ranks have work for the idle core, and the planner's own step, the critical path, stays
    a lower bound."""
    lay, t = plan.layout, plan.time
    nodes_ranks = plan.context[1].gpus_per_node if plan.context else lay.world_size
    if not cores or cores >= nodes_ranks:
        return t.total
    ranks_per_stage = lay.world_size / lay.pp
    work = (sum(s["compute_s_per_step"] for s in plan.stages) * ranks_per_stage
            + lay.world_size * t.optimizer)
    nodes = max(1, lay.world_size // nodes_ranks)
    return max(t.total, work / (cores * nodes) + unhidden_comm(plan))


def _given(cfg) -> set[str]:
    return {k.split(".", 1)[1] for k in fconfig.given_keys(cfg) if k.startswith("parallel.")
            and k != "parallel.layout"}


def constraints(cfg) -> dict[str, object]:
    """The settings the search keeps: every parallel key that is set (mbs = 0 means auto and
    constrains nothing), and train.recompute when set."""
    par = cfg.parallel
    out = {}
    for key in sorted(_given(cfg)):
        if key == "mbs" and par.mbs == 0 or key == "grad_sync" and par.grad_sync == "auto":
            continue
        out[f"parallel.{key}"] = getattr(par, key)
    if "train.recompute" in fconfig.given_keys(cfg):
        out["train.recompute"] = cfg.train.recompute
    return out


def search_space(cfg, keep: dict, on_cpu: bool, accepts, nvme: bool = False) -> SearchSpace:
    """The SearchSpace of an auto config: one value for every kept key; NVMe offload among
    the tiers when `nvme` (nvme_note found nothing against it)."""
    tiers = ((False,) if on_cpu else (False, True)) + (("nvme",) if nvme else ())
    # layouts inside the engine's validated range rank first when within validated.CLOSE
    space = SearchSpace(recompute=RECOMPUTE_CHOICES, sp=(True, False), offload=tiers,
                        validated=validated_range("fivefold"))
    checks = []
    for dotted, value in keep.items():
        section, key = dotted.split(".", 1)
        if section == "train":  # train.recompute
            space.recompute = (value,)
        elif key in SPACE_FIELDS:
            setattr(space, SPACE_FIELDS[key], (value,))
        elif key == "offload":
            space.offload = (layout_offload(offload_value(value)),)
        elif key in ("pp_split", "pp_layers"):
            space.fixed[key] = tuple(value) if key == "pp_layers" else value
        if key in ("dp", "sp"):  # no SearchSpace field: kept by the filter
            checks.append((key, value))
        if key == "sp" and value:
            space.sp = (True,)
    space.allowed = lambda lay: all(getattr(lay, k) == v for k, v in checks) and accepts(lay)
    return space


def workload(cfg, precision: str, budget_gib: float) -> tuple[Workload, object]:
    """The workload of the config at the engine's precision, with the budget for recompute
    = auto, and a config the engine filter judges layouts with (budget set likewise)."""
    judged = copy.deepcopy(cfg)
    judged.parallel.layout = "manual"
    if judged.train.memory_budget_gib <= 0:
        judged.train.memory_budget_gib = budget_gib
    # grad_sync as set ("auto": plan_layout chooses it per layout, not for the config's own)
    work, _ = training_plan_inputs(judged, memory_budget_gib=budget_gib, grad_sync="step")
    work = dataclasses.replace(work, precision=precision, grad_sync=cfg.parallel.grad_sync)
    return work, judged


def _accepts(judged):
    def accepts(lay: Layout) -> bool:
        return fconfig.engine_refusal(layout_config(judged, lay)) is None
    return accepts


def choose(cfg, world: int, hw: Hardware, assume: Assumptions, precision: str,
           budget_source: str, hardware_words: str, on_cpu: bool,
           cores: int = 0) -> AutoPick:
    """The fastest layout of `world` ranks that fits hw.memory_gib per rank and that the
    engine runs, with the runner-up; a ConfigError naming the constraint no layout meets,
    or the budget below every layout's need. `cores`: on a CPU, the cores the ranks of a
    node share (fewer than the ranks: times are `shared_cores_time`'s)."""
    budget = hw.memory_gib
    work, judged = workload(cfg, precision, budget)
    keep = constraints(cfg)
    shared = on_cpu and 0 < cores < hw.gpus_per_node
    # shared cores reorder the planner's times, so its bound cannot prune: plan them all
    top = 10**6 if shared else 4
    note = nvme_note(cfg, hw)
    nvme = not note and "parallel.offload" not in keep
    space = search_space(cfg, keep, on_cpu, _accepts(judged), nvme)
    results = [search(work, world, hw, assume, part, top=top) for part in _spaces(space, work)]
    pick = AutoPick(None, None, world, budget, budget_source, hardware_words,
                    sum(r.considered for r in results), cores if shared else 0, note,
                    hw.host_memory_gib)
    # the search fits grad_sync = auto at its smaller need; each plan has it resolved.
    # Equal times: the states closest first (NVMe's I/O hidden is a tie, not a gain).
    closest = {"none": 0, "cpu": 1, "nvme": 2}
    fitting = sorted((p for r in results for p in r.top if p.fits),
                     key=lambda p: (pick.step_time(p), closest[tier(p.layout.offload)]))
    if fitting:  # the runner-up: the next that differs in prediction (auto ≡ none is a twin)
        best = pick.step_time(fitting[0])
        pick.best = fitting[0]
        pick.runner_up = next((p for p in fitting[1:]
                               if abs(pick.step_time(p) - best) > 1e-9 * best), None)
        return pick
    smallest = min((r.smallest for r in results if r.smallest), default=None,
                   key=lambda s: s[0])
    if smallest is not None:
        need, lay = smallest
        raise ConfigError(
            f"parallel.layout = 'auto': {_budget_words(budget_source, budget)} is below what "
            f"any layout of {world} rank(s) needs; the smallest, {lay.short()}, needs "
            f"{need / GIB:.3g} GiB: raise the budget, launch more ranks or shorten "
            f"train.seq_len / train.gbs" + (f" ({note})" if note else ""))
    raise ConfigError(_no_layout(cfg, work, world, hw, keep, on_cpu, judged))


def _spaces(space: SearchSpace, work: Workload) -> list[SearchSpace]:
    """The space as two searches: recompute = auto only where the engine runs it (one rank
    of tp, cp and ep, a dense model: parallel/recompute.py's per-operator policies), since
    planning auto costs a knapsack per layout; the other recomputation everywhere."""
    plain = dataclasses.replace(space, recompute=tuple(r for r in space.recompute
                                                       if r != "auto"))
    out = [plain] if plain.recompute else []
    dims = {d: getattr(space, d) or (1,) for d in ("tp", "cp", "ep")}
    if "auto" in space.recompute and not work.model.num_experts and all(
            1 in v for v in dims.values()):
        out.append(dataclasses.replace(space, recompute=("auto",), tp=(1,), cp=(1,), ep=(1,)))
    return out


def _budget_words(source: str, budget: float) -> str:
    if source == "train.memory_budget_gib":
        return f"train.memory_budget_gib = {budget:g}"
    return f"{budget:.3g} GiB per rank ({source})"


def _exists(work, world, hw, space) -> tuple[bool, str]:
    """Whether a layout meets the space (memory aside), else the first reason."""
    removed: dict = {}
    for lay in enumerate_layouts(work, world, hw, space, removed):
        if space.allowed is None or space.allowed(lay):
            return True, ""
    return False, next(iter(removed.values()))[1] if removed else ""


def _no_layout(cfg, work, world, hw, keep, on_cpu, judged) -> str:
    """One line naming the kept setting without which a layout exists."""
    accepts = _accepts(judged)
    whole = search_space(cfg, keep, on_cpu, accepts)
    _, reason = _exists(work, world, hw, whole)
    dims = {k: keep.get(f"parallel.{k}", 1) for k in ("dp", "tp", "pp", "cp")}
    product = dims["dp"] * dims["tp"] * dims["pp"] * dims["cp"]
    if not reason and world % product:
        reason = f"dp·tp·pp·cp of the kept keys is {product}, which does not divide {world}"
    if not reason:  # every layout met the shape rules: the engine refused them all
        lay = enumerate_layouts(work, world, hw, whole)
        reason = (fconfig.engine_refusal(layout_config(judged, lay[0])) or "") if lay else ""
    for dotted, value in keep.items():
        rest = {k: v for k, v in keep.items() if k != dotted}
        if _exists(work, world, hw, search_space(cfg, rest, on_cpu, accepts))[0]:
            shown = f"'{value}'" if isinstance(value, str) else value
            return (f"parallel.layout = 'auto' keeps {dotted} = {shown}, and no layout of "
                    f"{world} rank(s) with it runs this model and batch"
                    + (f" ({reason})" if reason else "") + f"; drop {dotted} or launch "
                    f"another number of ranks")
    return (f"parallel.layout = 'auto': no layout of {world} rank(s) runs this model and batch"
            + (f" ({reason})" if reason else "") + "; change train.gbs, the model or the "
            "number of ranks")


def check_ranks(cfg, world: int, ranks_per_node: int, on_cpu: bool, precision: str) -> None:
    """Memory aside, whether a layout of `world` ranks runs cfg, else choose()'s one line:
    `fivefold launch` asks it once, before any rank starts (each rank measures its budget
    and chooses on its own; a budget no layout fits stays theirs to say)."""
    hw, _ = auto_hardware(None, ranks_per_node, 2.0**40, None, on_cpu)
    work, judged = workload(cfg, precision, hw.memory_gib)
    keep = constraints(cfg)
    if not _exists(work, world, hw, search_space(cfg, keep, on_cpu, _accepts(judged)))[0]:
        raise ConfigError(_no_layout(cfg, work, world, hw, keep, on_cpu, judged))


def apply(cfg, plan: LayoutPlan, budget_gib: float):
    """`cfg` set to run `plan`'s layout (a copy; parallel.layout stays auto, as given)."""
    out = layout_config(cfg, plan.layout)
    out.parallel.grad_sync = plan.grad_sync
    if plan.layout.recompute == "auto" and out.train.memory_budget_gib <= 0:
        out.train.memory_budget_gib = round(budget_gib, 4)
    return out


def plan_summary(pick: AutoPick, plan: LayoutPlan) -> dict:
    step = pick.step_time(plan)
    return {"layout": plan.layout.short(), "step_time_s": step,
            "peak_gib": plan.memory_total / GIB, "mfu": plan.mfu * plan.time.total / step,
            "grad_sync": plan.grad_sync}


def record(pick: AutoPick) -> dict:
    """What the run's metadata keeps of the choice (meta.json of each checkpoint)."""
    lay = dataclasses.asdict(pick.best.layout)
    lay["pp_layers"] = list(lay["pp_layers"])
    return {"world": pick.world, "budget_gib": pick.budget_gib,
            "budget_source": pick.budget_source, "hardware": pick.hardware,
            "cores": pick.cores, "fields": lay, "chosen": plan_summary(pick, pick.best),
            "runner_up": plan_summary(pick, pick.runner_up) if pick.runner_up else None}


def describe(pick: AutoPick) -> list[str]:
    """The lines printed before the first step."""
    def line(label: str, plan: LayoutPlan) -> str:
        got = plan_summary(pick, plan)
        return (f"  {label:<10}{plan.layout.short()}"
                + (f" grad_sync={plan.grad_sync}" if plan.layout.zero >= 2 else "")
                + f": step {got['step_time_s']:.4g} s, peak {got['peak_gib']:.3g} GiB, "
                f"MFU {100 * got['mfu']:.1f}%")
    budget = _budget_words(pick.budget_source, pick.budget_gib)
    cores = f", {pick.cores} shared cores" if pick.cores else ""
    lines = [f"auto layout for {pick.world} rank(s){cores}, {budget}, speeds of "
             f"{pick.hardware} ({pick.considered} layouts met the constraints):",
             line("chosen", pick.best)]
    lines.append(line("runner-up", pick.runner_up) if pick.runner_up
                 else "  runner-up none: no other layout fits")
    if pick.host_gib:
        lines.append(f"  host memory for offloaded states: {pick.host_gib:.3g} GiB per rank")
    if pick.nvme_note:
        lines.append(f"  {pick.nvme_note}")
    return lines


def kept(cfg, saved: dict, world: int, hw: Hardware, assume: Assumptions,
         precision: str) -> tuple[LayoutPlan | None, str]:
    """A resume under auto: the layout the run started with (its checkpoint's record), or
    None and why it changes (other ranks, a new constraint, refused, no longer fits)."""
    try:
        fields = dict(saved["fields"], pp_layers=tuple(saved["fields"]["pp_layers"]))
        lay = Layout(**fields)
    except (KeyError, TypeError):
        return None, "the checkpoint's record of it is unreadable"
    if lay.world_size != world:
        return None, (f"it ran on {lay.world_size} rank(s) and {world} are launched")
    work, judged = workload(cfg, precision, hw.memory_gib)
    for dotted, value in constraints(cfg).items():
        name = dotted.split(".", 1)[1]
        field = {"sp_saved_input": "sp_saved"}.get(name, name)
        have = getattr(lay, field, None)
        if name == "offload":
            value, have = offload_value(value), tier(have)
        if have is not None and (tuple(have) if name == "pp_layers" else have) != (
                tuple(value) if name == "pp_layers" else value):
            return None, f"{dotted} = {value} is set now and it has {have}"
    refusal = fconfig.engine_refusal(layout_config(judged, lay))
    if refusal:
        return None, f"the engine refuses it now ({refusal})"
    plan = plan_layout(work, lay, hw, assume)
    if not plan.fits:
        return None, (f"it needs {plan.memory_total / GIB:.3g} GiB and "
                      f"{_budget_words(saved.get('budget_source', 'free memory'), hw.memory_gib)}")
    return plan, ""
