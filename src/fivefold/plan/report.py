"""Terminal tables, the explanation of one layout, why alternatives lost, and JSON."""

from __future__ import annotations

import dataclasses

from fivefold.plan import validated
from fivefold.plan.evaluate import LayoutPlan
from fivefold.plan.hardware import GIB, Assumptions, Hardware
from fivefold.plan.layout import Workload
from fivefold.plan.lora import describe_lora
from fivefold.plan.memory import MEMORY_ITEMS
from fivefold.plan.placement import bubble_ratio
from fivefold.plan.search import SearchResult
from fivefold.text import count, params

TIME_LABELS = {"compute": "compute", "tp_comm": "TP comm", "cp_comm": "CP comm",
               "ep_comm": "EP comm", "pp_comm": "PP comm", "bubble": "bubble",
               "dp_comm": "DP comm", "optimizer": "optimizer", "straggler": "stragglers"}
MEMORY_LABELS = {"params": "parameters", "grads": "gradients", "master": "master weights",
                 "optimizer": "optimizer states", "grad_accum": "fp32 grad accumulation",
                 "grad_buffer": "unsharded grads (step sync)", "activations": "activations",
                 "logits_loss": "logits and loss",
                 "split_grads": "grads kept for W (split)",
                 "comm_buffers": "communication buffers",
                 "overhead": "context + allocator"}


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def describe_workload(work: Workload, hw: Hardware, num_gpus: int) -> str:
    mc = work.model
    return (f"{mc.name}: {params(mc.num_params())} params, seq_len {work.seq_len}, "
            f"gbs {work.gbs} seqs ({params(work.tokens_per_step)} tokens), "
            f"{work.precision}, {work.optimizer}, "
            f"{'flash' if work.flash else 'math'} attention — {num_gpus} × {hw.name} "
            f"({hw.memory_gib:g} GiB, {hw.gpus_per_node}/node)" + describe_moe(mc)
            + describe_lora(work))


def describe_moe(mc) -> str:
    """For a mixture of experts: its routing, total vs active parameters, what MFU counts."""
    if not mc.num_experts:
        return ""
    shared = (f", a shared expert of {mc.shared_expert_intermediate_size}"
              if mc.shared_expert_intermediate_size else "")
    routing = (f"{mc.router_score}, top-{mc.experts_top_k} of {mc.num_experts}"
               + (f" in {mc.router_topk_groups} of {mc.router_groups} groups"
                  if mc.router_groups > 1 else "")
               + (", renormalised" if mc.norm_topk_prob else ""))
    return (f"\nmixture of experts: {mc.num_moe_layers} of {mc.num_layers} layers MoE "
            f"({routing}; experts of {mc.moe_intermediate_size}{shared}); "
            f"{params(mc.num_active_params())} of {params(mc.num_params())} parameters active "
            f"per token: FLOPs and MFU count the active ones (6·N_active + attention); experts "
            f"replicate over tp and split over ep")


def format_table(plans: list[LayoutPlan]) -> str:
    """One row per layout: the layout, memory, step time, tokens/s per GPU, MFU, and where the
    time goes beyond compute."""
    header = (f"{'#':>3}  {'layout':<44} {'m':>4} {'memory GiB':>11} {'step s':>8} "
              f"{'tok/s/GPU':>10} {'MFU':>6} {'bubble':>7} {'comm':>6}")
    lines = [header, "-" * len(header)]
    for i, p in enumerate(plans, 1):
        t = p.time
        comm = t.tp_comm + t.cp_comm + t.ep_comm + t.pp_comm + t.dp_comm
        mem = f"{_gib(p.memory_total)}/{p.memory_limit / GIB:.0f}"
        lines.append(f"{i:>3}  {p.layout.short():<44} {p.num_microbatches:>4} {mem:>11} "
                     f"{t.total:>8.3f} {p.tokens_per_s_per_gpu:>10,.0f} {p.mfu:>6.1%} "
                     f"{t.bubble / t.total:>7.1%} {comm / t.total:>6.1%}")
    return "\n".join(lines)


