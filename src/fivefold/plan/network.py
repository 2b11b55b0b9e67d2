"""The network's terms: the time of one collective as a pure function of the call, the
layout and the hardware.

Each term, what it is and where its value comes from:
- bandwidth: the group's link (NVLink inside a node; across nodes the NICs of the members a
  node holds as far as `inter_node_rails` says, `rail_gbps`), at `bandwidth_efficiency`;
- spine contention (`spine_gbps`): a group whose members sit under more than `leaf_nodes`
  nodes crosses the spine switches, whose uplinks are `spine_oversubscription` times
  fewer than the leaves' downlinks, so each node's share falls by that factor while every
  group of the job crosses at once (a two-tier leaf-spine fat tree; oversubscription 1 is
  non-blocking, the default);
- latency (`call_latency_s`), as NCCL's own tuning model counts it (src/graph/tuning.cc):
  a fixed time per call, and a ring's all-gather or reduce-scatter takes n − 1 steps and
  its all-reduce 2(n − 1) (Patarasuk & Yuan 2009), of which those between nodes
  (nodes − 1, or twice that) pay the network's hop latency (`inter_latency_us`, plus
  `spine_latency_us` once the group leaves a leaf) and the rest NVLink's; across nodes
  NCCL may run an all-reduce as a tree instead, 2·log2(nodes) network steps, and picks
  whichever its model says is faster (`nccl_algorithms`); point-to-point messages take
  one step. Under a pipeline whose engine blocks the host on its messages, every step of a
  TP call holds the host until the slowest of the job's N ranks gets there,
  `pp_blocking_latency_us`·√(2 ln N) (`blocked_host_s`; fitted per engine, 0 for the engine
  itself): host time, which shows only where it outlasts the GPU's work.
  Inside a node, calibrate's measured call times replace the latency and bandwidth where a
  profile has them.
"""

from __future__ import annotations

import math

from fivefold.plan.comm import Collective
from fivefold.plan.hardware import (
    Assumptions,
    Hardware,
    profile_bus_gbps,
    profile_call_s,
    profile_latency_s,
)
from fivefold.plan.layout import Layout, log2_ceil

STAGE_DIMS = ("dp", "cp", "tp")  # the `stage` group: the ranks of one pipeline stage
DP_GROUPS = ("dp", "dp_cp", "edp", "pp_embed")  # bucketed: reduced in bucket-sized calls
# A tree all-reduce's bus bandwidth against the ring's: NCCL's model takes 0.9 of it
# (src/graph/tuning.cc: `busBw*.9` for the tree algorithm).
TREE_BANDWIDTH = {"tree": 0.9}


def group_shape(layout: Layout, group: str) -> tuple[int, int]:
    """(size, stride) of a group in the rank grid, ranks placed in `layout.rank_order`
    (tp fastest, then cp, dp, pp for the engine; Layout.stride). EP groups are carved from cp
    first, then dp. dp × cp spans the farther of the two dimensions; its members sit the
    nearer one's stride apart. pp: two neighbours one pp step apart. stage: one pipeline
    stage's dp × cp × tp ranks (delayed FP8 scaling's amax records), its nearest
    dimension's stride apart."""
    lay = layout
    if group == "stage":
        return lay.dp * lay.cp * lay.tp, min([lay.stride(d) for d in STAGE_DIMS
                                              if getattr(lay, d) > 1] or [1])
    if group == "tp":
        return lay.tp, lay.stride("tp")
    if group == "cp":
        return lay.cp, lay.stride("cp")
    if group == "pp":
        return 2, lay.stride("pp")
    if group == "pp_embed":
        return lay.pp, lay.stride("pp")
    if group == "ep" and lay.ep <= lay.cp:
        return lay.ep, lay.stride("cp")
    size = lay.dp * lay.cp
    stride = min([lay.stride(d) for d in ("dp", "cp") if getattr(lay, d) > 1] or [1])
    return size, stride


def group_span(hw: Hardware, layout: Layout, group: str) -> int:
    """Ranks a group's stretch of the grid covers: size × stride (a group that starts
    anywhere in a node stays inside it only when that many ranks do); dp × cp from its
    first rank to the end of its farther dimension."""
    lay = layout
    if group in ("dp", "dp_cp", "edp", "stage") or (group == "ep" and lay.ep > lay.cp):
        dims = STAGE_DIMS if group == "stage" else ("dp", "cp")
        return max(lay.stride(d) * getattr(lay, d) if getattr(lay, d) > 1 else 1
                   for d in dims)
    size, stride = group_shape(layout, group)
    return size * stride


def group_nodes(hw: Hardware, layout: Layout, group: str) -> int:
    """Nodes a group's members spread over, first to last (its ranks placed in order)."""
    return max(1, math.ceil(group_span(hw, layout, group) / hw.gpus_per_node))


