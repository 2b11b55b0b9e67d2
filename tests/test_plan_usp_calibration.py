"""The nanotron convention against the Ultra-Scale Playbook's runs (bench/plan/usp_calibration.py,
bench/data/usp-calibration.csv): the scorer on runs made up here, nanotron's stage cut and
loss buffers by hand, and the convention's standing on a fixed fifth of the file."""

import dataclasses
import sys
from pathlib import Path

import pytest

from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.comm import collectives
from fivefold.plan.conventions import get_convention
from fivefold.plan.hardware import get_hardware
from fivefold.plan.layout import check_layout
from fivefold.plan.split import stage_layer_counts
from fivefold.plan.timing import step_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "plan"))
import usp_calibration as usp  # noqa: E402


def _run(model, gpus, status, memory="", tokens="", **layout):
    row = {"model": model, "n_gpus": str(gpus), "status": status, "gpu_memory_GB": memory,
           "tokens_per_s_per_gpu": tokens}
    row.update({k: str(v) for k, v in {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "zero": 0,
                                      **layout}.items()})
    return row


def test_scorer_on_made_up_runs():
    """Four runs of one group: memory errors +5%, -20%, +5% on the ok runs (median 5%,
    2 of 3 within 10%), the crashed run called fitting (3 of 4 verdicts right); the pick is
    the fastest predicted among the fitting layouts, the crashed one (a miss), or among the
    ok runs the third, at 95 of the best 100 (a hit)."""
    rows = [_run("m", 16, "ok", "10", "100", dp=16),
            _run("m", 16, "ok", "10", "80", dp=8, tp=2),
            _run("m", 16, "ok", "20", "95", dp=4, tp=4),
            _run("m", 16, "crashed_or_oom", dp=2, tp=8)]
    preds = [{"plannable": True, "fits": True, "rank0_reserved_gib": 10.5,
              "tokens_per_s_per_gpu": 100.0},
             {"plannable": True, "fits": True, "rank0_reserved_gib": 8.0,
              "tokens_per_s_per_gpu": 120.0},
             {"plannable": True, "fits": True, "rank0_reserved_gib": 21.0,
              "tokens_per_s_per_gpu": 150.0},
             {"plannable": True, "fits": True, "rank0_reserved_gib": 70.0,
              "tokens_per_s_per_gpu": 200.0}]
    s = usp.score(rows, preds)
    assert s["memory_median_abs_error"] == pytest.approx(0.05)
    assert s["memory_within_10pct"] == pytest.approx(2 / 3)
    assert s["fits_right"] == pytest.approx(0.75)
    assert s["throughput_median_abs_error"] == pytest.approx(0.5)  # 0, +50%, +57.9%
    assert s["pick_within_10pct"] == 0 and s["pick_within_10pct_ok_runs_only"] == 1
    assert s["picks"]["m/16"]["ok_runs"]["layout"] == "dp4 tp4 pp1 mbs1 z0"


def test_pick_ranks_a_ddp_pipeline_as_the_search_does():
    """The pick ranks as `validated.rank_key` does: a DDP pipeline (ZeRO-0, dp > 1, pp > 1),
    an uncertain regime of nanotron's range, ranks first only when predicted more than 5%
    faster than the best layout outside it: at 4% faster the ZeRO-1 layout is picked (a
    hit), at 6% the DDP pipeline (its 20 of the best 100 tokens/s: a miss)."""
    rows = [_run("m", 16, "ok", "10", "20", dp=8, pp=2, zero=0),
            _run("m", 16, "ok", "10", "100", dp=16, zero=1)]
    for faster, layout, hit in ((1.04, "dp16 tp1 pp1 mbs1 z1", True),
                                (1.06, "dp8 tp1 pp2 mbs1 z0", False)):
        preds = [{"plannable": True, "fits": True, "rank0_reserved_gib": 10.0,
                  "tokens_per_s_per_gpu": 100.0 * faster},
                 {"plannable": True, "fits": True, "rank0_reserved_gib": 10.0,
                  "tokens_per_s_per_gpu": 100.0}]
        pick = usp.score(rows, preds)["picks"]["m/16"]["fits"]
        assert (pick["layout"], pick["hit"]) == (layout, hit), faster


