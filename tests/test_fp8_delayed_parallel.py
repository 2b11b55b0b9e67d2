"""Delayed FP8 scaling (lowp/delayed.py) under data, context and tensor parallelism and
under recomputation, against the single-device delayed run of the same global batch.

The error model. Within a step every cast of an operand takes one scale: the history's as
the step began (after one all_reduce(max) of the previous step's records over dp x cp, the
same on every rank and the single device's), or on the first step each tensor's own amax.
Every micro-batch a dp rank runs is a micro-batch the single device runs, so each FP8 cast
and GEMM of a micro-batch is the single device's, bit for bit. What differs is only where
the micro-batches' weight gradients are summed: the single device accumulates 4 in one
buffer, dp2 accumulates 2 per rank and sums the ranks'. So:
  - step 1's amax records are bit-equal (its forward and backward are the single
    device's), and its loss differs only by the order of the fp32 sum of the micro-batches'
    token losses over ranks: 1e-6 relative (a few float32 roundings, 2^-24 each);
  - later steps differ by the rounding of gradients summed in another order, as any dp run
    does: the tolerances of the dynamic dp2 + ZeRO-3 case of tests/test_fp8_parallel.py,
    loss 1e-4 and gradient norm 3e-3 relative per step (bf16 gradients; a changed last bit
    of a weight may move a weight's amax, and with it that weight's scale, in later steps,
    as it moves a dynamic scale);
  - every rank's histories are bit-equal to every other rank's after every step (the
    all-reduced records).
cp2 is not bit-equal at step 1: each rank holds half of every sequence, so on the first
step (no history yet) a tensor's own amax is its half's, not the whole sequence's (as
dynamic tensorwise under cp); from step 2 the scales are the reduced histories'. Its
tolerance is the dynamic cp2 case's: loss 1e-4, gradient norm 5e-3 (measured: loss <= 4.3e-5,
gradient norm <= 5.7e-4). tp2 (with and without SP) likewise: on step 1 a weight's scale is
its shard's and a row-parallel input's its half of the channels'; from step 2 the reduced
records (over dp x cp x tp: every rank, the `stage` group without pp) give the whole
tensors' scales; and each rank's partial output of a row-parallel linear is rounded to
bf16 before the all-reduce sums it.
Tolerance: the dynamic tp2 rowwise case's, loss 3e-4, gradient norm 1e-2 (measured: loss
<= 1.6e-5, gradient norm <= 1.9e-3). Measured for dp2 (ZeRO 0, 1, 3): loss <= 3e-6, gradient
norm <= 9.8e-4.
"""

import pathlib

import torch
from common import small_config
from harness import run_ranks

from fivefold.lowp.delayed import histories
from fivefold.parallel.mesh import ParallelDims
from fivefold.plan.comm import ledger_volume
from fivefold.plan.inputs import training_plan_inputs
from fivefold.train.trainer import Trainer

DELAYED = ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
           "--train.fp8_scaling", "delayed", "--train.fp8_history_len", "4",
           "--train.gbs", "8", "--parallel.mbs", "2", "--train.lr", "1e-3"]
STEPS = 3


