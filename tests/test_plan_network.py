"""The time terms that grow with scale (plan/network.py, plan/timing.py), the validated
ranges (plan/validated.py) and their bad inputs."""

import dataclasses
import math

import pytest

from fivefold.errors import ConfigError
from fivefold.models.presets import preset
from fivefold.plan.cli_entry import main
from fivefold.plan.comm import Collective, collectives
from fivefold.plan.hardware import CATALOG, Assumptions, get_hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.network import (
    blocked_host_s,
    call_latency_s,
    collective_time,
    ddp_pp_message_s,
    group_link,
    nccl_algorithms,
    ring_steps,
    tree_steps,
)
from fivefold.plan.placement import bubble_ratio
from fivefold.plan.report import explain_losses
from fivefold.plan.search import SearchSpace, search
from fivefold.plan.timing import step_time
from fivefold.plan.validated import CLOSE, RANGES, describe, rank_key

H100 = CATALOG["h100-sxm"]
US = 1e-6


def test_ring_latency_grows_with_ranks_and_pays_the_network_per_crossing_step():
    """A ring all-gather over n ranks takes n − 1 steps, nodes − 1 of them over the network
    (NCCL's tuning model); an all-reduce twice as many. tp 32 over 4 nodes: 31 steps, 3 at
    the network's latency, 28 at NVLink's, plus the call's own."""
    a = Assumptions()
    assert ring_steps("all_gather", 32, 4) == (31, 3)
    assert ring_steps("all_reduce", 32, 4) == (62, 6)
    assert ring_steps("send", 2, 2) == (1, 1)
    lay = Layout(tp=32)
    call = Collective("tp", "all_gather", 2, 1.0, 1, 32, "fwd")
    want = (a.base_latency_us + 28 * a.intra_latency_us + 3 * a.inter_latency_us) * US
    assert call_latency_s(call, H100, a, lay, True) == pytest.approx(want, rel=1e-12)
    # inside a node every step is NVLink's
    lay8 = Layout(tp=8)
    call8 = Collective("tp", "all_gather", 2, 1.0, 1, 8, "fwd")
    assert call_latency_s(call8, H100, a, lay8, False) == pytest.approx(
        (a.base_latency_us + 7 * a.intra_latency_us) * US, rel=1e-12)


def test_nccl_takes_the_tree_for_a_small_all_reduce_over_many_nodes():
    """dp 128 over 128 nodes: a one-element all-reduce's ring pays 254 network steps, the
    tree 2·log2(128) = 14 at 0.9 of the ring's bandwidth (NCCL's model), so a small call
    takes the tree and a large one the ring. Inside a node NCCL weighs the ring alone."""
    a = Assumptions()
    assert nccl_algorithms("all_reduce", True) == ("ring", "tree")
    assert nccl_algorithms("all_reduce", False) == ("ring",)
    assert nccl_algorithms("all_gather", True) == ("ring",)
    assert tree_steps(128, 128) == (14, 14)
    lay = Layout(dp=128, tp=8)
    tiny = Collective("dp_cp", "all_reduce", 4, 1.0, 1, 128, "step")
    tree = call_latency_s(tiny, H100, a, lay, True, "tree")
    ring = call_latency_s(tiny, H100, a, lay, True, "ring")
    assert tree < ring / 10
    bw, inter = group_link(H100, lay, "dp_cp", a)
    assert inter
    assert collective_time(tiny, H100, a, lay) == pytest.approx(
        tiny.wire_bytes / (0.9 * bw * a.bandwidth_efficiency) + tree, rel=1e-12)
    # 1 GB: the ring's latency is small beside the tree's 10% less bandwidth
    big = Collective("dp_cp", "all_reduce", 4, 2.5e8, 1, 128, "grad")
    assert collective_time(big, H100, a, lay) == pytest.approx(
        big.wire_bytes / (bw * a.bandwidth_efficiency) + ring, rel=1e-12)