def crosses_spine(hw: Hardware, layout: Layout, group: str) -> bool:
    """Whether a group's members sit under more leaf switches than one (`hw.leaf_nodes`
    nodes per leaf; 0: one switch tier, no spine)."""
    return hw.leaf_nodes > 0 and group_nodes(hw, layout, group) > hw.leaf_nodes


def rail_gbps(hw: Hardware, assume: Assumptions | None, size: int, stride: int) -> float:
    """GB/s per GPU of a group of `size` ranks `stride` apart that crosses nodes. With one NIC
    per GPU (DGX H100: 8×400 Gb/s), NCCL spreads a collective's channels over the NICs of
    the group's members, and a ring that spans nodes sends only its node-crossing hops
    over them: the traffic between two nodes can use the NICs of every member a node
    holds, not one. How much of that a run gets is `inter_node_rails` (fitted per engine:
    1 every member's NIC, 0 one NIC per GPU, the planner's default); never above the
    NVLink bandwidth inside the node."""
    node = hw.gpus_per_node
    members = max(1, min(size, node // stride)) if stride < node else 1
    rails = assume.inter_node_rails if assume is not None else 0.0
    return min(hw.intra_node_gbps, (1 + rails * (members - 1)) * hw.inter_node_gbps)


def spine_share(hw: Hardware, assume: Assumptions | None, layout: Layout, group: str) -> float:
    """The share of a node's NIC bandwidth a group gets when it crosses the spine: every
    group of the job crosses it at once, so the leaves' uplinks, `spine_oversubscription`
    times fewer than their downlinks, give each node 1/oversubscription of its NICs."""
    if assume is None or not crosses_spine(hw, layout, group):
        return 1.0
    return 1.0 / assume.spine_oversubscription


def group_link(hw: Hardware, layout: Layout, group: str,
               assume: Assumptions | None = None) -> tuple[float, bool]:
    """(bytes/s per GPU, crosses nodes) for a group: NVLink inside a node; across nodes
    its members' NICs in a node as `assume.inter_node_rails` says (`rail_gbps`), less the
    spine's share when it crosses the spine (`spine_share`)."""
    size, stride = group_shape(layout, group)
    if group_span(hw, layout, group) <= hw.gpus_per_node:
        return hw.intra_node_gbps * 1e9, False
    return rail_gbps(hw, assume, size, stride) * 1e9 * spine_share(hw, assume, layout,
                                                                   group), True


def ring_steps(op: str, n: int, nodes: int = 1) -> tuple[int, int]:
    """(steps, of which cross nodes) of one call of a ring over n ranks on `nodes` nodes
    (Patarasuk & Yuan 2009; NCCL's tuning model, src/graph/tuning.cc): all-reduce
    2(n − 1) steps, 2(nodes − 1) of them over the network; all-gather, reduce-scatter and
    all-to-all n − 1, nodes − 1 over the network; point-to-point one."""
    if op in ("send", "recv"):
        return 1, int(nodes > 1)
    if n <= 1:
        return 0, 0
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (nodes - 1)
    return n - 1, nodes - 1


def tree_steps(n: int, nodes: int) -> tuple[int, int]:
    """(steps, of which cross nodes) of an all-reduce as NCCL's trees: a chain through each
    node's ranks and a binary tree over the nodes, up then down: 2·(n/nodes − 1) steps in
    a node and 2·log2(nodes) across (NCCL's tuning model, src/graph/tuning.cc)."""
    inter = 2 * log2_ceil(nodes)
    return 2 * max(0, n // max(nodes, 1) - 1) + inter, inter


def hop_latency_s(hw: Hardware, assume: Assumptions, layout: Layout, group: str,
                  inter: bool) -> float:
    """Seconds per step of a collective of `group`: NVLink's inside a node, a NIC's across
    nodes, plus a spine switch's once the group leaves a leaf, plus, for a TP call,
    `tp_inter_step_us` (fitted per engine: the time its node-crossing steps take beyond
    the network's hop, 0 for the engine itself)."""
    if not inter:
        return assume.intra_latency_us * 1e-6
    spine = assume.spine_latency_us if crosses_spine(hw, layout, group) else 0.0
    tp = assume.tp_inter_step_us if group == "tp" else 0.0
    return (assume.inter_latency_us + spine + tp) * 1e-6


def nccl_algorithms(op: str, inter: bool) -> tuple[str, ...]:
    """The algorithms NCCL weighs for a call: the ring always; the tree for an all-reduce
    over nodes (NCCL's tree algorithm exists for all-reduce alone); it runs the one its
    model says is faster."""
    return ("ring", "tree") if op == "all_reduce" and inter else ("ring",)


def call_latency_s(c: Collective, hw: Hardware, assume: Assumptions, layout: Layout,
                   inter: bool, algorithm: str = "ring") -> float:
    """Seconds of latency of one call of `c` under `algorithm`: a fixed time per call
    (`base_latency_us`) and each step's hop (`ring_steps`, `tree_steps`): NVLink's in a
    node, the network's (and the spine's) across; or calibrate's measured call latency
    inside a node."""
    if not inter and c.op not in ("send", "recv"):
        measured = profile_latency_s(hw, c.group_size)
        if measured:
            return measured
    nodes = group_nodes(hw, layout, c.group) if inter else 1
    nodes = min(nodes, c.group_size)
    steps, across = (tree_steps(c.group_size, nodes) if algorithm == "tree"
                     else ring_steps(c.op, c.group_size, nodes))
    base = 0.0 if c.op in ("send", "recv") else assume.base_latency_us * 1e-6
    return (base + (steps - across) * assume.intra_latency_us * 1e-6
            + across * hop_latency_s(hw, assume, layout, c.group, True))


def blocked_host_s(c: Collective, assume: Assumptions, layout: Layout) -> float:
    """Host seconds all calls of `c` in a step hold the host under a pipeline whose engine
    blocks it on its point-to-point messages: per ring step of a TP call, the wait for the
    slowest of the job's N ranks, `pp_blocking_latency_us`·√(2 ln N) (the spread of a
    rank's time per step, fitted per engine; 0 for the engine itself; the blocking couples
    every rank's host to its pipeline neighbours', and through them and the TP rings to
    the rest). They are the host's, not the GPU's: the GPU runs its queued kernels
    meanwhile, so they show only where the host's time per micro-batch passes the GPU's
    (`timing._blocked_exposed`)."""
    if layout.pp == 1 or c.group != "tp" or not assume.pp_blocking_latency_us:
        return 0.0
    return (c.calls * ring_steps(c.op, c.group_size)[0] * assume.pp_blocking_latency_us * 1e-6
            * expected_max_normal(layout.world_size))


def expected_max_normal(n: int) -> float:
    """√(2 ln n): how many standard deviations the slowest of n ranks lies above their mean
    (the expected maximum of n normal variables, to leading order; Cramér 1946 §28.6); 0
    for one rank."""
    return math.sqrt(2 * math.log(n)) if n > 1 else 0.0


def collective_time(c: Collective, hw: Hardware, assume: Assumptions, layout: Layout,
                    bucket_bytes: float = 0.0) -> float:
    """Seconds for all of a collective's calls in a step: wire bytes at the group's bus
    bandwidth plus each call's latency (per bucket when bucketed), under the algorithm
    NCCL would pick (the faster); inside a node, a profile that swept message sizes
    (`call_us`) gives each call's time at its size instead."""
    bw, inter = group_link(hw, layout, c.group, assume)
    calls = c.calls
    if bucket_bytes:
        calls = max(c.calls, c.bytes / bucket_bytes)
    swept = None if inter or not calls else profile_call_s(hw, c.op, c.group_size,
                                                            c.bytes / calls)
    if swept is not None:  # calibrate timed calls of this size: latency and bytes in one
        return calls * swept
    measured = None if inter else profile_bus_gbps(hw, c.op, c.group_size)
    if measured:  # bus bandwidth as calibrate measured it inside a node: efficiency included
        bw = measured * 1e9 / assume.bandwidth_efficiency
    wire = c.wire_bytes / (bw * assume.bandwidth_efficiency)
    return min(wire / TREE_BANDWIDTH.get(algo, 1.0)
               + calls * call_latency_s(c, hw, assume, layout, inter, algo)
               for algo in nccl_algorithms(c.op, inter))


def call_time(c: Collective, hw: Hardware, assume: Assumptions, layout: Layout,
              bucket_bytes: float) -> float:
    """`collective_time` of one of a rank's collectives as a step pays it: the gradient
    groups' in buckets; a pipeline message duplex (send ∥ recv), each with its fixed
    overhead (`assume.pp_message_ms`), and, under DDP, each message's hold on the host
    (`ddp_pp_message_s`)."""
    if c.group == "pp":
        return ((collective_time(c, hw, assume, layout)
                 + c.calls * assume.pp_message_ms * 1e-3) / 2
                + ddp_pp_message_s(c, assume, layout))
    return collective_time(c, hw, assume, layout, bucket_bytes if c.group in DP_GROUPS else 0.0)


def ddp_pp_message_s(c: Collective, assume: Assumptions, layout: Layout) -> float:
    """Seconds a rank's pipeline sends or receives (`c`) hold the host in a step when
    ZeRO-0 trains data parallel under DDP: `ddp_pp_message_ms` per message, not halved
    as a duplex pair is, since an engine that passes one blocking message at a time
    (nanotron: parallel/pipeline_parallel/state.py `run_communication`, p2p.py
    `send_tensors`, `recv_tensors`) waits on each in turn: 2 per micro-batch on the first
    and last stage, 4 in between. Fitted per engine (the wait's size is not in the code);
    0 for the engine itself, and where there is no DDP (ZeRO ≥ 1, dp = 1)."""
    if (c.group != "pp" or c.op not in ("send", "recv") or layout.zero != 0
            or layout.dp == 1 or not assume.ddp_pp_message_ms):
        return 0.0
    return c.calls * assume.ddp_pp_message_ms * 1e-3
