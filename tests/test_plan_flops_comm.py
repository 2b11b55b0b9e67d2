"""Planner FLOPs, training-time arithmetic, communication ledger and pipeline bubbles."""

import pytest

from fivefold.models.presets import preset
from fivefold.parallel.pipeline.check import peak_inflight, peak_pending_weights, simulate
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.plan.comm import collectives, ledger_volume, wire_volume
from fivefold.plan.flops import (
    forward_flops_per_token,
    hardware_flops_per_token,
    korthikanti_model_flops,
    model_flops_per_token,
    training_days,
    training_flops,
)
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.placement import (
    bubble_ratio,
    inflight_microbatches,
    inflight_per_chunk,
    pending_weight_passes,
)

# ---- FLOPs ------------------------------------------------------------------------------


def test_gpt3_style_82b_on_1024_a100s():
    """82B parameters, 150B tokens, 1,024 A100s: 2.67 days at the 312 TFLOPS peak with
    6·N·D; 16.36 days at 68 TFLOPS achieved with 8·N·D (full recomputation)."""
    peak = training_days(training_flops(82e9, 150e9), 1024, 312e12)
    assert peak == pytest.approx(2.6735, rel=1e-4)
    real = training_days(training_flops(82e9, 150e9, recompute="full"), 1024, 68e12)
    assert real == pytest.approx(16.36, rel=1e-3)
    assert round(real, 1) == 16.4


def test_model_flops_match_narayanan_for_gpt3():
    """72·B·s·L·h²·(1 + s/6h + V/12Lh) (Narayanan 2021 eq. 3 without recompute)."""
    model = preset("gpt3-175b")
    batch, seq = 1536, 2048
    ours = model_flops_per_token(model, seq) * batch * seq
    assert ours == pytest.approx(korthikanti_model_flops(model, batch, seq), rel=1e-12)
    # with full recomputation: 96·B·s·L·h²·(1 + s/6h + V/16Lh), the head not rerun (eq. 3)
    h, L, V = model.hidden_size, model.num_layers, model.vocab_size
    hardware = hardware_flops_per_token(model, seq, "full") * batch * seq
    assert hardware == pytest.approx(
        96 * batch * seq * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h)), rel=1e-12)


def test_6n_plus_attention_for_llama():
    """Per token: 6 × (weights a token passes through) + 12·L·s·q; embeddings and norms are
    free, the untied output head is not."""
    model = preset("llama-3.1-8b")
    counts = model.param_counts()
    norms = 2 * model.num_layers * model.hidden_size + model.hidden_size
    weights = model.num_params() - counts["embedding"] - norms
    s = 8192
    expected = 6 * weights + 12 * model.num_layers * s * model.q_size
    assert model_flops_per_token(model, s) == pytest.approx(expected, rel=1e-12)
    causal = model_flops_per_token(model, s, causal=True)
    assert expected - causal == pytest.approx(6 * model.num_layers * s * model.q_size, rel=1e-12)


def test_recompute_flops():
    model = preset("llama-3.1-70b")
    fwd = forward_flops_per_token(model, 4096)
    base = model_flops_per_token(model, 4096)
    full = hardware_flops_per_token(model, 4096, "full")
    assert full - base == pytest.approx(model.num_layers * fwd.layer, rel=1e-12)
    assert 0.30 < full / base - 1 < 1 / 3  # about a third more (the head is not rerun)
    sel = hardware_flops_per_token(model, 4096, "selective")
    assert sel / base - 1 == pytest.approx(model.num_layers * fwd.layer_attention / base, rel=1e-12)


# ---- communication ledger ---------------------------------------------------------------

LLAMA8 = preset("llama-3.1-8b")


def work(gbs=32, seq=4096, **kw):
    return Workload(LLAMA8, seq_len=seq, gbs=gbs, **kw)


def test_dp_ledger_once_per_step():
    n = LLAMA8.num_params()
    w = work(gbs=32)
    norm = 8  # ZeRO ≥ 1: one float64 all_reduce of the squared gradient-shard norm
    assert ledger_volume(w, Layout(dp=8, mbs=1)) == {"dp_cp": {"all_reduce": 2 * n}}
    z1 = ledger_volume(w, Layout(dp=8, zero=1))
    assert z1 == {"dp_cp": {"reduce_scatter": 2 * n, "all_gather": 2 * n, "all_reduce": norm}}
    z3 = ledger_volume(w, Layout(dp=8, zero=3))  # m = 4 micro-batches
    assert z3 == {"dp_cp": {"all_gather": 2 * 4 * 2 * n, "reduce_scatter": 2 * n,
                            "all_reduce": norm}}
    z3mb = ledger_volume(work(gbs=32, grad_sync="microbatch"), Layout(dp=8, zero=3))
    assert z3mb["dp_cp"]["reduce_scatter"] == 4 * 2 * n
    # cp ranks shard with dp; fp32 gradients travel as 4 bytes
    z1cp = ledger_volume(work(grad_dtype_bytes=4), Layout(dp=4, cp=2, zero=1))
    assert z1cp["dp_cp"] == {"reduce_scatter": 4 * n, "all_gather": 2 * n, "all_reduce": norm}


def test_dp_wire_bytes_ring():
    n = LLAMA8.num_params()
    assert wire_volume(work(), Layout(dp=8))["dp_cp"] == pytest.approx(2 * 7 / 8 * 2 * n)
    z1 = wire_volume(work(), Layout(dp=8, zero=1))["dp_cp"]
    assert z1 == pytest.approx(2 * 7 / 8 * 2 * n + 2 * 7 / 8 * 8)  # + the norm (float64)