def test_nanotron_cumulative_cut_by_hand():
    """1B (16 layers of cost c = 4h² + 3h·ffn = 2^26, head V·h = 4c): thresholds
    total·(k+1)/pp = 20c·(k+1)/pp. pp 2: layers 1-11 reach 11c > 10c on stage 0. pp 4: 6c >
    5c, 11c > 10c, 16c > 15c, the head alone on the last. pp 32 > 16 layers: one per stage,
    the rest empty (nanotron runs it)."""
    c = 2.0**26
    assert stage_layer_counts(16, 2, "cumulative", (), c, 0.0, 4 * c) == (11, 5)
    assert stage_layer_counts(16, 4, "cumulative", (), c, 0.0, 4 * c) == (6, 5, 5, 0)
    assert stage_layer_counts(16, 32, "cumulative", (), c, 0.0, 4 * c) == (1,) * 16 + (0,) * 16


def test_sharded_cross_entropy_buffers():
    """nanotron's loss on T·V/tp logits: the saved fp32 softmax (4 bytes) and, in forward,
    the bf16 logits and their fp32 cast beside it (2 + 4)."""
    work, layout = usp.workload_layout(_run("8B", 16, "ok", layers=32, hidden=4096, heads=32,
                                            kv_heads=32, ffn=14336, vocab=131072, seq=4096,
                                            gbs_samples=256, tied_embeddings="False",
                                            dp=2, tp=8))
    act = activation_bytes_per_microbatch(work.model, 1, 4096, tp=8, sp=True,
                                          chunked_loss=work.chunked_loss,
                                          softmax_loss=work.softmax_loss)
    logits = 4096 * 131072 / 8
    assert act.outside_terms["logits"] == 4 * logits
    assert act.loss_backward == (2 + 4) * logits and act.loss_transient_is_peak


def test_engine_convention_keeps_its_own_settings():
    """The calibration is the nanotron convention's: fivefold's own plans none of it."""
    own = get_convention("fivefold")
    assert own.assumptions == {} and own.layout["pp_split"] == "even"
    assert not {"softmax_loss", "zero_sync_blocking", "zero1_grad_sync", "pp_1f1b_min_warmup",
                "pp_idle_rank_fails"} & set(own.workload)


def _gradient_sync(work, layout):
    [grad] = [c for c in collectives(work, layout, 0) if c.note == "gradients"]
    return grad


def test_nanotron_zero1_all_reduces_the_fp32_gradients():
    """nanotron's ZeRO-1 runs sync_gradients_across_dp(reduce_scatter=False): one all-reduce
    of every fp32 gradient element after backward, 2(n-1)/n of the buffer on the wire
    against a reduce-scatter's (n-1)/n, then the bf16 all-gather; the engine's own ZeRO-1
    (and its ledger) keeps the reduce-scatter. Ledger bytes are exact; the exposed DP time
    only has to grow (its tree/ring choice and latency are network.py's)."""
    row = _run("8B", 128, "ok", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=14336,
               vocab=131072, seq=4096, gbs_samples=256, tied_embeddings="False",
               dp=32, tp=4, zero=1, mbs=8)
    work, layout = usp.workload_layout(row)
    grad = _gradient_sync(work, layout)
    params = grad.elements
    assert (grad.op, grad.dtype_bytes, grad.calls, grad.group_size) == ("all_reduce", 4, 1, 32)
    assert grad.wire_bytes == 2 * 31 / 32 * 4 * params
    gather = [c for c in collectives(work, layout, 0) if c.note == "updated parameters"]
    assert [(c.op, c.dtype_bytes, c.elements) for c in gather] == [("all_gather", 2, params)]
    scatter = dataclasses.replace(work, zero1_grad_sync="reduce_scatter")
    rs = _gradient_sync(scatter, layout)
    assert (rs.op, rs.elements, rs.wire_bytes) == ("reduce_scatter", params, 31 / 32 * 4 * params)
    hw, assume = get_hardware("h100-sxm", usp.HW)
    assume = get_convention("nanotron").apply_assumptions(assume)
    assert (step_time(work, layout, hw, assume).dp_comm
            > step_time(scatter, layout, hw, assume).dp_comm)
    own, own_layout = usp.workload_layout(row, "fivefold")
    assert own.zero1_grad_sync == "reduce_scatter"
    assert _gradient_sync(own, own_layout).op == "reduce_scatter"
    bad = dataclasses.replace(work, zero1_grad_sync="allreduce")
    assert any("zero1_grad_sync = 'allreduce'" in p for p in check_layout(bad, layout))