def test_spine_contention_only_past_a_leaf_group():
    """A dp group over 16 nodes under leaves of 8 nodes crosses the spine: its NIC share
    falls by the oversubscription, and each step waits the spine's latency; under leaves of
    32 (the default) nothing changes."""
    lay = Layout(dp=16, tp=8)
    hw32, a = H100, Assumptions(spine_oversubscription=2.0, spine_latency_us=5.0)
    hw8 = dataclasses.replace(H100, leaf_nodes=8)
    inside, _ = group_link(hw32, lay, "dp_cp", a)
    crossing, _ = group_link(hw8, lay, "dp_cp", a)
    assert crossing == pytest.approx(inside / 2, rel=1e-12)
    call = Collective("dp_cp", "all_gather", 2, 1.0, 1, 16, "step")
    extra = call_latency_s(call, hw8, a, lay, True) - call_latency_s(call, hw32, a, lay, True)
    assert extra == pytest.approx(15 * 5.0 * US, rel=1e-9)  # 15 network steps, 5 µs each


def test_stragglers_add_the_expected_maximum_of_n_ranks():
    """σ·√(2 ln N) of compute + bubble, N the world size; nothing with σ = 0."""
    work = Workload(preset("llama-3.2-1b"), seq_len=2048, gbs=64)
    lay = Layout(dp=16, tp=2)
    hw, a = get_hardware("h100")
    plain = step_time(work, lay, hw, a)
    assert plain.straggler == 0.0
    t = step_time(work, lay, hw, dataclasses.replace(a, straggler_sigma=0.03))
    assert t.straggler == pytest.approx(
        (plain.compute + plain.bubble) * 0.03 * math.sqrt(2 * math.log(32)), rel=1e-12)
    assert t.total == pytest.approx(plain.total + t.straggler, rel=1e-12)


def test_pipeline_messages_wait_in_the_bubble():
    """A fixed time per pipeline message adds to the exposed pp time and, through the fill
    and drain, (p − 1)/m of it again in the bubble (even 1F1B stages)."""
    work = Workload(preset("llama-3.2-1b"), seq_len=2048, gbs=32)
    lay = Layout(dp=2, pp=4, schedule="1f1b")
    hw, a = get_hardware("h100")
    m = work.num_microbatches(lay)
    base = step_time(work, lay, hw, a)
    slow = step_time(work, lay, hw, dataclasses.replace(a, pp_message_ms=5.0))
    d_pp = slow.pp_comm - base.pp_comm
    assert d_pp > 0
    assert slow.bubble - base.bubble == pytest.approx(bubble_ratio(lay, m) * d_pp, rel=1e-6)


def test_tp_waits_under_a_blocking_pipeline_are_host_time():
    """pp_blocking_latency_us: every ring step of a TP call holds the host under pp > 1 for
    the slowest of the world's ranks, σ·√(2 ln N) (`blocked_host_s`), never at pp = 1,
    never for another group, and never as the call's latency on the GPU."""
    a = Assumptions(pp_blocking_latency_us=100.0)
    call = Collective("tp", "all_gather", 2, 1.0, 3, 8, "fwd")
    assert blocked_host_s(call, a, Layout(tp=8, pp=2)) == pytest.approx(
        3 * 7 * 100 * US * math.sqrt(2 * math.log(16)), rel=1e-12)
    # the slowest of more ranks: four times the world, √(ln 64 / ln 16) = √1.5 the wait
    assert blocked_host_s(call, a, Layout(dp=4, tp=8, pp=2)) == pytest.approx(
        blocked_host_s(call, a, Layout(tp=8, pp=2)) * math.sqrt(1.5), rel=1e-12)
    assert blocked_host_s(call, a, Layout(tp=8)) == 0.0
    dp = Collective("dp_cp", "all_gather", 2, 1.0, 1, 8, "fwd")
    assert blocked_host_s(dp, a, Layout(dp=8, pp=2)) == 0.0
    assert call_latency_s(call, H100, a, Layout(tp=8, pp=2), False) == pytest.approx(
        call_latency_s(call, H100, Assumptions(), Layout(tp=8, pp=2), False), rel=1e-12)