def train(rank, world, tmp, args, steps=STEPS):
    """STEPS delayed steps: (loss, grad norm) per step, the histories after step 1 and
    after the last step, the last step's amax all-reduces, and its all-reduce bytes by group
    (ledger and planner)."""
    cfg = small_config(pathlib.Path(tmp), *DELAYED, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    dims.ledger.enabled = True
    runs, after = [], []
    for _ in range(steps):
        rec = trainer.train_step()
        runs.append((rec["loss"], rec["grad_norm"]))
        after.append({k: h.clone() for k, h in histories(trainer.model.chunks[0]).items()})
    amax = [e for e in dims.ledger.entries if (e.group, e.op) == ("stage", "all_reduce")]
    trainer.close()
    reduced, planned = all_reduce_bytes(cfg, dims)
    return {"runs": runs, "first": after[0], "last": after[-1],
            "amax": [(e.elements, e.bytes) for e in amax], "linears": len(after[0]),
            "ledger": reduced, "planned": planned}


def all_reduce_bytes(cfg, dims) -> tuple[dict, dict]:
    """All-reduce bytes by group of the steps the ledger recorded, and the planner's for the
    same config and pipeline rank (plan/comm.py `ledger_volume`)."""
    work, layout = training_plan_inputs(cfg)
    planned = {g: ops.get("all_reduce", 0)
               for g, ops in ledger_volume(work, layout, dims.pp_rank).items()}
    reduced = {g: sum(e.bytes for e in dims.ledger.entries if (e.group, e.op) == (g,
                                                                               "all_reduce"))
               for g in planned}
    return reduced, planned


def every_layout(rank, world, tmp, layouts):
    return {name: train(rank, world, f"{tmp}/{name}", args) for name, args in layouts.items()}


def rel(a, b):
    return abs(a - b) / abs(b)


LAYOUTS = {"dp2": ["--parallel.dp", "2"],
           "dp2-zero1": ["--parallel.dp", "2", "--parallel.zero", "1"],
           "dp2-zero3": ["--parallel.dp", "2", "--parallel.zero", "3"]}


def test_delayed_dp2_zero1_zero3_track_the_single_device_delayed_run(tmp_path):
    ref = train(0, 1, str(tmp_path / "ref"), [])
    assert ref["amax"] == []  # one device: nothing to reduce
    ranks = run_ranks(every_layout, 2, str(tmp_path), LAYOUTS)
    for name in LAYOUTS:
        a, b = ranks[0][name], ranks[1][name]
        assert a["runs"] == b["runs"], name
        for k in ref["first"]:  # step 1's records: the single device's; then one scale
            assert all(torch.equal(r["first"][k], ref["first"][k]) for r in (a, b)), (name, k)
            assert torch.equal(a["last"][k], b["last"][k]), (name, k)
        # step 1: the same casts and GEMMs; only the fp32 sums of the loss over ranks
        assert rel(a["runs"][0][0], ref["runs"][0][0]) <= 1e-6, name
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(a["runs"],
                                                                        ref["runs"])):
            assert rel(loss, ref_loss) <= 1e-4, (name, step, loss, ref_loss)
            assert rel(norm, ref_norm) <= 3e-3, (name, step, norm, ref_norm)
        # one all_reduce(max) a step of every linear's 3 fp32 records; the planner's too
        assert a["amax"] == [(3 * a["linears"], 12 * a["linears"])], (name, a["amax"])
        assert a["planned"] == a["ledger"], (name, a["planned"], a["ledger"])


# name: (layout, loss tolerance, gradient-norm tolerance), the module docstring's
SPLIT = {"cp2": (["--parallel.cp", "2"], 1e-4, 5e-3),
         "tp2": (["--parallel.tp", "2"], 3e-4, 1e-2),
         "tp2-sp": (["--parallel.tp", "2", "--parallel.sp", "true"], 3e-4, 1e-2)}


def test_delayed_cp2_tp2_track_the_single_device_delayed_run(tmp_path):
    ref = train(0, 1, str(tmp_path / "ref"), [])
    ranks = run_ranks(every_layout, 2, str(tmp_path),
                      {name: args for name, (args, _, _) in SPLIT.items()})
    for name, (_, loss_tol, norm_tol) in SPLIT.items():
        a, b = ranks[0][name], ranks[1][name]
        assert a["runs"] == b["runs"], name
        assert all(torch.equal(a["last"][k], b["last"][k]) for k in a["last"]), name
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(a["runs"],
                                                                        ref["runs"])):
            assert rel(loss, ref_loss) <= loss_tol, (name, step, loss, ref_loss)
            assert rel(norm, ref_norm) <= norm_tol, (name, step, norm, ref_norm)
        assert a["amax"] == [(3 * a["linears"], 12 * a["linears"])], (name, a["amax"])
        assert a["planned"] == a["ledger"], (name, a["planned"], a["ledger"])