def test_standing_on_a_fifth_of_the_file():
    """Every fifth run of the committed file (226 runs, 114 ok scored: one ok run is a
    layout the convention refuses), under the convention as committed: memory median error
    within 10% (it was 24% before the calibration on the whole file; 6.6% here), over half
    the runs within 10% (64%), fits right on 90% (95%)."""
    rows = usp.load()[::5]
    s = usp.score(rows, usp.run(rows, hw_overrides=usp.HW))
    assert s["ok_runs_scored"] > 100
    assert s["memory_median_abs_error"] <= 0.10
    assert s["memory_within_10pct"] >= 0.5
    assert s["fits_right"] >= 0.90


def test_hw_flag_overrides_a_fitted_factor(capsys):
    """`--hw activation_reserve=0` plans without the convention's fitted reserve: the
    logged (reserved) memory drops by 0.25 of the saved activations, all else equal."""
    import json

    from fivefold import cli

    def logged(*extra):
        code = cli.main(["plan", "--model", "llama-3.1-8b", "--gpus", "16", "--seq-len",
                         "4096", "--gbs", "256", "--convention", "nanotron", "--layout",
                         "dp=4,tp=4,zero=1,mbs=2", "--json", "-", *extra])
        assert code == 0
        data = json.loads(capsys.readouterr().out)
        return data["convention"]["logged_memory_bytes"], data["layouts"][0]

    fitted, plan = logged()
    plain, _ = logged("--hw", "activation_reserve=0")
    activations = plan["memory_bytes"]["activations"]
    assert fitted - plain == pytest.approx(0.25 * activations, rel=1e-9)



def test_nanotron_cut_leaves_ranks_without_a_block():
    """The same 1B costs, blocks embed, 16 layers, norm, head (4c), cast, loss; the cut moves
    on at most one rank per block. pp 16 (thresholds 1.25c apart): layers 1-16 end on rank
    11, norm on 12, the head on 12 (20c passes 16.25c), cast on 13, loss on 14: rank 15
    idle. pp 32 (0.625c apart): one layer per rank 0-15, norm 16, head 17, cast 18, loss
    19: 12 idle. pp 2, 4 and 8 use every rank."""
    from fivefold.plan.split import cumulative_idle_ranks

    c = 2.0**26
    assert [cumulative_idle_ranks(16, p, c, 0.0, 4 * c) for p in (2, 4, 8)] == [0, 0, 0]
    assert cumulative_idle_ranks(16, 16, c, 0.0, 4 * c) == 1
    assert cumulative_idle_ranks(16, 32, c, 0.0, 4 * c) == 12


def _plan_problems(convention, **layout):
    """check_layout's problems for the 1B model on 128 GPUs under `convention`."""
    from fivefold.plan.layout import check_layout

    row = _run("1B", 128, "ok", **{"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 32,
                                   "ffn": 8192, "vocab": 131072, "seq": 4096,
                                   "gbs_samples": 256, "tied_embeddings": "True", **layout})
    return check_layout(*usp.workload_layout(row, convention))


def test_nanotron_refuses_what_its_engine_cannot_run():
    """Under the nanotron convention: dp 16 pp 8 mbs 4 has 4 micro-batches, fewer than
    pp - 1 = 7 (its 1F1B engine asserts them), and dp 8 pp 16 leaves rank 15 without a
    block: both refused; dp 16 pp 8 mbs 2 (8 micro-batches) is planned. The engine's own
    convention plans all three."""
    assert _plan_problems("nanotron", dp=16, pp=8, mbs=4) == [
        "1f1b needs at least pp - 1 = 7 micro-batches in this engine, got 4"]
    assert any("1 pipeline rank(s) without a block" in p
               for p in _plan_problems("nanotron", dp=8, pp=16))
    assert _plan_problems("nanotron", dp=16, pp=8, mbs=2) == []
    for layout in ({"dp": 16, "pp": 8, "mbs": 4}, {"dp": 8, "pp": 16}):
        assert _plan_problems("fivefold", **layout) == []