def test_blocked_waits_show_only_beyond_the_gpus_work():
    """A micro-batch takes the longer of the GPU's work and the host's: waits far below the
    GPU's time change nothing; waits far above it set the step's compute + TP time to the
    slowest rank's host time, the waits themselves (host_layer_ms = 0)."""
    from fivefold.plan.comm import collectives

    work = Workload(preset("llama-3.2-1b"), seq_len=2048, gbs=32)
    lay = Layout(dp=2, tp=4, pp=2, sp=True, schedule="1f1b")
    hw, a = get_hardware("h100")
    base = step_time(work, lay, hw, a)
    hidden = step_time(work, lay, hw, dataclasses.replace(a, pp_blocking_latency_us=1e-3))
    assert hidden.tp_comm == base.tp_comm and hidden.total == base.total
    big = dataclasses.replace(a, pp_blocking_latency_us=1e5)
    slow = step_time(work, lay, hw, big)
    waits = max(sum(blocked_host_s(c, big, lay) for c in collectives(work, lay, r))
                for r in range(lay.pp))
    assert waits > 10 * base.total
    assert slow.compute + slow.tp_comm == pytest.approx(waits, rel=1e-9)


def test_validated_range_of_the_usp_file():
    """The nanotron range is what the ok runs of bench/data/usp-calibration.csv cover (GPU
    counts, nodes, largest tp and pp, no cp): the runs whose throughput was scored."""
    import csv
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "data" / "usp-calibration.csv"
    rows = [r for r in csv.DictReader(open(path)) if r["status"] == "ok"]
    rng = RANGES["nanotron"]
    gpus = sorted({int(r["n_gpus"]) for r in rows})
    assert rng.gpus == (gpus[0], gpus[-1])
    assert rng.nodes == (min(int(r["nodes"]) for r in rows), max(int(r["nodes"]) for r in rows))
    assert rng.tp == max(int(r["tp"]) for r in rows)
    assert rng.pp == max(int(r["pp"]) for r in rows)


def test_plan_at_512_gpus_says_where_it_lies_outside(capsys):
    """`fivefold plan` of an 8B model on 512 H100s (nanotron's convention) prints the range
    its runs covered and that 512 GPUs on 64 nodes lie beyond it."""
    code = main(["--model", "llama-3.1-8b", "--gpus", "512", "--gpu", "h100", "--convention",
                 "nanotron", "--layout", "dp=64,tp=8,pp=1,mbs=1,zero=1", "--seq-len", "4096",
                 "--gbs", "256"])
    out = capsys.readouterr().out
    assert code == 0
    assert "validated range (nanotron convention): 16-128 GPUs (2-16 nodes)" in out
    assert "outside it: 512 GPUs above the 16-128 GPUs validated; 64 nodes above 2-16" in out
    import json

    main(["--model", "llama-3.1-8b", "--gpus", "512", "--gpu", "h100", "--convention",
          "nanotron", "--layout", "dp=64,tp=8,pp=1,mbs=1,zero=1", "--seq-len", "4096",
          "--gbs", "256", "--json", "-"])
    got = json.loads(capsys.readouterr().out)["validated"]
    assert got["outside"] == ["512 GPUs above the 16-128 GPUs validated", "64 nodes above 2-16"]
    lines = describe("nanotron", Layout(dp=8, tp=16), 8)
    assert lines[1] == "this plan lies inside it"


