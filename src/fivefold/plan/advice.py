"""Explain, don't refuse: warnings (with their cost) for a layout that runs but is unusual.

`check_layout` without a node size lists only what cannot run; these are the choices that
run and cost something a person should see before launching: tensor (or context) parallelism
across nodes, a pipeline with fewer micro-batches than stages, an uneven stage split.
"""

from __future__ import annotations

from fivefold.plan.evaluate import LayoutPlan
from fivefold.plan.hardware import Hardware
from fivefold.plan.layout import Workload
from fivefold.plan.placement import bubble_ratio, chunk_layer_counts


def layout_warnings(plan: LayoutPlan, work: Workload, hw: Hardware) -> list[str]:
    lay, t = plan.layout, plan.time
    node = hw.gpus_per_node
    out = []
    if lay.tp > node:
        out.append(f"tp = {lay.tp} spans {-(-lay.tp // node)} nodes of {node} GPUs: its "
                   f"collectives cross the network ({hw.inter_node_gbps:g} GB/s per GPU instead "
                   f"of {hw.intra_node_gbps:g} GB/s); exposed TP communication {t.tp_comm:.3f} s "
                   f"per step, {t.tp_comm / t.total:.0%} of it")
    elif lay.tp * lay.cp > node and lay.cp > 1:
        out.append(f"tp·cp = {lay.tp * lay.cp} spans nodes: context parallelism's K/V exchange "
                   f"crosses the network; exposed CP communication {t.cp_comm:.3f} s per step, "
                   f"{t.cp_comm / t.total:.0%} of it")
    m = plan.num_microbatches
    if lay.pp > 1 and m < lay.pp:
        out.append(f"{m} micro-batches for {lay.pp} pipeline stages: the bubble is "
                   f"{bubble_ratio(lay, m):.0%} of compute ({t.bubble:.3f} s per step); raise "
                   f"the global batch or lower mbs or pp")
    if lay.pp > 1:
        counts = chunk_layer_counts(work.model, lay)
        if len(set(counts)) > 1 and not lay.pp_layers and lay.pp_split == "even":
            out.append(f"{work.model.num_layers} layers do not split evenly over "
                       f"{len(counts)} stages: {list(counts)} (pp_split=balanced weighs the "
                       f"head and embedding too)")
    return out