def test_groups_across_nodes_use_their_members_nics():
    """H100 nodes (8 GPUs, NVLink 450 GB/s, one 50 GB/s NIC per GPU): tp 16 over two nodes
    has 8 members in each; with every member's NIC (inter_node_rails = 1) it moves
    min(450, 8·50) = 400 GB/s per GPU, half of the extra NICs 50·(1 + 0.5·7) = 225, none
    50 (the default, as before). A dp group of 16 with tp 8 has one member per node: 50
    whatever the rails."""
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout
    from fivefold.plan.timing import group_link

    def gbps(layout, group, rails):
        hw, assume = get_hardware("h100-sxm", {"inter_node_rails": rails})
        bw, crosses = group_link(hw, layout, group, assume)
        assert crosses
        return bw / 1e9

    tp16 = Layout(tp=16, sp=True)
    assert [gbps(tp16, "tp", r) for r in (1.0, 0.5, 0.0)] == [400.0, 225.0, 50.0]
    assert gbps(Layout(dp=16), "dp", 1.0) == 400.0
    assert gbps(Layout(dp=16, tp=8), "dp", 1.0) == 50.0
    hw, assume = get_hardware("h100-sxm")
    assert assume.inter_node_rails == 0.0 and group_link(hw, tp16, "tp")[0] == 50e9


def test_headroom_moves_the_fits_verdict_only():
    """memory_headroom_gib lowers the limit the most loaded rank must stay under, nothing
    else: 1 GiB more than the plan leaves free turns 'fits' into 'does not fit' with the
    same memory; the default (0) keeps the device's whole memory."""
    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.hardware import GIB, get_hardware

    row = _run("8B", 16, "ok", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=14336,
               vocab=131072, seq=4096, gbs_samples=256, tied_embeddings="False", dp=4, tp=4,
               zero=1, mbs=2)
    work, layout = usp.workload_layout(row)
    hw, assume = get_hardware("h100-sxm", usp.HW)
    plan = plan_layout(work, layout, hw, assume)
    assert plan.memory_limit == hw.memory_bytes and plan.fits
    free = (plan.memory_limit - plan.memory_total) / GIB
    hw, tight = get_hardware("h100-sxm", {**usp.HW, "memory_headroom_gib": free + 1})
    tighter = plan_layout(work, layout, hw, tight)
    assert not tighter.fits and tighter.memory_total == plan.memory_total


def test_memory_factors_by_least_absolute_deviations():
    """Five runs, one column: four say the factor is 1, one says 10. The fit takes the
    median's side (1, to 1e-3), where least squares would give the mean, 2.8."""
    columns, target = [[1.0]] * 5, [1.0, 1.0, 1.0, 1.0, 10.0]
    import usp_fit

    assert usp_fit._nonnegative_lad(columns, target)[0] == pytest.approx(1.0, abs=1e-3)
    assert usp_fit._nonnegative_lstsq(columns, target)[0] == pytest.approx(2.8)


def test_the_conventions_time_factors_are_the_files_fit():
    """The nanotron convention's time factors are what `fit` gave on the whole file (the
    committed bench/results/usp_calibration.json), and the factor fitted on either half
    alone for nanotron's blocked TP waits, and for its TP steps between nodes, agrees
    within 1.5x (the cross-fit's bound): each carries from 16 GPUs to 128."""
    import json

    from usp_fit import TIME_FITTED

    results = json.loads(usp.OUT.read_text())
    conv = get_convention("nanotron").assumptions
    for k in TIME_FITTED:
        assert conv[k] == pytest.approx(results["fitted"]["all"][k]), k
    for k in ("pp_blocking_latency_us", "tp_inter_step_us"):
        halves = [results["fitted"][g][k] for g in ("16", "128")]
        assert min(halves) > 0 and max(halves) <= 1.5 * min(halves), (k, halves)