def test_search_prefers_the_validated_range_when_close(monkeypatch):
    """rank_key raises a layout outside the range by CLOSE. An 8B model on 16 H100s of
    40 GiB: the fastest layouts use cp 2; with a range of cp ≤ 1 the best layout without
    cp ranks first when it is within CLOSE of the fastest (here 5.5% slower: within 10%,
    not within 5%), and otherwise the fastest stays first."""
    import fivefold.plan.validated as validated

    rng = dataclasses.replace(RANGES["torchtitan"], cp=1)
    assert rank_key(1.0, Layout(cp=2), rng) == pytest.approx(1 + CLOSE)
    assert rank_key(1.0, Layout(tp=8), rng) == 1.0
    hw, a = get_hardware("h100", {"memory_gib": 40})
    work = Workload(preset("llama-3.1-8b"), seq_len=4096, gbs=64)
    free = search(work, 16, hw, a, SearchSpace(zero=(1,), max_mbs=4), top=3).top[0]
    inside = search(work, 16, hw, a, SearchSpace(zero=(1,), max_mbs=4, cp=(1,)), top=3).top[0]
    assert free.layout.cp > 1 and inside.layout.cp == 1
    ratio = inside.time.total / free.time.total
    assert 1.05 < ratio < 1.10
    for close, want in ((0.05, free), (0.10, inside)):
        monkeypatch.setattr(validated, "CLOSE", close)
        result = search(work, 16, hw, a, SearchSpace(zero=(1,), max_mbs=4, validated=rng),
                        top=20)
        assert result.top[0].layout == want.layout, close
    # the report says why a faster layout ranks below the chosen one
    lines = explain_losses(result, count=len(result.top))
    assert any(line.startswith(free.layout.short()) and "faster, but outside the validated "
               "range (cp 2 > 1), so not preferred within 10%" in line for line in lines), lines


def test_search_avoids_an_uncertain_regime_when_close():
    """nanotron's range names DDP pipelines (ZeRO-0, dp > 1, pp > 1) an uncertain regime:
    rank_key raises them by CLOSE, as it raises a layout outside the range, once for both.
    The Playbook's 3B model on 16 H100s (bench/data/usp-calibration.csv): by time alone
    the search ranks dp 8 pp 2 ZeRO-0 first (planned 17,499 tokens/s, measured 3,230);
    with the range, dp 16 ZeRO-1 (1.4% slower planned, measured 16,385) ranks first, and
    the report says why the faster one ranks below."""
    from fivefold.models.presets import ModelConfig
    from fivefold.plan.conventions import get_convention

    rng = RANGES["nanotron"]
    assert rank_key(1.0, Layout(dp=8, pp=2, zero=0), rng) == pytest.approx(1 + CLOSE)
    assert rank_key(1.0, Layout(dp=8, pp=2, zero=0, cp=2), rng) == pytest.approx(1 + CLOSE)
    for fine in (Layout(dp=8, pp=2, zero=1), Layout(dp=16, zero=0), Layout(pp=16, zero=0)):
        assert rank_key(1.0, fine, rng) == 1.0, fine
    assert all(not (r and r.uncertain) for name, r in RANGES.items() if name != "nanotron")
    conv = get_convention("nanotron")
    model = ModelConfig(name="usp-3B", vocab_size=131072, hidden_size=3072,
                        intermediate_size=8192, num_layers=28, num_heads=32, num_kv_heads=32,
                        max_seq_len=4096, tie_embeddings=True)
    work = conv.apply_workload(Workload(model=model, seq_len=4096, gbs=256))
    hw, a = get_hardware("h100-sxm", {"memory_gib": 79.6})
    a = conv.apply_assumptions(a, {"memory_gib"})
    fixed = {k: v for k, v in conv.layout.items() if k != "zero"}
    tops = {}
    for name, r in (("time", None), ("range", rng)):
        space = SearchSpace(tp=(1,), pp=(1, 2), cp=(1,), zero=(0, 1), mbs=(1,),
                            recompute=("none",), schedule=("1f1b",), fixed=fixed, validated=r)
        tops[name] = search(work, 16, hw, a, space, top=4)
    first = tops["time"].top[0]
    assert (first.layout.dp, first.layout.pp, first.layout.zero) == (8, 2, 0)
    best = tops["range"].top[0]
    assert (best.layout.dp, best.layout.pp, best.layout.zero) == (16, 1, 1)
    assert 1 < first.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu < 1 + CLOSE
    lines = explain_losses(tops["range"], count=len(tops["range"].top))
    assert any(line.startswith(first.layout.short()) and "in a regime the validation found "
               "uncertain (ZeRO-0 with dp > 1 and pp > 1" in line for line in lines), lines
    said = describe("nanotron", first.layout, 8)
    assert said[1] == "this plan lies inside it"
    assert said[2].startswith("its regime, ZeRO-0 with dp > 1 and pp > 1")
    assert len(describe("nanotron", best.layout, 8)) == 2


