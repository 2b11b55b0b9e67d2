"""Delayed FP8 scaling (lowp/delayed.py) under pipeline parallelism, every schedule, against
the single-device delayed run of the same global batch (4 layers, 4 micro-batches a step).

Under pp each rank holds its chunks' linears and their amax histories; the step's records
are reduced over the stage's dp x cp x tp ranks (the mesh's `stage` group) and no further.

The error model. Every micro-batch a stage runs is the single device's micro-batch through
the same layers: the same casts with the same scales (the histories as the step began, or
on the first step each tensor's own amax) and the same GEMMs; the stage boundaries pass
the bf16 activations and gradients unchanged. A schedule only reorders whole forwards and
backwards between two `end_step`s; zero-bubble's weight pass runs a linear's backward a
second time from the same kept ∂y (the same scale, max(a, a) = a folded again), as
recomputation runs a forward again. So:
  - step 1's amax records, and with them the histories after step 1, are the single
    device's rows for the rank's layers, bit for bit: step 2 casts with the single
    device's scales. Its loss is the same micro-batches' fp32 losses summed in micro-batch
    order: within 1e-6 relative (a few float32 roundings, 2^-24 each);
  - what differs is where gradients are summed: the tied embedding's two gradients (the
    first stage's and the head's, bf16) are accumulated per stage and added after the
    pipeline, not in one buffer per micro-batch, and the gradient norm is summed per stage
    and then over stages. Later steps differ by that rounding, as a dp run's do: a weight
    whose last bf16 bit moved may move its amax and scale. The tolerances are the dp2
    case's of tests/test_fp8_delayed_parallel.py, loss 1e-4 and gradient norm 3e-3 relative
    per step (measured over every schedule here: loss <= 2.0e-5, gradient norm <= 4.5e-4);
  - the histories are bit-equal over the ranks of a stage after every step (the
    all-reduced records), and zero-bubble with full recomputation is bit-equal to
    zero-bubble without it (tolerance 0).
"""

import dataclasses
import pathlib

import torch
from common import small_config
from harness import run_ranks
from test_fp8_delayed_parallel import all_reduce_bytes

from fivefold.lowp.delayed import histories
from fivefold.parallel.mesh import ParallelDims
from fivefold.train.trainer import Trainer

DELAYED = ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
           "--train.fp8_scaling", "delayed", "--train.fp8_history_len", "4",
           "--train.gbs", "8", "--parallel.mbs", "2", "--train.lr", "1e-3",
           "--model.num_layers", "4"]
STEPS = 3
LINEARS = 4 * 7  # q, k, v, o, gate, up, down of 4 layers
FIRST_LOSS, LOSS, NORM = 1e-6, 1e-4, 3e-3  # the module docstring's


def pp(schedule: str, *extra: str) -> list[str]:
    return ["--parallel.pp", "2", "--parallel.schedule", schedule,
            "--parallel.virtual_stages", "2" if schedule == "interleaved" else "1", *extra]


def rank_histories(trainer) -> dict[str, torch.Tensor]:
    return {k: h.clone() for chunk in trainer.model.chunks for k, h in histories(chunk).items()}


def train(rank, world, tmp, args, steps=STEPS):
    """(loss, grad norm) per step, this rank's histories after each step, the amax
    all-reduces of the last step, and the all-reduce bytes by group (ledger and planner)."""
    cfg = small_config(pathlib.Path(tmp), *DELAYED, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    dims.ledger.enabled = True
    runs, after = [], []
    for _ in range(steps):
        rec = trainer.train_step()
        runs.append((rec["loss"], rec["grad_norm"]))
        after.append(rank_histories(trainer))
    amax = [(e.elements, e.bytes) for e in dims.ledger.entries
            if (e.group, e.op) == ("stage", "all_reduce")]
    trainer.close()
    reduced, planned = all_reduce_bytes(cfg, dims)
    return {"runs": runs, "after": after, "amax": amax, "ledger": reduced, "planned": planned}


def every_layout(rank, world, tmp, layouts):
    return {name: train(rank, world, f"{tmp}/{name}", args) for name, args in layouts.items()}


def rel(a, b):
    return abs(a - b) / abs(b)


def check_against(ref, ranks, name):
    """Each rank's rows against the single device's; the stages hold every linear once."""
    runs = ranks[0][name]["runs"]
    assert all(r[name]["runs"] == runs for r in ranks), name
    held = [set(r[name]["after"][0]) for r in ranks]
    assert set().union(*held) == set(ref["after"][0]) and len(ref["after"][0]) == LINEARS
    for r in ranks:  # step 1's records, so step 2's scales: the single device's
        assert all(torch.equal(h, ref["after"][0][k]) for k, h in r[name]["after"][0].items())
        assert all(h.any() for h in r[name]["after"][-1].values())
        assert r[name]["planned"] == r[name]["ledger"], (name, r[name]["planned"],
                                                         r[name]["ledger"])
    assert rel(runs[0][0], ref["runs"][0][0]) <= FIRST_LOSS, name
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(runs, ref["runs"])):
        assert rel(loss, ref_loss) <= LOSS, (name, step, loss, ref_loss)
        assert rel(norm, ref_norm) <= NORM, (name, step, norm, ref_norm)