def format_explain(plan: LayoutPlan, work: Workload) -> str:
    """Every number of one layout, itemised."""
    p, lay = plan, plan.layout
    micro = count(p.num_microbatches, "micro-batch", "micro-batches")
    lines = [(f"layout: {lay.short()}  ({count(p.world_size, 'GPU')}, {micro} of {lay.mbs}, "
              f"bubble {bubble_ratio(lay, p.num_microbatches):.1%} of compute)"),
             p.why, "",
             f"memory on the most-loaded rank (pipeline rank {p.memory_rank}), GiB:"]
    for key in MEMORY_ITEMS:
        if p.memory[key]:
            lines.append(f"  {MEMORY_LABELS[key]:<30} {_gib(p.memory[key]):>8}")
    lines.append(f"  {'total':<30} {_gib(p.memory_total):>8}  of {p.memory_limit / GIB:g}")
    if p.cpu_bytes:
        host = "host memory (NVMe staging)" if p.disk_bytes else "host memory (offload)"
        lines.append(f"  {host:<30} {_gib(p.cpu_bytes):>8}")
    if p.disk_bytes:
        lines.append(f"  {'on disk (NVMe offload)':<30} {_gib(p.disk_bytes):>8}")
    lines.append(f"  peak allocated {_gib(p.peak_allocated)}, reserved {_gib(p.peak_reserved)} "
                 f"(allocator model), + context {_gib(p.context_bytes)}: an OOM depends on "
                 f"reserved + context")
    states = p.stages[p.memory_rank]["model_states_bytes"]
    if lay.zero >= 2 and lay.dp * lay.cp > 1:
        every = "micro-batch" if p.grad_sync == "microbatch" else "step"
        why = f" = auto: {p.grad_sync_reason}" if p.grad_sync_reason else ""
        lines.append(f"  gradients reduce-scattered once per {every} (grad_sync{why})")
    lines += [f"  bytes/param: {p.bytes_per_param}",
              f"  model states: {states / 1e9:.1f} GB (1e9 bytes) = {_gib(states)} GiB"]
    if lay.pp > 1:
        lines += ["", *format_stages(p)]
    lines += ["",
              (f"FLOPs per step: model {p.model_flops:.3e}, hardware {p.hardware_flops:.3e}"
              f" (recompute {lay.recompute})"), "",
              ("communication per step on a rank of stage 0 (ledger = logical tensors; wire = "
              "ring bytes sent):")]
    for group, ops in sorted(p.ledger.items()):
        ledger = ", ".join(f"{op} {_bytes(b)}" for op, b in sorted(ops.items()))
        lines.append(f"  {group:<6} {ledger}; wire {_bytes(p.wire.get(group, 0.0))}")
    if not p.ledger:
        lines.append("  none (a single GPU)")
    if lay.recompute == "auto":
        from fivefold.plan.recompute_auto import describe

        lines += ["", *describe(p.context[0] if p.context else work, lay)]
    lines += ["", f"step time {p.time.total:.3f} s:"]
    for key, value in p.time.parts().items():
        if value:
            lines.append(f"  {TIME_LABELS[key]:<12} {value:>9.3f} s  {value / p.time.total:>6.1%}")
    if p.time.recompute:
        lines.append(f"  (recomputation inside compute: {p.time.recompute:.3f} s)")
    lines += ["", (f"throughput: {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
              f"{p.tokens_per_step / p.time.total:,.0f} tokens/s in all; "
              f"MFU {p.mfu:.1%}, HFU {p.hfu:.1%}")]
    return "\n".join(lines)


def format_stages(plan: LayoutPlan, limit: int = 16) -> list[str]:
    """One line per pipeline rank (the named ones when there are more than `limit`)."""
    names = plan.named_stages()
    label: dict[int, list[str]] = {}
    for name, rank in names.items():
        label.setdefault(rank, []).append(name.replace("_", "-"))
    rows = plan.stages
    if len(rows) > limit:
        rows = [rows[r] for r in sorted(label)]
    lines = [f"per pipeline stage ({'named ranks of ' if len(rows) < len(plan.stages) else ''}"
             f"{len(plan.stages)}): layers, memory GiB (model states), compute s per step",
             f"  {'rank':>5} {'layers':>6} {'holds':<10} {'memory':>8} {'states':>8} "
             f"{'compute':>9}"]
    for s in rows:
        holds = "+".join(k for k in ("embedding", "head") if s[k]) or "-"
        lines.append(f"  {s['pp_rank']:>5} {s['layers']:>6} {holds:<10} "
                     f"{_gib(s['memory_total_bytes']):>8} {_gib(s['model_states_bytes']):>8} "
                     f"{s['compute_s_per_step']:>9.3f}  "
                     f"{', '.join(label.get(s['pp_rank'], []))}".rstrip())
    return lines


def _time_deltas(alt: LayoutPlan, best: LayoutPlan) -> str:
    """The parts where `alt` spends more time than `best`, largest first."""
    a, b = alt.time.parts(), best.time.parts()
    deltas = sorted(((a[k] - b[k], k) for k in a), reverse=True)
    shown = [f"{TIME_LABELS[k]} +{d:.3g} s" for d, k in deltas if d > 1e-3 * best.time.total]
    return ", ".join(shown[:2]) or "same parts, rounding"


def explain_losses(result: SearchResult, count: int = 4) -> list[str]:
    """Why the leading alternatives lost to the best layout, one line each."""
    if not result.top:
        return []
    best = result.top[0]
    lines = []
    for p in result.faster_but_too_big:
        gain = best.time.total / p.time.total - 1
        lines.append(f"{p.layout.short()}: {gain:.1%} faster, but {p.why}")
    for p in result.top[1:1 + count]:
        slower = p.time.total / best.time.total - 1
        rng = result.validated
        outside = rng.layout_outside(p.layout) if rng else []
        regimes = [r.name for r in rng.regimes(p.layout)] if rng else []
        if slower < -1e-9 and outside:  # ranked below by the validated range's preference
            lines.append(f"{p.layout.short()}: {-slower:.1%} faster, but outside the "
                         f"validated range ({', '.join(outside)}), so not preferred within "
                         f"{validated.CLOSE:.0%}")
        elif slower < -1e-9 and regimes:  # in a regime the validation found uncertain
            lines.append(f"{p.layout.short()}: {-slower:.1%} faster, but in a regime the "
                         f"validation found uncertain ({'; '.join(regimes)}), so not "
                         f"preferred within {validated.CLOSE:.0%}")
        elif slower < 1e-9:
            lines.append(f"{p.layout.short()}: ties ({_gib(p.memory_total)} GiB)")
        else:
            lines.append(f"{p.layout.short()}: {slower:.1%} slower — {_time_deltas(p, best)}")
    return lines