def test_memory_breakdown_groups_made_up_runs():
    """bench/plan/usp_memory.py: two ok runs at tp 1 (errors +5% and -20%) and one at tp 2
    (+5%), one a single micro-batch per step; the verdict misses are the crashed run planned
    as fitting and the ok run the planner refuses, which counts in no memory group."""
    import usp_memory

    rows = [_run("m", 16, "ok", "10", "1", grad_acc=4),
            _run("m", 16, "ok", "10", "1", grad_acc=1, mbs=4),
            _run("m", 16, "ok", "20", "1", tp=2, grad_acc=4),
            _run("m", 16, "crashed_or_oom", tp=4, grad_acc=4),
            _run("m", 16, "ok", "5", "1", pp=2, grad_acc=4)]
    preds = [{"plannable": True, "fits": True, "rank0_reserved_gib": 10.5},
             {"plannable": True, "fits": True, "rank0_reserved_gib": 8.0},
             {"plannable": True, "fits": True, "rank0_reserved_gib": 21.0},
             {"plannable": True, "fits": True, "rank0_reserved_gib": 1.0,
              "most_loaded_total_gib": 2.0},
             {"plannable": False, "fits": False, "why": "no block"}]
    table = usp_memory.breakdown(rows, preds)
    assert table["tp"]["1"]["runs"] == 2 and table["tp"]["2"]["runs"] == 1
    assert table["tp"]["1"]["median_abs_error"] == pytest.approx(0.125)
    assert table["tp"]["1"]["median_signed_error"] == pytest.approx(-0.075)
    assert table["tp"]["1"]["within_10pct"] == 0.5
    assert table["microbatches"]["1"]["median_signed_error"] == pytest.approx(-0.2)
    assert table["microbatches"][">1"]["runs"] == 2
    assert "2" not in table["pp"]  # the refused run is not scored for memory
    misses = usp_memory.verdict_misses(rows, preds)
    assert [m["status"] for m in misses] == ["crashed_or_oom", "ok"]
    assert misses[0]["planned_most_loaded_gib"] == 2.0 and misses[1]["refused"] == "no block"


def test_crash_witnesses_on_made_up_runs():
    """bench/plan/usp_memory.py `crash_witnesses`: three crashed 1B ZeRO-0 runs called
    fitting. The first has a duplicate that ran and a 3B in its layout that ran (every rank
    witnessed); the second only a ZeRO-1 twin that logged 10 GiB, and ZeRO-0 plans 5 GiB
    more on rank 0, 10 + 5 + the context well inside 79.6 GiB (rank 0 alone witnessed); the
    third a ZeRO-1 twin that logged 72 GiB, and 72 + 8 + the 1.5 GiB context passes the GPU: no
    witness. A crashed run called not fitting is no miss and is not listed."""
    import usp_memory

    def pred(gib, fits=True):
        return {"plannable": True, "fits": fits, "rank0_reserved_gib": gib,
                "most_loaded_total_gib": gib + 1}

    lay = {"dp": 2, "pp": 2, "grad_acc": 64}
    rows = [_run("1B", 16, "crashed_or_oom", **lay), _run("1B", 16, "ok", "9", "1", **lay),
            _run("3B", 16, "ok", "30", "1", **lay),
            _run("1B", 16, "crashed_or_oom", tp=2, **lay),
            _run("1B", 16, "ok", "10", "1", tp=2, zero=1, **lay),
            _run("1B", 16, "crashed_or_oom", tp=4, **lay),
            _run("1B", 16, "ok", "72", "1", tp=4, zero=1, **lay),
            _run("1B", 16, "crashed_or_oom", tp=8, **lay)]
    preds = [pred(12), pred(12), pred(35), pred(20), pred(15), pred(60), pred(52),
             pred(90, fits=False)]
    out = usp_memory.crash_witnesses(rows, preds)
    assert [len(m["witness"]) for m in out["runs"]] == [2, 1, 0]
    assert out["runs"][0]["witness"][1].startswith("3B ran in this layout, logged 30.0")
    assert out["runs"][1]["witness"] == ["ZeRO-1 twin logged 10.0 GiB, + 5.0 planned for "
                                         "ZeRO-0"]
    assert out["by_group"] == {"zero 0, pp > 1": {"crashed_called_fitting": 3,
                                                  "with_witness": 2,
                                                  "every_rank_witnessed": 1}}