SCHEDULES = {s: pp(s) for s in ("afab", "1f1b", "interleaved", "zb", "dualpipev")}


def test_pp2_every_schedule_tracks_the_single_device_delayed_run(tmp_path):
    ref = train(0, 1, str(tmp_path / "ref"), [])
    layouts = {**SCHEDULES, "zb-recompute": pp("zb", "--train.recompute", "full")}
    ranks = run_ranks(every_layout, 2, str(tmp_path), layouts)
    for name in SCHEDULES:
        check_against(ref, ranks, name)
        # one rank per stage: its records need no reduction, and none is made or planned
        assert all(r[name]["amax"] == [] for r in ranks), name
        assert len(ranks[0][name]["after"][0]) == len(ranks[1][name]["after"][0]) == 14
    for r in ranks:  # split backward and recomputation fold each amax twice: no bit moves
        zb, again = r["zb"], r["zb-recompute"]
        assert again["runs"] == zb["runs"]
        assert all(torch.equal(again["after"][-1][k], h) for k, h in zb["after"][-1].items())


def test_pp2_dp2_reduces_each_stage_over_its_own_ranks(tmp_path):
    """Ranks 0, 1 are stage 0's dp pair, ranks 2, 3 stage 1's: each pair's histories are
    bit-equal after every step; one all_reduce(max) of its 14 linears' 3 records a step
    (with ZeRO-3's FP8 all-gather the gathered weights' records ride in it)."""
    ref = train(0, 1, str(tmp_path / "ref"), [])
    layouts = {"1f1b-dp2": pp("1f1b", "--parallel.dp", "2"),
               "interleaved-dp2-zero1": pp("interleaved", "--parallel.dp", "2",
                                           "--parallel.zero", "1"),
               "zb-dp2-zero3-fp8-allgather": pp("zb", "--parallel.dp", "2", "--parallel.zero",
                                                "3", "--parallel.fp8_allgather", "true")}
    ranks = run_ranks(every_layout, 4, str(tmp_path), layouts)
    for name in layouts:
        check_against(ref, ranks, name)
        for a, b in ((0, 1), (2, 3)):
            for step in range(STEPS):
                one, other = ranks[a][name]["after"][step], ranks[b][name]["after"][step]
                assert one.keys() == other.keys()
                assert all(torch.equal(one[k], other[k]) for k in one), (name, a, b, step)
        assert not set(ranks[0][name]["after"][0]) & set(ranks[2][name]["after"][0])
        for r in ranks:
            assert r[name]["amax"] == [(3 * 14, 12 * 14)], (name, r[name]["amax"])


def run_steps(tmp, args, steps, save=False, world=1):
    cfg = small_config(pathlib.Path(tmp), *DELAYED, *args, "--train.steps", "4")
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    loaded = rank_histories(trainer)
    runs = [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(steps))]
    out = {"step": trainer.step, "loaded": loaded, "runs": runs,
           "after": rank_histories(trainer)}
    if save:
        trainer.save_checkpoint()
    trainer.close()
    return out