@pytest.mark.parametrize("args, says", [
    (["--convention", "nemo"], "--convention 'nemo' is unknown"),
    (["--hw", "spine_oversubscription=0.5"], "spine_oversubscription=0.5 must be"),
    (["--hw", "inter_latency_us=-1"], "inter_latency_us=-1 must be"),
    (["--hw", "straggler_sigma=-0.1"], "straggler_sigma=-0.1 must be"),
    (["--hw", "leaf_nodes=2.5"], "leaf_nodes='2.5' is not a number"),
    (["--hw", "memory_gib=-1"], "memory_gib=-1 must be"),
    (["--hw", "inter_node_gbps=0"], "inter_node_gbps=0 must be"),
    (["--hw", "base_latency_us=-0.5"], "base_latency_us=-0.5 must be"),
    (["--hw", "intra_latency_us=nan"], "intra_latency_us=nan must be"),
    # the budget left to plan into would be negative: 80 - 1.5 - 90, 1 - 1.5, and 5 - 1.5
    # less the nanotron convention's own fitted headroom (4.5 GiB)
    (["--hw", "memory_headroom_gib=90"], "leaves -11.5 GiB to plan"),
    (["--hw", "memory_gib=1"], "leaves -0.5 GiB to plan"),
    (["--convention", "nanotron", "--hw", "memory_gib=5"], "leaves -1 GiB to plan"),
])
def test_bad_convention_or_negative_term_is_one_line_exit_2(args, says, capsys):
    code = main(["--model", "llama-3.2-1b", "--gpus", "8", *args])
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert code == 2 and out == ""  # refused before anything is planned or printed
    assert len(err) == 1 and says in err[0], err


