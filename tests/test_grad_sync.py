"""ZeRO-2/3 with `parallel.grad_sync = "microbatch"`: every micro-batch's gradients are
reduce-scattered into the shard as backward produces them (parallel/data.py).

Checked against the single-process run over 4 micro-batches per rank (the float32 error
model's tolerances, tests/tolerances.py), with the bytes the rank holds probed at every
point a peak can occur (no gradient is ever whole, only the shard and at most k buckets)
and the ledger's reduce-scatter count (m per bucket per step, against 1 with `step`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from test_data_parallel import LR, SEQ, assert_close_run, build, final_params, make_cfg
from tolerances import loss_rtol, trained_rtol

from fivefold.parallel.peak import PeakTracker

GBS, MICRO, STEPS = 16, 4, 3
# tests/tolerances.py at GBS·SEQ tokens per step, 4 blocks of 3 GEMMs (nano, 4 layers).
LOSS_RTOL = loss_rtol(tokens=GBS * SEQ, depth=3 * 4)
TRAINED_RTOL = trained_rtol(tokens=GBS * SEQ, depth=3 * 4)


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(vocab, (GBS, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, opt, rank: int, world: int, tracker=None):
    """Each rank's share of every global batch as MICRO micro-batches; the probe (if any)
    watches every step."""
    losses, norms, vocab = [], [], model.cfg.vocab_size
    for step in range(STEPS):
        x, y = batch(step, vocab)
        per = GBS // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        local = torch.zeros(())
        with tracker if tracker is not None else torch.enable_grad():
            for i, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
                opt.prepare_backward(final_microbatch=i == MICRO - 1)
                loss_sum = model(xm, ym)
                (loss_sum / (GBS * SEQ)).backward()
                local += loss_sum.detach()
            opt.finish_grad_sync()
        stats = opt.step(LR)
        if world > 1:
            dist.all_reduce(local)
        losses.append(float(local) / (GBS * SEQ))
        norms.append(stats.grad_norm)
    return losses, norms


def _runs(rank, world):
    out = {}
    for zero in (2, 3):
        for sync in ("step", "microbatch"):
            cfg = make_cfg(world, zero, tied=True)
            cfg.model.overrides = {**cfg.model.overrides, "num_layers": 4}
            cfg.parallel.grad_sync = sync
            model, dims, opt = build(cfg)
            reducer, layout = opt.reducer, opt.layout
            tracker = PeakTracker({
                "shard": lambda r=reducer: [r.grad_shard],
                "whole": lambda lay=layout: [s.param.grad for s in lay.params],
                "staging": lambda r=reducer: list(r.staging.values())})
            dims.ledger.enabled = True
            dims.ledger.reset()
            losses, norms = train(model, opt, rank, world, tracker)
            calls = dims.ledger.totals()[("dp_cp", "reduce_scatter")]["calls"] // STEPS
            params = final_params(opt)
            out[(zero, sync)] = {
                "run": (losses, norms, params), "calls": calls,
                "segments": len(layout.segments), "peak": tracker.peak,
                "whole": tracker.item_peaks.get("whole", 0),
                "staging": tracker.item_peaks.get("staging", 0),
                "shard": reducer.grad_shard.numel() * 4,
                "largest": max(s.size for s in layout.segments) * 4,
                "full": layout.total * 4, "k": reducer.buckets_in_flight}
            opt.close()
    return out if rank == 0 else None


def reference():
    cfg = make_cfg(tied=True)
    cfg.model.overrides = {**cfg.model.overrides, "num_layers": 4}
    model, _, opt = build(cfg)
    losses, norms = train(model, opt, 0, 1)
    return losses, norms, final_params(opt)


@pytest.mark.parity
@pytest.mark.parametrize("dp", [2, 4])
def test_microbatch_sync_matches_single_process_and_holds_no_full_gradient(dp):
    ref = reference()
    for (zero, sync), r in run_ranks(_runs, dp)[0].items():
        label = f"dp={dp} zero={zero} grad_sync={sync}"
        assert_close_run(r["run"], ref, LOSS_RTOL, TRAINED_RTOL, TRAINED_RTOL, label)
        # ZeRO-3's rest unit fills across the blocks' buckets (parallel/data.py).
        alive = r["k"] + (1 if zero == 3 else 0)
        if sync == "microbatch":
            assert r["calls"] == MICRO * r["segments"], (label, r["calls"])
            assert r["whole"] == 0, label  # no gradient accumulates whole in .grad
            assert r["peak"] <= r["shard"] + alive * r["largest"], (label, r)
            assert r["staging"] < r["full"], (label, r)
        else:  # the behaviour it replaces: the whole gradient held over micro-batches 1..m-1
            assert r["calls"] == r["segments"], (label, r["calls"])
            assert r["whole"] >= 0.95 * r["full"] - r["largest"], (label, r)
            assert r["peak"] > r["shard"] + alive * r["largest"], (label, r)


# --- the planner and the engine agree on both settings ------------------------------------
AGREE = {f"dp2-zero{zero}-m4-{sync}": ["--parallel.dp", "2", "--parallel.zero", str(zero),
                                        "--train.gbs", "16", "--parallel.grad_sync", sync]
         for zero in (2, 3) for sync in ("step", "microbatch")}


# Measured, with either setting: the engine holds 3072 bytes (3 int64 per token of the
# 128-token micro-batch) more activations than planned at 4 micro-batches; at 1 they agree
# to the byte (test_plan_agreement.py's dp2-zero2). Not the gradients' doing.
ACTIVATION_GAP = (0.004, "measured +0.31% at 4 micro-batches per rank, either grad_sync")


@pytest.mark.parametrize("name", list(AGREE))
def test_planner_agrees_with_engine_on_grad_sync(name, tmp_path, capsys, monkeypatch):
    """Through the trainer at 4 micro-batches per rank: model states, the peak items (whole
    gradients and buckets in flight to the byte, activations within ACTIVATION_GAP) and the
    ledger (exactly), as tests/test_plan_agreement.py checks every layout."""
    import test_plan_agreement
    from test_plan_agreement import check_rank, measure

    monkeypatch.setitem(test_plan_agreement.PEAK_GAPS, (name, "activations"), ACTIVATION_GAP)

    results = run_ranks(measure, 2, str(tmp_path), AGREE[name])
    for got in results:
        check_rank(got, tmp_path, name, AGREE[name], capsys)
        if name.endswith("microbatch"):
            assert got["peaks"]["grad_buffer"] == 0, got["peaks"]
        else:
            assert got["peaks"]["grad_buffer"] > 0, got["peaks"]


# --- the default: auto ----------------------------------------------------------------------
def test_auto_picks_microbatch_where_the_step_is_near_equal():
    """The planner's choice (plan/grad_sync.py): inside one node (8 H100s, NVLink) the extra
    reduce-scatters hide behind backward and per micro-batch wins; across nodes (64 H100s,
    tp 8 inside, dp 8 across) they do not and once per step stays; nothing to choose for
    ZeRO-1, one micro-batch or a pipeline."""
    from fivefold.models.presets import preset
    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.grad_sync import NEAR_EQUAL, choose_grad_sync
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.timing import step_time

    hw, assume = get_hardware("h100-sxm")
    w8 = Workload(model=preset("llama-3.1-8b"), seq_len=4096, gbs=64, grad_sync="auto")
    for zero in (2, 3):
        lay = Layout(dp=8, zero=zero, mbs=1)
        assert choose_grad_sync(w8, lay, hw, assume)[0] == "microbatch"
        times = [step_time(Workload(model=w8.model, seq_len=4096, gbs=64, grad_sync=s), lay,
                           hw, assume).total for s in ("step", "microbatch")]
        assert times[1] <= (1 + NEAR_EQUAL) * times[0]
    w70 = Workload(model=preset("llama-3.1-70b"), seq_len=4096, gbs=256, grad_sync="auto")
    lay70 = Layout(dp=8, tp=8, sp=True, zero=2, mbs=1)
    choice, why = choose_grad_sync(w70, lay70, hw, assume)
    assert choice == "step" and "slower" in why
    # both fit (the planner's verdict), so time alone decides, as before memory counted
    for sync in ("step", "microbatch"):
        assert plan_layout(replace(w70, grad_sync=sync), lay70, hw, assume).fits, sync
    assert choose_grad_sync(w8, Layout(dp=8, zero=1, mbs=1), hw, assume)[0] == "step"
    assert choose_grad_sync(w8, Layout(dp=8, zero=3, mbs=8), hw, assume)[0] == "step"  # m = 1
    assert choose_grad_sync(w8, Layout(dp=4, pp=2, zero=2, mbs=1), hw, assume)[0] == "step"


def test_a_training_config_resolves_auto_as_the_planner_does(tmp_path):
    """The engine's resolution (the trainer calls it) is the planner's: Llama-3.1-8B at dp 8
    reduces per micro-batch; the tests' tiny model, whose step the collectives' latency
    dominates, once per step (the planner predicts +41% for per micro-batch there)."""
    from common import small_config

    from fivefold.plan.inputs import resolve_config_grad_sync, training_plan_inputs

    big = small_config(tmp_path, "--parallel.dp", "8", "--parallel.zero", "3", "--train.gbs",
                       "64", "--model.preset", "llama-3.1-8b")
    big.model.overrides, big.train.seq_len = {}, 4096
    assert big.parallel.grad_sync == "auto"
    assert training_plan_inputs(big)[0].grad_sync == "microbatch"
    assert resolve_config_grad_sync(big) == "microbatch" == big.parallel.grad_sync
    tiny = small_config(tmp_path, "--parallel.dp", "2", "--parallel.zero", "3", "--train.gbs",
                        "16")
    assert training_plan_inputs(tiny)[0].grad_sync == "step"
    assert resolve_config_grad_sync(tiny) == "step" == tiny.parallel.grad_sync


# --- auto weighs memory: the whole gradient that once per step holds must fit ------------
def _auto_cases():
    from fivefold.models.presets import preset
    from fivefold.plan.layout import Layout, Workload

    # Mixtral-8x7B in FP8 on 8 H100s (dp 8, ZeRO-3, 128 micro-batches of 1): per micro-batch
    # is +40% slower, but once per step holds the whole 87 GiB gradient and neither fits.
    mixtral = (Workload(model=preset("mixtral-8x7b"), seq_len=4096, gbs=1024, precision="fp8",
                        grad_sync="auto"), Layout(dp=8, zero=3, mbs=1))
    # Llama-3.1-70B on 64 H100s, dp 16 × tp 4, ZeRO-2, full recomputation, 8 micro-batches:
    # +11% slower per micro-batch, and only per micro-batch fits (85.1 → 52.2 of 80 GiB).
    llama = (Workload(model=preset("llama-3.1-70b"), seq_len=4096, gbs=128, grad_sync="auto"),
             Layout(dp=16, tp=4, sp=True, zero=2, mbs=1, recompute="full"))
    return {"neither fits": mixtral, "only microbatch fits": llama}


@pytest.mark.parametrize("case", ["neither fits", "only microbatch fits"])
def test_auto_takes_microbatch_where_once_per_step_does_not_fit(case):
    """Time alone would keep once per step (per micro-batch is over NEAR_EQUAL slower); the
    planner's own verdict (plan_layout's `fits`) on once per step is "does not fit", so auto
    takes per micro-batch, the one that fits or, where neither does, needs less, and says
    why in the plan."""
    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.grad_sync import NEAR_EQUAL, choose_grad_sync, memory_verdict
    from fivefold.plan.hardware import get_hardware

    hw, assume = get_hardware("h100-sxm")
    work, lay = _auto_cases()[case]
    forced = {s: plan_layout(replace(work, grad_sync=s), lay, hw, assume)
              for s in ("step", "microbatch")}
    assert forced["microbatch"].time.total > (1 + NEAR_EQUAL) * forced["step"].time.total
    assert not forced["step"].fits and forced["step"].memory["grad_buffer"] > 0
    assert forced["microbatch"].memory_total < forced["step"].memory_total
    assert forced["microbatch"].fits == (case == "only microbatch fits")
    for s, plan in forced.items():  # grad_sync.py's verdict is plan_layout's, to the byte
        assert memory_verdict(replace(work, grad_sync=s), lay, hw, assume) == (
            plan.memory_total, plan.fits), s
    choice, why = choose_grad_sync(work, lay, hw, assume)
    assert choice == "microbatch", why
    assert ("neither fits" if case == "neither fits" else "per micro-batch does") in why
    auto = plan_layout(work, lay, hw, assume)
    assert (auto.grad_sync, auto.grad_sync_reason) == ("microbatch", why)
    assert auto.memory["grad_buffer"] == 0
    assert auto.memory_total == forced["microbatch"].memory_total
    assert auto.to_dict()["grad_sync_reason"] == why


def test_the_mixtral_plan_says_per_micro_batch_and_why(capsys):
    from fivefold.plan.cli_entry import main

    argv = ["--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "h100", "--precision", "fp8",
            "--layout", "zero=3,mbs=1"]
    main(argv)
    out = capsys.readouterr().out
    assert "does not fit: 144.0 of 80 GiB" in out and "unsharded grads" not in out
    assert ("gradients reduce-scattered once per micro-batch (grad_sync = auto: neither fits "
            "on h100-sxm; per micro-batch needs less: 230.9 → 144.0 of 80 GiB") in out


def test_the_search_finds_a_layout_that_fits_only_per_micro_batch():
    """The search's memory check (plan/bounds.py) and the plan agree on every layout under
    auto: no layout is shown as fitting whose plan does not fit (ZeRO-2 under a pipeline
    reduces once per step and holds the whole gradient), and none that fits only per
    micro-batch is lost."""
    from fivefold.models.presets import preset
    from fivefold.plan.bounds import memory_check
    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Workload
    from fivefold.plan.search import SearchSpace, enumerate_layouts, search

    hw, assume = get_hardware("h100-sxm")
    work = Workload(model=preset("llama-3.1-70b"), seq_len=4096, gbs=128, grad_sync="auto")
    space = SearchSpace(tp=(4, 8), pp=(1, 2), cp=(1,), zero=(2, 3), max_mbs=2,
                        recompute=("none", "full", "auto"), schedule=("1f1b",))
    plans = {}
    for lay in enumerate_layouts(work, 64, hw, space):
        plans[lay] = plan_layout(work, lay, hw, assume)
        assert memory_check(work, lay, hw, assume).fits == plans[lay].fits, lay.short()
    only_micro = [lay for lay, p in plans.items() if p.fits and p.grad_sync == "microbatch"
                  and not plan_layout(replace(work, grad_sync="step"), lay, hw, assume).fits]
    assert _auto_cases()["only microbatch fits"][1] in only_micro
    assert any(lay.pp > 1 and lay.zero == 2 and not p.fits for lay, p in plans.items())
    result = search(work, 64, hw, assume, space, top=len(plans))
    assert result.top and all(p.fits for p in result.top)
    # searched alone, it is found, fitting, per micro-batch (once per step: 85.1 of 80 GiB)
    alone = SearchSpace(tp=(4,), pp=(1,), cp=(1,), zero=(2,), mbs=(1,), recompute=("full",))
    found = search(work, 64, hw, assume, alone).top
    assert [(p.layout, p.grad_sync, p.fits) for p in found] == [
        (_auto_cases()["only microbatch fits"][1], "microbatch", True)]


def test_plan_config_search_chooses_grad_sync_per_layout(tmp_path, capsys):
    """`fivefold plan --config --search`: a config whose own layout is ZeRO-1 (auto: once per
    step) searches ZeRO-2 with auto chosen per layout, so dp 16 × tp 4, ZeRO-2, which fits
    only per micro-batch, is found fitting; its config explained says why."""
    import json

    from fivefold.plan.cli_entry import main

    def toml(name: str, parallel: str) -> str:
        path = tmp_path / name
        path.write_text(f'[model]\npreset = "llama-3.1-70b"\n[parallel]\n{parallel}\nmbs = 1\n'
                        '[train]\ngbs = 128\nseq_len = 4096\nprecision = "bf16"\n'
                        'recompute = "full"\n')
        return str(path)

    zero1 = toml("zero1.toml", "dp = 64\nzero = 1")
    assert main(["--config", zero1, "--search", "--space",
                 "tp=4 pp=1 cp=1 zero=2 mbs=1 recompute=full", "--json", "-"]) == 0
    found = json.loads(capsys.readouterr().out)["layouts"]
    assert [(p["layout_short"], p["grad_sync"], p["fits"]) for p in found] == [
        ("dp16 tp4+sp pp1 z2 mbs1 rc-full", "microbatch", True)]
    assert "once per step does not fit" in found[0]["grad_sync_reason"]
    zero2 = toml("zero2.toml", "dp = 16\ntp = 4\nsp = true\nzero = 2")
    assert main(["--config", zero2]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fits: 52.2 of 80 GiB")
    assert ("once per micro-batch (grad_sync = auto: once per step does not fit on h100-sxm, "
            "per micro-batch does: 85.1 → 52.2 of 80 GiB") in out


def test_the_engine_and_the_planner_choose_alike_per_gpu(tmp_path):
    """The trainer resolves auto with its GPU's catalog entry (`resolve_config_grad_sync`
    with torch's device name) as `fivefold plan --config` plans it on that GPU: Llama-3.1-70B
    at dp 16 × tp 4, ZeRO-2, reduces per micro-batch on an 80 GiB H100 (once per step does
    not fit) and once per step where it fits (H200, MI300X)."""
    from common import small_config

    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.inputs import resolve_config_grad_sync, training_plan_inputs

    def config():
        cfg = small_config(tmp_path, "--parallel.dp", "16", "--parallel.tp", "4",
                           "--parallel.sp", "true", "--parallel.zero", "2", "--train.gbs",
                           "128", "--train.recompute", "full", "--train.precision", "bf16",
                           "--model.preset", "llama-3.1-70b")
        cfg.model.overrides, cfg.train.seq_len = {}, 4096
        return cfg

    for device, gpu, expected in (("NVIDIA H100 80GB HBM3", "h100-sxm", "microbatch"),
                                  (None, "h100-sxm", "microbatch"),  # a CPU run: the default
                                  ("NVIDIA H200", "h200", "step"),
                                  ("AMD Instinct MI300X", "mi300x", "step")):
        engine = config()
        assert resolve_config_grad_sync(engine, device) == expected, device
        hw, assume = get_hardware(gpu)
        work, lay = training_plan_inputs(config(), hw, assume)
        plan = plan_layout(replace(work, grad_sync="auto"), lay, hw, assume)
        assert work.grad_sync == plan.grad_sync == expected, (device, plan.grad_sync_reason)
        assert plan.fits, (device, plan.why)


@pytest.mark.parametrize("args, words", [
    (["--parallel.grad_sync", "sometimes"], ["parallel.grad_sync", "auto, step, microbatch"]),
    (["--parallel.grad_sync", "microbatch", "--parallel.pp", "2"],
     ["parallel.grad_sync", "parallel.pp = 1", "'step' or 'auto'"]),
])
def test_bad_grad_sync_is_refused_in_one_line(args, words, tmp_path):
    from common import small_config

    from fivefold.config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate(small_config(tmp_path, *args))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