def test_tp_ledger_per_layer_per_microbatch():
    b, s, h, L = 2, 4096, 4096, LLAMA8.num_layers
    w = work(gbs=16, seq=s)
    lay = Layout(dp=2, tp=4, mbs=b)  # m = 4
    layers = [c for c in collectives(w, lay) if c.group == "tp" and c.note == "layers"]
    assert sum(c.bytes for c in layers) == 4 * b * s * h * 2 * L * 4
    assert {c.op for c in layers} == {"all_reduce"}
    sp = [c for c in collectives(w, lay.replace(sp=True)) if c.group == "tp" and c.note == "layers"]
    ag = sum(c.bytes for c in sp if c.op == "all_gather")
    rs = sum(c.bytes for c in sp if c.op == "reduce_scatter")
    assert ag == rs == 4 * b * s * h * 2 * L * 4
    full = [c for c in collectives(w, lay.replace(recompute="full"))
            if c.group == "tp" and c.note == "layers"]
    # the forward runs twice, less the MLP's closing all-reduce (checkpoint stops early)
    assert sum(c.bytes for c in full) == 5 * b * s * h * 2 * L * 4


def test_pp_ledger_sends_and_recvs():
    b, s, h = 1, 4096, 4096
    w = work(gbs=16, seq=s)
    lay = Layout(dp=2, pp=4, mbs=b)  # m = 8
    msg = b * s * h * 2
    assert ledger_volume(w, lay, 0)["pp"] == {"send": 8 * msg, "recv": 8 * msg, "all_reduce": 8}
    assert ledger_volume(w, lay, 1)["pp"] == {"send": 16 * msg, "recv": 16 * msg, "all_reduce": 8}
    # interleaved, v = 2: rank 0 sends both chunks' outputs, receives one chunk's input
    inter = Layout(dp=2, pp=4, mbs=b, schedule="interleaved", virtual_stages=2)
    vol = ledger_volume(w, inter, 0)["pp"]
    assert vol == {"send": (2 + 1) * 8 * msg, "recv": (1 + 2) * 8 * msg, "all_reduce": 8}


def test_bubble_ratios():
    p, m = 8, 32
    assert bubble_ratio(Layout(pp=p), m) == pytest.approx(7 / 32)
    # as a share of the step: (p − 1)/(m + p − 1)
    r = bubble_ratio(Layout(pp=p, schedule="afab"), m)
    assert r / (1 + r) == pytest.approx(7 / 39)
    assert bubble_ratio(Layout(pp=p, schedule="interleaved", virtual_stages=4), m) == \
        pytest.approx(7 / 128)
    assert bubble_ratio(Layout(pp=p, schedule="zb"), m) == pytest.approx(7 / 96)
    assert bubble_ratio(Layout(pp=p, schedule="dualpipev"), m) == pytest.approx(7 / 192)
    assert bubble_ratio(Layout(pp=1), m) == 0


@pytest.mark.parametrize("schedule", ["afab", "1f1b", "interleaved", "zb", "dualpipev"])
def test_pipeline_closed_forms_equal_the_engines_schedules(schedule):
    """The planner's bubble, per-rank in-flight micro-batches and micro-batches waiting for
    their W are those of the schedules the engine runs: simulated with F = B = W (the
    planner's 1:2 forward:backward), the peak of stored (micro-batch, chunk) pairs the
    executor is tested to reach, and the peak of pairs between B and W."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            for v in ((2, 4) if schedule == "interleaved" else (1,)):
                if schedule == "dualpipev" and m < 2 * p:
                    continue
                sched = build_schedule(schedule, p, m, v)
                lay = Layout(pp=p, schedule=schedule, virtual_stages=v)
                r = bubble_ratio(lay, m)
                where = f"{schedule} p={p} m={m} v={v}"
                assert r / (1 + r) == pytest.approx(simulate(sched).bubble, rel=1e-9), where
                chunks = sched.num_stages // p  # chunks per rank: v, 2 for DualPipeV
                stored = [n / chunks for n in peak_inflight(sched)]
                assert [inflight_microbatches(lay, m, k) for k in range(p)] == stored, where
                # Micro-batches between their B and W (split backward), chunk by chunk.
                pending = [pending_weight_passes(lay, m, k) for k in range(p)]
                assert pending == peak_pending_weights(sched), where


def test_interleaved_uneven_chunks_peak_where_the_engines_order_does():
    """With chunks of unequal weight (an uneven pp_layers) the planner's per-chunk in-flight
    micro-batches give the heaviest moment of the engine's interleaved order: walked action
    by action, each F adding its chunk's weight and each B taking it off."""
    for p in (2, 3, 4):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p, 5 * p):
                sched = build_schedule("interleaved", p, m, v)
                lay = Layout(pp=p, schedule="interleaved", virtual_stages=v)
                for weights in ((1.0, 2.0, 2.0, 1.0)[:v], (5.0,) + (1.0,) * (v - 1),
                                (1.0,) * (v - 1) + (7.0,), tuple(range(1, v + 1))):
                    for rank in range(p):
                        held = peak = 0.0
                        for a in sched.compute_actions(rank):
                            held += weights[a.chunk] * (1 if a.kind == "F" else -1)
                            peak = max(peak, held)
                        alive = inflight_per_chunk(lay, m, rank, weights)
                        planned = sum(n * w for n, w in zip(alive, weights))
                        assert planned == peak, (p, v, m, weights, rank, alive)