def test_tp_steps_between_nodes_pay_the_engines_fitted_step_time():
    """tp_inter_step_us: a TP call's node-crossing ring steps take that much longer each
    (nodes − 1 of an all-gather: 1 for tp 16 over two nodes, 3 for tp 32 over four, 2·3 of
    an all-reduce); steps inside a node and other groups' calls are untouched, and at the
    default 0 nothing moves."""
    a = Assumptions()
    slow = dataclasses.replace(a, tp_inter_step_us=150.0)
    for tp, nodes in ((16, 2), (32, 4)):
        lay = Layout(dp=128 // tp, tp=tp)
        for op, crossings in (("all_gather", nodes - 1), ("all_reduce", 2 * (nodes - 1))):
            call = Collective("tp", op, 2, 1.0, 1, tp, "fwd")
            assert call_latency_s(call, H100, slow, lay, True) - call_latency_s(
                call, H100, a, lay, True) == pytest.approx(crossings * 150 * US, rel=1e-9)
    inside = Collective("tp", "all_gather", 2, 1.0, 1, 8, "fwd")
    assert call_latency_s(inside, H100, slow, Layout(dp=16, tp=8), False) == call_latency_s(
        inside, H100, a, Layout(dp=16, tp=8), False)
    dp = Collective("dp_cp", "all_gather", 2, 1.0, 1, 16, "fwd")
    assert call_latency_s(dp, H100, slow, Layout(dp=16), True) == call_latency_s(
        dp, H100, a, Layout(dp=16), True)
    work = Workload(preset("llama-3.2-1b"), seq_len=2048, gbs=64)
    lay = Layout(dp=2, tp=16, sp=True)
    hw, base = get_hardware("h100")
    assert step_time(work, lay, hw, base).total == step_time(
        work, lay, hw, dataclasses.replace(base, tp_inter_step_us=0.0)).total
    assert step_time(work, lay, hw, dataclasses.replace(base, tp_inter_step_us=150.0)
                     ).tp_comm > step_time(work, lay, hw, base).tp_comm


def test_ddp_pipeline_messages_hold_the_host_each_in_turn():
    """ddp_pp_message_ms: under DDP (ZeRO-0, dp > 1) each of a pipeline rank's sends and
    receives holds the host that long, one after the other: per micro-batch 2 on the first
    and last stage, 4 on an interior one, which then paces the pipeline. ZeRO-1, dp = 1 and
    the default 0 move nothing."""
    work = Workload(preset("llama-3.2-1b"), seq_len=2048, gbs=64)
    hw, base = get_hardware("h100")
    held = dataclasses.replace(base, ddp_pp_message_ms=300.0)
    for pp, inner in ((2, 2), (4, 4)):
        lay = Layout(dp=4, pp=pp, zero=0, mbs=1, schedule="1f1b")
        m = work.num_microbatches(lay)
        per_rank = [sum(ddp_pp_message_s(c, held, lay) for c in collectives(work, lay, r))
                    for r in range(pp)]
        assert per_rank[0] == per_rank[-1] == pytest.approx(2 * m * 0.3, rel=1e-12)
        assert max(per_rank) == pytest.approx(inner * m * 0.3, rel=1e-12)
        plain, slow = step_time(work, lay, hw, base), step_time(work, lay, hw, held)
        assert inner * m * 0.3 <= slow.pp_comm <= inner * m * 0.3 + 2 * plain.pp_comm
        assert step_time(work, lay, hw, dataclasses.replace(
            base, ddp_pp_message_ms=0.0)).total == plain.total
        for other in (lay.replace(zero=1), lay.replace(dp=1)):
            assert step_time(work, other, hw, held).total == step_time(
                work, other, hw, base).total
    with pytest.raises(ConfigError):
        get_hardware("h100", {"ddp_pp_message_ms": -1.0})


def test_tp_calls_run_in_the_gpus_idle_time_under_a_host_bound_micro_batch():
    """An eager engine's host time per layer (`host_layer_ms`) floors a micro-batch's
    forward and backward; the TP calls the host queued run while the GPU would idle there
    (`RankCompute.host_slack`), so they show only beyond that slack: a micro-batch takes the
    longer of the host's time and the GPU's work with its TP calls. Without host time the
    step is as before; with a host far above the GPU's work it hides the TP calls whole."""
    from fivefold.plan.timing import rank_compute

    work = Workload(preset("llama-3.2-1b"), seq_len=2048, gbs=32)
    lay = Layout(dp=2, tp=4, sp=True)
    hw, a = get_hardware("h100")
    m, layers = work.num_microbatches(lay), work.model.num_layers
    gpu = rank_compute(work, lay, hw, a, 0)
    assert gpu.host_slack == 0.0
    base = step_time(work, lay, hw, a)
    tp_mb = base.tp_comm / m
    assert tp_mb > 0 and base.compute == pytest.approx(m * (gpu.forward + gpu.backward))
    shown = []
    for host_mb in (gpu.forward + gpu.backward + tp_mb / 2,
                    3 * (gpu.forward + gpu.backward + tp_mb)):
        h = dataclasses.replace(a, host_layer_ms=host_mb / layers * 1e3)
        fwd, bwd = max(gpu.forward, host_mb / 3), max(gpu.backward, 2 * host_mb / 3)
        slack = fwd + bwd - gpu.forward - gpu.backward
        assert rank_compute(work, lay, hw, h, 0).host_slack == pytest.approx(slack, rel=1e-12)
        t = step_time(work, lay, hw, h)
        assert t.compute == pytest.approx(m * (fwd + bwd), rel=1e-12)
        assert t.tp_comm == pytest.approx(m * max(0.0, tp_mb - slack), rel=1e-9, abs=1e-15)
        shown.append(t.tp_comm)
    assert 0 < shown[0] < base.tp_comm  # a host just above the GPU's work hides part
    # the host far above: the step's compute and TP are the host's time alone
    assert t.tp_comm == 0.0 and t.compute == pytest.approx(m * host_mb, rel=1e-12)