def why_none(result: SearchResult, work: Workload, hw: Hardware) -> list[str]:
    """Which constraint removed the layouts (most first), or how far the smallest is from
    fitting, with the fix each suggests."""
    n = result.num_gpus
    if result.considered == 0:
        lines = [f"no layout of {n} GPUs meets the constraints; what removed them:"]
        for count, example in sorted(result.removed.values(), key=lambda e: -e[0]):
            lines.append(f"  {count:>6,} removed: {example}")
        kinds = " ".join(result.removed)
        if "gbs" in kinds:
            near = sorted({max(n, round(work.gbs / n) * n), (work.gbs // n + 1) * n})
            lines.append(f"fix: the global batch of {work.gbs} sequences must split over the "
                         f"data-parallel ranks; try --gbs {' or '.join(map(str, near))} "
                         f"(multiples of {n})")
        if "num_layers" in kinds:
            lines.append("fix: allow uneven pipeline stages with --space 'uneven_pp=true', or "
                         "give --layout ...,pp_split=balanced")
        if "spans nodes" in kinds:
            lines.append(f"note: the search keeps tp within a node ({hw.gpus_per_node} GPUs); "
                         f"--layout tp=... explains a tp across nodes with its cost")
        return lines
    need, lay = result.smallest or (0.0, None)
    lines = [f"none of the {result.considered:,} layouts fits in {hw.memory_gib:g} GiB"]
    if lay is not None:
        lines[0] += (f": the smallest ({lay.short()}) needs {_gib(need)} GiB on its first "
                     f"pipeline rank")
    lines.append("fix: more GPUs, recompute=full, ZeRO-3, offload, or a GPU with more memory")
    return lines


def format_search(result: SearchResult, work: Workload, hw: Hardware, top: int = 10) -> str:
    head = describe_workload(work, hw, result.num_gpus)
    stats = (f"{result.considered:,} layouts meet the constraints; {result.planned:,} planned, "
             f"{result.dropped:,} do not fit, {result.bounded_out:,} cannot beat the shown ones "
             f"(bound); {result.elapsed_s:.2f} s")
    if not result.top:
        return "\n".join([head, stats, *result.notes, *why_none(result, work, hw)])
    out = [head, stats, *result.notes, "", format_table(result.top[:top]), "",
           "why the others lost:"]
    out += [f"  {line}" for line in explain_losses(result)]
    return "\n".join(out)


def search_to_dict(result: SearchResult, work: Workload, hw: Hardware,
                   assume: Assumptions) -> dict:
    return {
        "workload": workload_to_dict(work),
        "hardware": dataclasses.asdict(hw),
        "assumptions": dataclasses.asdict(assume),
        "num_gpus": result.num_gpus,
        "search": {"considered": result.considered, "planned": result.planned,
                   "dropped_not_fitting": result.dropped, "bounded_out": result.bounded_out,
                   "elapsed_s": result.elapsed_s, "notes": result.notes},
        "layouts": [p.to_dict() for p in result.top],
        "faster_but_do_not_fit": [p.to_dict() for p in result.faster_but_too_big],
        "why_others_lost": explain_losses(result),
    }


def workload_to_dict(work: Workload) -> dict:
    out = dataclasses.asdict(work)
    out["model"]["num_params"] = work.model.num_params()
    out["model"]["num_active_params"] = work.model.num_active_params()
    return out


def convention_to_dict(convention, plan: LayoutPlan) -> dict:
    logged = plan.peak_reserved if convention.logged_memory == "reserved" else plan.peak_allocated
    return {"name": convention.name, "workload": convention.workload,
            "layout": convention.layout, "assumptions": convention.assumptions,
            "logged_memory": convention.logged_memory,
            "logged_memory_bytes": logged, "sources": list(convention.sources)}


def describe_convention(convention, plan: LayoutPlan) -> str:
    """What the other engine's own logs would show for this plan, and where its defaults
    come from."""
    d = convention_to_dict(convention, plan)
    settings = ", ".join(f"{k}={v}" for k, v in {**convention.workload,
                                                  **convention.layout}.items())
    lines = [f"convention {convention.name}: {settings}"]
    if convention.assumptions:
        lines.append("  fitted to its measured runs (--hw overrides): " + ", ".join(
            f"{k}={v:g}" for k, v in convention.assumptions.items()))
    lines += [f"  its logs report peak {convention.logged_memory} memory: "
             f"{_gib(d['logged_memory_bytes'])} GiB on the most-loaded rank"]
    lines += [f"  source: {s}" for s in convention.sources]
    return "\n".join(lines)