def test_recompute_is_bit_equal_to_no_recompute(tmp_path):
    """A recomputed forward casts with the step's one scale and folds the same amax again:
    losses, gradient norms and histories bit-equal to the run without recomputation (full
    and selective), tolerance 0."""
    small = ["--train.gbs", "4"]  # 2 micro-batches a step; step 2 casts from the history
    plain = train(0, 1, str(tmp_path / "plain"), small, steps=2)
    assert all(h.any() for h in plain["last"].values())
    for recompute in ("full", "selective"):
        again = train(0, 1, str(tmp_path / recompute), [*small, "--train.recompute", recompute],
                      steps=2)
        assert again["runs"] == plain["runs"], recompute
        assert all(torch.equal(again["last"][k], plain["last"][k]) for k in plain["last"])


def straight_and_resumed(rank, world, tmp, layouts):
    """Per layout: 4 steps straight; 2 steps, a checkpoint, 2 resumed steps."""
    out = {}
    for name, layout in layouts.items():
        runs = {}
        for run, where, steps, extra in (("straight", "a", 4, []), ("first", "b", 2, []),
                                         ("resumed", "b", 2, ["--checkpoint.resume", "latest"])):
            cfg = small_config(pathlib.Path(tmp) / name / where, *DELAYED, *layout,
                               "--train.steps", "4", *extra)
            trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
            records = [trainer.train_step() for _ in range(steps)]
            runs[run] = ([(r["loss"], r["grad_norm"]) for r in records],
                         {k: h.clone() for k, h in histories(trainer.model.chunks[0]).items()})
            if run == "first":
                trainer.save_checkpoint()
            trainer.close()
        out[name] = runs
    return out


def test_resume_under_dp_zero3_and_tp_keeps_the_run_bit_exact(tmp_path):
    """The histories (equal on every rank after the reduction) are saved and loaded with
    the checkpoint: the resumed steps' losses, gradient norms and histories are the
    uninterrupted run's, bit for bit; also with ZeRO-3's FP8 all-gather, whose scales come
    from the loaded histories (parallel/zero3_fp8.py)."""
    layouts = {"dp2-zero3": ["--parallel.dp", "2", "--parallel.zero", "3"],
               "dp2-zero3-fp8-allgather": ["--parallel.dp", "2", "--parallel.zero", "3",
                                           "--parallel.fp8_allgather", "true"],
               "tp2": ["--parallel.tp", "2"]}
    for result in run_ranks(straight_and_resumed, 2, str(tmp_path), layouts):
        for name, runs in result.items():
            (straight, want), (resumed, got) = runs["straight"], runs["resumed"]
            assert straight[2:] == resumed, name
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_kept_out_linears_record_no_amax_and_the_planner_counts_the_rest(tmp_path):
    """train.fp8_keep_out: a kept-out linear (bf16) keeps no history and records nothing, so
    the step's one all_reduce(max) carries 3 fp32 records per FP8 linear only; the planner's
    all-reduce bytes of every group equal the ledger's (dp2, and dp2 ZeRO-3 with the FP8
    all-gather, whose amaxes of the FP8 weights alone ride in the dp group's)."""
    keep = ["--train.fp8_keep_out", "layers.0.mlp,*.q_proj"]
    layouts = {"dp2": ["--parallel.dp", "2", *keep],
               "dp2-zero3-fp8-allgather": ["--parallel.dp", "2", "--parallel.zero", "3",
                                           "--parallel.fp8_allgather", "true", *keep]}
    ranks = run_ranks(every_layout, 2, str(tmp_path), layouts)
    for name in layouts:
        a = ranks[0][name]
        assert a["linears"] == 2 * 7 - 3 - 2, name  # 2 blocks of 7; layer 0's MLP, both q
        assert a["amax"] == [(3 * a["linears"], 12 * a["linears"])], (name, a["amax"])
        assert a["planned"] == a["ledger"], (name, a["planned"], a["ledger"])