def save_and_resume(rank, world, tmp):
    """pp2 1F1B: 4 steps straight; 2 steps and a checkpoint; 2 steps resumed at pp2, and
    (from a copy of the checkpoint's place) 2 resumed under DualPipeV, whose rank 0 holds
    the first and the last stage."""
    resume = ["--checkpoint.resume", "latest"]
    return {"straight": run_steps(f"{tmp}/a", pp("1f1b"), 4, world=world),
            "first": run_steps(f"{tmp}/b", pp("1f1b"), 2, save=True, world=world),
            "resumed": run_steps(f"{tmp}/b", [*pp("1f1b"), *resume], 2, world=world),
            "dualpipev": run_steps(f"{tmp}/b", [*pp("dualpipev"), *resume], 0, world=world)}


def test_a_pp2_checkpoint_resumes_bit_exact_and_under_other_layouts(tmp_path):
    """The histories are saved under the unsplit model's names: resumed at pp2 the run is
    the uninterrupted one's, bit for bit; loaded at pp1 and under DualPipeV each rank gets
    the saved rows of its own layers, bit for bit, and pp1 goes on within the module
    docstring's tolerances of the uninterrupted pp2 run."""
    ranks = run_ranks(save_and_resume, 2, str(tmp_path))
    saved = {k: h for r in ranks for k, h in r["first"]["after"].items()}
    assert len(saved) == LINEARS and all(h.any() for h in saved.values())
    for r in ranks:
        assert r["resumed"]["step"] == 4 and r["resumed"]["runs"] == r["straight"]["runs"][2:]
        assert r["resumed"]["loaded"].keys() == r["first"]["after"].keys()
        assert all(torch.equal(h, saved[k]) for k, h in r["resumed"]["loaded"].items())
        assert all(torch.equal(h, r["straight"]["after"][k])
                   for k, h in r["resumed"]["after"].items())
        assert all(torch.equal(h, saved[k]) for k, h in r["dualpipev"]["loaded"].items())
    layers = [{k.split(".")[1] for k in r["dualpipev"]["loaded"]} for r in ranks]
    assert layers == [{"0", "3"}, {"1", "2"}]  # the V: other layers than 1F1B's per rank
    single = run_steps(tmp_path / "b", ["--checkpoint.resume", "latest"], 2)
    assert single["step"] == 4 and single["loaded"].keys() == saved.keys()
    assert all(torch.equal(h, saved[k]) for k, h in single["loaded"].items())
    for (loss, norm), (want_loss, want_norm) in zip(single["runs"],
                                                    ranks[0]["straight"]["runs"][2:]):
        assert rel(loss, want_loss) <= LOSS and rel(norm, want_norm) <= NORM


def test_the_planner_counts_each_stages_records_over_its_own_ranks():
    """Llama-3.1-8B, pp 4 x dp 2 x tp 8 on 8-GPU nodes: each pipeline rank reduces its
    own layers' records (3 per linear, 7 linears a layer) over its stage's 16 ranks, two
    nodes of consecutive ranks (pp outermost); over the pp ranks every layer once."""
    from fivefold.models.presets import preset
    from fivefold.plan.comm import collectives
    from fivefold.plan.hardware import CATALOG
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.network import group_nodes, group_shape
    from fivefold.plan.placement import layers_on_rank

    model = preset("llama-3.1-8b")
    work = Workload(model, seq_len=2048, gbs=64, precision="fp8", fp8_recipe="tensorwise",
                    fp8_scaling="delayed")
    layout = Layout(dp=2, tp=8, pp=4, mbs=1)
    records = []
    for rank in range(4):
        amax = [c for c in collectives(work, layout, rank) if c.group == "stage"]
        assert [(c.op, c.calls, c.group_size, c.dtype_bytes) for c in amax] == [
            ("all_reduce", 1, 16, 4)]
        assert amax[0].elements == 3 * 7 * layers_on_rank(model, layout, rank)
        records.append(amax[0].elements)
    assert sum(records) == 3 * 7 * model.num_layers
    assert group_shape(layout, "stage") == (16, 1)
    assert group_nodes(CATALOG["h100-sxm"], layout, "stage") == 2
    dynamic = dataclasses.replace(work, fp8_scaling="dynamic")
    assert not [c for c in collectives(dynamic, layout, 0) if c.group == "stage"]