def test_zero_twins_by_hand():
    """bench/plan/usp_memory.py `zero_twins`: an 8B dp4 tp4 pp2 layout under ZeRO-0 and
    ZeRO-1, both ok. Rank 0 holds n parameters; the plan puts ZeRO-0 9 bytes per parameter
    above ZeRO-1 (12 · (1 − 1/4)), the runs logged 8 bytes per parameter apart: planned −
    logged = +1 byte per parameter, in the pp > 1 group; a pair with one run crashed and a
    run alone count nowhere."""
    import usp_memory

    from fivefold.plan.hardware import GIB
    from fivefold.plan.model_states import rank_param_counts

    shape = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=14336, vocab=131072,
                 seq=4096, gbs_samples=256, tied_embeddings="False", dp=4, tp=4, pp=2)
    work, layout = usp.workload_layout(_run("8B", 128, "ok", zero=1, **shape))
    n = rank_param_counts(work.model, layout, 0)["dense"]
    rows = [_run("8B", 128, "ok", str(20 + 8 * n / GIB), zero=0, **shape),
            _run("8B", 128, "ok", "20", zero=1, **shape),
            _run("8B", 128, "crashed_or_oom", zero=0, **{**shape, "mbs": 2}),
            _run("8B", 128, "ok", "30", zero=1, **{**shape, "mbs": 2})]
    preds = [{"plannable": True, "rank0_reserved_gib": 21 + 9 * n / GIB},
             {"plannable": True, "rank0_reserved_gib": 21.0},
             {"plannable": True, "rank0_reserved_gib": 40.0},
             {"plannable": True, "rank0_reserved_gib": 30.0}]
    out = usp_memory.zero_twins(rows, preds)
    assert list(out) == ["pp > 1"] and out["pp > 1"]["pairs"] == 1
    assert out["pp > 1"]["median_planned_minus_logged_bytes_per_param"] == pytest.approx(1.0)


def test_released_cache_by_hand():
    """allocator.released_cache: nothing below the limit; above it, the excess, but never
    more than the cache itself (what is left is tensors: the run does not fit)."""
    from fivefold.plan.allocator import released_cache

    assert released_cache(70.0, 20.0, 75.0) == 0.0
    assert released_cache(90.0, 20.0, 75.0) == 15.0
    assert released_cache(100.0, 20.0, 75.0) == 20.0


def test_head_reserve_is_given_back_at_the_limit():
    """8B dp8 tp16 pp1 ZeRO-1, one micro-batch of 32 sequences on 128 H100s, a run of the
    file (60.0 GiB logged; its ZeRO-0 twin crashed). The head's fitted reserve, 82 bytes per
    token and hidden unit, is 82 · 32 · 4096 · 4096 B = 41 GiB of cache, which takes the plan
    over the usable 79.6 - 4.5 GiB; the allocator gives back what passes the limit, so the
    run fits, at exactly the limit, and the tensors stay as planned. ZeRO-0 adds the
    unsharded optimizer states, tensors, not cache: it does not fit."""
    from fivefold.plan.hardware import GIB, get_hardware, usable_memory
    from fivefold.plan.memory import memory_items

    row = {"model": "8B", "n_gpus": "128", "status": "ok", "gpu_memory_GB": "52.9",
           "tokens_per_s_per_gpu": "1", "layers": "32", "hidden": "4096", "heads": "32",
           "kv_heads": "32", "ffn": "14336", "vocab": "131072", "seq": "4096",
           "tied_embeddings": "False", "dp": "8", "tp": "16", "pp": "1", "mbs": "32",
           "grad_acc": "1", "gbs_samples": "256", "zero": "1"}
    work, layout = usp.workload_layout(row)
    hw, assume = get_hardware("h100-sxm", usp.HW)
    assume = get_convention("nanotron").apply_assumptions(assume)
    limit = usable_memory(hw, assume)
    assert limit == pytest.approx((79.6 - 4.5) * GIB)
    free, _ = memory_items(work, layout, assume, 0)
    capped, _ = memory_items(work, layout, assume, 0, limit=limit)
    cache = 82.0 * 32 * 4096 * 4096
    assert sum(free.values()) - cache < limit < sum(free.values())
    assert sum(capped.values()) == pytest.approx(limit, rel=1e-12)
    assert {k: v for k, v in capped.items() if k != "overhead"} == {
        k: v for k, v in free.items() if k != "overhead"}
    assert usp.predict(row, hw_overrides=usp.HW)["fits"]
    assert not usp.predict({**row, "zero": "0"}, hw_overrides=usp.HW)["fits"]
    # under a limit below its tensors it does not fit either: only cache is given back
    low = dict(usp.HW, memory_gib=40.0, memory_headroom_gib=0.0)
    assert not usp.predict(row, hw_overrides=low)["fits"]
    # the engine's own convention has no such reserve: a limit changes nothing
    _, plain = get_hardware("h100-sxm", usp.HW)
    assert memory_items(work, layout, plain, 0, limit=10 * GIB)[0] == memory_items(
        work, layout, plain, 0)[0]
