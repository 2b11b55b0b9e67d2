"""Pipeline parallelism against the single-process run (the oracle) and
torch.distributed.pipelining.

Every case runs the real Trainer (`small_config`: hidden 32, seq 32, mbs 1, fp32, tiny's
tied embeddings unless stated) for 2 optimizer steps and compares, step by step, with the
single-process Trainer over the same global batches:
  losses and the validation loss (forward-only pass) within LOSS_RTOL relative; gradient
  norms and every gathered gradient of the last step (after one AdamW step) within GRAD_RTOL
  relative in the tensor's norm (||a - b|| / ||b||) — both copies of a tied embedding
  included. Both come from the float32 error model of tests/tolerances.py.
What else is checked in the same runs, exactly: the executor's measured peak of stored
activations per rank equals `check.peak_inflight`, and the ledger holds one activation
send per micro-batch and stage boundary and one gradient send back, of b·s·h elements each.
One start of the ranks serves every configuration of a pp size.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from common import small_config
from harness import run_ranks
from tolerances import loss_rtol, trained_rtol, within

from fivefold.config import ConfigError, load
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.pipeline.check import peak_inflight
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.parallel.pipeline.stages import layer_ranges
from fivefold.train.trainer import Trainer

STEPS, HIDDEN, SEQ = 2, 32, 32
# Error model (tests/tolerances.py) at the largest case: m ≤ 8 sequences of SEQ tokens per
# step, ≤ 8 blocks of 3 GEMMs each (ffn 64); the compared gradients are the second step's,
# taken after an AdamW step.
LOSS_RTOL = loss_rtol(tokens=8 * SEQ, depth=3 * 8)
GRAD_RTOL = trained_rtol(tokens=8 * SEQ, depth=3 * 8)
SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "dualpipev")


def cases(pp: int) -> list[tuple[str, int]]:
    """Every schedule at m = pp and m = 2·pp (DualPipeV needs m >= 2·pp)."""
    return [(s, m) for s in SCHEDULES for m in (pp, 2 * pp) if s != "dualpipev" or m >= 2 * pp]


def pp_args(pp: int, schedule: str, m: int, layers: int, *extra: str) -> list[str]:
    return [
        "--model.num_layers",
        str(layers),
        "--train.gbs",
        str(m),
        "--parallel.pp",
        str(pp),
        "--parallel.schedule",
        schedule,
        "--parallel.virtual_stages",
        "2" if schedule == "interleaved" else "1",
        *extra,
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run_trainer(trainer: Trainer, steps: int = STEPS) -> dict:
    records = [trainer.train_step() for _ in range(steps)]
    return {
        "losses": [r["loss"] for r in records],
        "norms": [r["grad_norm"] for r in records],
        "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()},
    }


def reference(tmp_path, m: int, layers: int, *extra: str) -> dict:
    trainer = Trainer(
        small_config(tmp_path, *pp_args(1, "1f1b", m, layers)[:4], *extra), quiet=True
    )
    out = run_trainer(trainer)
    out["val"] = trainer.evaluate()["val_loss"]
    return out


def _pipeline_cases(rank, world, tmp_path, todo, layers):
    out = {}
    for schedule, m in todo:
        cfg = small_config(tmp_path, *pp_args(world, schedule, m, layers))
        dims = ParallelDims.from_config(cfg.parallel)
        dims.ledger.enabled = True
        trainer = Trainer(cfg, dims, quiet=True)
        trainer.pipeline.count_activations = True
        result = run_trainer(trainer)
        # The ledger of the last training step: point-to-point messages on the pp group.
        result["p2p"] = [
            (e.op, e.elements)
            for e in dims.ledger.entries
            if e.group == "pp" and e.op in ("send", "recv")
        ]
        result["peak"] = trainer.pipeline.peak_stored
        result["val"] = trainer.evaluate()["val_loss"]
        trainer.pipeline.close()
        out[(schedule, m)] = result
    return out


def check_parity(got: dict, ref: dict, where: str) -> None:
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert within(abs(a - b) / b, LOSS_RTOL, where), f"{where}: loss {a} vs {b}"
    for a, b in zip(got["norms"], ref["norms"], strict=True):
        assert within(abs(a - b) / b, GRAD_RTOL, where), f"{where}: grad norm {a} vs {b}"
    assert within(abs(got["val"] - ref["val"]) / ref["val"], LOSS_RTOL, where), where


def check_grads(per_rank: list[dict], ref: dict, where: str) -> None:
    seen = set()
    for grads in per_rank:
        for name, grad in grads.items():
            err = rel(grad, ref["grads"][name])
            assert within(err, GRAD_RTOL, f"{where} {name}"), f"{where}: {name} {err:.3g}"
            seen.add(name)
    assert seen == set(ref["grads"]), f"{where}: missing {set(ref['grads']) - seen}"


def check_ledger(per_rank: list[list], pp: int, schedule: str, m: int) -> None:
    """Per micro-batch and stage boundary between two ranks, one activation goes forward
    and one gradient comes back, each of b·s·h elements (b = mbs = 1)."""
    sched = build_schedule(schedule, pp, m, 2 if schedule == "interleaved" else 1)
    boundaries = sum(sched.rank_of(s) != sched.rank_of(s + 1) for s in range(sched.num_stages - 1))
    expected = (sched.num_stages - 1) if schedule != "dualpipev" else 2 * pp - 2
    assert boundaries == expected  # the V's bottom is handed over in memory
    elements = 1 * SEQ * HIDDEN
    for op in ("send", "recv"):
        messages = [n for entries in per_rank for kind, n in entries if kind == op]
        assert len(messages) == 2 * m * boundaries, f"{schedule} m={m}: {op} count"
        assert set(messages) == {elements}, f"{schedule} m={m}: {op} sizes"


def pipeline_grid(tmp_path, pp: int) -> None:
    layers = 8  # at least pp·v stages for every case
    todo = cases(pp)
    results = run_ranks(_pipeline_cases, pp, tmp_path, todo, layers)
    refs = {m: reference(tmp_path, m, layers) for m in {m for _, m in todo}}
    for schedule, m in todo:
        where = f"pp={pp} {schedule} m={m}"
        per_rank = [r[(schedule, m)] for r in results]
        loss_rank = build_schedule(schedule, pp, m, 2 if schedule == "interleaved" else 1)
        for got in per_rank:  # every rank reports the global loss and norm
            check_parity(got, refs[m], where)
        check_grads([r["grads"] for r in per_rank], refs[m], where)
        check_ledger([r["p2p"] for r in per_rank], pp, schedule, m)
        assert [r["peak"] for r in per_rank] == peak_inflight(loss_rank), where


@pytest.mark.parity
def test_pipeline_matches_single_process_pp2(tmp_path):
    pipeline_grid(tmp_path, 2)


@pytest.mark.parity
@pytest.mark.slow
def test_pipeline_matches_single_process_pp4(tmp_path):
    pipeline_grid(tmp_path, 4)


UNTIED = ("--model.tie_embeddings", "false")


def _cases_with(rank, world, tmp_path, todo, layers, extra):
    out = {}
    for schedule, m in todo:
        cfg = small_config(tmp_path, *pp_args(world, schedule, m, layers, *extra))
        trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
        out[(schedule, m)] = run_trainer(trainer)
        out[(schedule, m)]["val"] = trainer.evaluate()["val_loss"]
        trainer.pipeline.close()
    return out


def parity_with(tmp_path, todo, extra, label):
    ref = reference(tmp_path, 4, 4, *extra)
    results = run_ranks(_cases_with, 2, tmp_path, todo, 4, extra)
    for case in todo:
        per_rank = [r[case] for r in results]
        for got in per_rank:
            check_parity(got, ref, f"{label} {case}")
        check_grads([r["grads"] for r in per_rank], ref, f"{label} {case}")


@pytest.mark.parity
def test_untied_pipeline_matches_single_process(tmp_path):
    """Untied embeddings (the head is a weight of its own): the first stage's embedding is
    not half of a tied pair, so the gradient norm counts it once. pp 2, the loop layout
    (1F1B) and the V (DualPipeV, both ends on rank 0): losses, norms, gradients as above."""
    parity_with(tmp_path, [("1f1b", 4), ("dualpipev", 4)], UNTIED, "untied")


@pytest.mark.parity
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_split_backward_with_recomputation_matches_single_process(tmp_path, recompute):
    """A split backward over recomputed blocks: B recomputes, W still finds every weight
    use. pp 2, ZB-H1 and DualPipeV: losses, norms, gradients as above."""
    parity_with(tmp_path, [("zb", 4), ("dualpipev", 4)], ("--train.recompute", recompute),
                f"recompute={recompute}")


def _split_cases(rank, world, tmp_path, todo):
    out = {}
    for schedule, layers, extra in todo:
        cfg = small_config(tmp_path, *pp_args(world, schedule, 4, layers, *extra))
        trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
        result = run_trainer(trainer)
        result["val"] = trainer.evaluate()["val_loss"]
        result["layers"] = [c.layer_ids for c in trainer.model.chunks]
        trainer.pipeline.close()
        out[(schedule, layers, extra)] = result
    return out


@pytest.mark.parity
def test_stage_splits_match_single_process(tmp_path):
    """Uneven stage splits (an explicit list, and the cost-balanced split of a model whose
    head costs 1.8 layers) train exactly as one process: losses, norms, gradients."""
    vocab = ("--model.vocab_size", "1024")
    todo = [("1f1b", 4, ("--parallel.pp_layers", "1,3")),
            ("zb", 4, ("--parallel.pp_layers", "3,1")),
            ("interleaved", 6, ("--parallel.pp_layers", "1,2,2,1")),
            ("1f1b", 4, ("--parallel.pp_split", "balanced", *vocab))]
    results = run_ranks(_split_cases, 2, tmp_path, todo)
    expected = {0: [[0], [0, 1, 2], None, [0, 1, 2]], 1: [[1, 2, 3], [3], None, [3]]}
    for i, (schedule, layers, extra) in enumerate(todo):
        ref = reference(tmp_path, 4, layers, *(vocab if vocab[0] in extra else ()))
        per_rank = [r[(schedule, layers, extra)] for r in results]
        for got in per_rank:
            check_parity(got, ref, f"{schedule} {extra}")
        check_grads([r["grads"] for r in per_rank], ref, f"{schedule} {extra}")
        if schedule != "interleaved":
            assert [r["layers"][0] for r in per_rank] == [expected[0][i], expected[1][i]]
    # interleaved [1, 2, 2, 1]: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    inter = [r[todo[2]]["layers"] for r in results]
    assert inter == [[[0], [3, 4]], [[1, 2], [5]]], inter


# --------------------------------------------------------------------------- torch pipelining


def _bench_module():
    path = Path(__file__).resolve().parents[1] / "bench" / "parallel" / "pp_vs_torch.py"
    spec = importlib.util.spec_from_file_location("pp_vs_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _against_torch(rank, world, tmp_path, m):
    bench = _bench_module()
    out = {}
    for name in SCHEDULES:
        for side in ("fivefold", "torch"):
            v = (
                bench.torch_virtual(name)
                if side == "torch"
                else (2 if name == "interleaved" else 1)
            )
            layout = "interleaved" if side == "torch" and name == "zb" else name
            cfg = small_config(
                tmp_path,
                "--model.num_layers",
                "4",
                "--model.tie_embeddings",
                "false",
                *bench.fivefold_overrides(layout, world, m, v),
            )
            trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
            micro_batches = trainer.loader.next_batch()
            tokens = trainer.loader.num_target_tokens
            trainer.optimizer.zero_grad()
            if side == "torch":
                schedule = bench.torch_schedule(
                    trainer.model.chunks, trainer.dims["pp"], name, m, tokens
                )
                loss = bench.torch_step(schedule, trainer.model.chunks, micro_batches)
            else:
                loss = trainer.pipeline.run(micro_batches, tokens)
                loss = loss / tokens if any(c.last for c in trainer.model.chunks) else None
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
            out[(name, side)] = (None if loss is None else float(loss), grads)
    return out


@pytest.mark.parity
def test_same_losses_and_grads_as_torch_pipelining(tmp_path):
    """pp 2, m 4, untied: each fivefold schedule and its torch.distributed.pipelining
    counterpart, over the same stage modules and data: same loss (1e-6) and gradients (1e-5)."""
    results = run_ranks(_against_torch, 2, tmp_path, 4)
    for name in SCHEDULES:
        losses = {
            side: [r[(name, side)][0] for r in results if r[(name, side)][0] is not None]
            for side in ("fivefold", "torch")
        }
        assert len(losses["fivefold"]) == len(losses["torch"]) == 1, name
        ours, theirs = losses["fivefold"][0], losses["torch"][0]
        assert within(abs(ours - theirs) / theirs, LOSS_RTOL, name), f"{name}: {ours} vs {theirs}"
        ours = {n: g for r in results for n, g in r[(name, "fivefold")][1].items()}
        theirs = {n: g for r in results for n, g in r[(name, "torch")][1].items()}
        assert ours.keys() == theirs.keys()
        for n in ours:
            assert within(rel(ours[n], theirs[n]), GRAD_RTOL, name), f"{name}: {n}"


# --------------------------------------------------------------------------- checkpoints


def _train_then_save(rank, world, tmp_path):
    cfg = small_config(tmp_path, *pp_args(world, "1f1b", 4, 4))
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    trainer.save_checkpoint()
    embed = {
        n: p.detach().clone()
        for n, p in trainer.model.named_parameters()
        if n == "embed_tokens.weight"
    }
    return losses, embed


def _resume(rank, world, tmp_path):
    cfg = small_config(tmp_path, *pp_args(world, "1f1b", 4, 4), "--checkpoint.resume", "latest")
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    assert trainer.step == STEPS
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


@pytest.mark.parity
def test_checkpoint_saved_at_pp2_resumes_at_pp1_and_pp4(tmp_path):
    """2 steps at pp 2, save; resume at pp 1 and at pp 4 for 2 more: the losses of an
    uninterrupted pp-1 run (LOSS_RTOL: a loss is stationary in the weights' rounding-sized
    differences). Both tied-embedding copies are equal when saved."""
    whole = Trainer(small_config(tmp_path / "ref", *pp_args(1, "1f1b", 4, 4)[:4]), quiet=True)
    expected = [whole.train_step()["loss"] for _ in range(2 * STEPS)]
    saved = run_ranks(_train_then_save, 2, tmp_path)
    for a, b in zip(saved[0][0], expected[:STEPS]):
        assert within(abs(a - b) / b, LOSS_RTOL, "saved at pp 2")
    first, last = (r[1]["embed_tokens.weight"] for r in saved)
    assert torch.equal(first, last)  # the replicas never drifted apart
    single = Trainer(
        small_config(tmp_path, *pp_args(1, "1f1b", 4, 4)[:4], "--checkpoint.resume", "latest"),
        quiet=True,
    )
    resumed = {1: [single.train_step()["loss"] for _ in range(STEPS)]}
    resumed[4] = run_ranks(_resume, 4, tmp_path)[0]
    for pp, losses in resumed.items():
        for a, b in zip(losses, expected[STEPS:], strict=True):
            assert within(abs(a - b) / b, LOSS_RTOL, pp), f"resumed at pp {pp}: {a} vs {b}"


# --------------------------------------------------------------------------- composition


def _composed(rank, world, tmp_path):
    cfg = small_config(
        tmp_path,
        *pp_args(2, "1f1b", 8, 4),
        "--parallel.tp",
        "2",
        "--parallel.dp",
        "2",
        "--parallel.zero",
        "1",
    )
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    records = [trainer.train_step() for _ in range(STEPS)]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


@pytest.mark.parity
@pytest.mark.slow
def test_pp2_tp2_dp2_zero1_matches_single_process(tmp_path):
    """8 ranks, 1F1B, ZeRO-1, tied embeddings: losses 1e-6 and gradient norms 1e-5."""
    ref = reference(tmp_path, 8, 4)
    for losses, norms in run_ranks(_composed, 8, tmp_path):
        for a, b in zip(losses, ref["losses"], strict=True):
            assert within(abs(a - b) / b, LOSS_RTOL, "pp2-tp2-dp2")
        for a, b in zip(norms, ref["norms"], strict=True):
            assert within(abs(a - b) / b, GRAD_RTOL, "pp2-tp2-dp2")


def _with_zero(rank, world, tmp_path, todo):
    out = {}
    for schedule, zero, bucket_mb in todo:
        cfg = small_config(tmp_path, *pp_args(2, schedule, 8, 8, "--parallel.dp", "2",
                                              "--parallel.zero", str(zero),
                                              "--parallel.bucket_mb", str(bucket_mb)))
        trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
        records = [trainer.train_step() for _ in range(STEPS)]
        out[(schedule, zero, bucket_mb)] = ([r["loss"] for r in records],
                                            [r["grad_norm"] for r in records])
        trainer.pipeline.close()
    return out


@pytest.mark.parity
@pytest.mark.slow
def test_pp2_dp2_under_zero_matches_single_process(tmp_path):
    """4 ranks, pp 2 × dp 2, tied embeddings, 4 micro-batches per dp rank. ZeRO-3 under every
    schedule: blocks gathered for forward, again for backward, and for the W pass of a split
    backward; DualPipeV's head borrows the embedding unit of the same rank. ZeRO-1 with
    ~60 buckets under the schedules whose chunks finish their gradients at different times
    (a bucket goes out only when its gradients are final). Losses 1e-6, gradient norms 1e-5."""
    todo = [(s, 3, 25.0) for s in SCHEDULES] + [(s, 1, 0.005) for s in ("interleaved",
                                                                       "dualpipev")]
    ref = reference(tmp_path, 8, 8)
    for per_rank in run_ranks(_with_zero, 4, tmp_path, todo):
        assert set(per_rank) == set(todo)
        for case, (losses, norms) in per_rank.items():
            for a, b in zip(losses, ref["losses"], strict=True):
                assert within(abs(a - b) / b, LOSS_RTOL, case), (case, a, b)
            for a, b in zip(norms, ref["norms"], strict=True):
                assert within(abs(a - b) / b, GRAD_RTOL, case), (case, a, b)


# --------------------------------------------------------------------------- bad input and units


@pytest.mark.parametrize(
    "args, words",
    [
        (pp_args(4, "interleaved", 6, 8), "multiple of pp=4"),
        (pp_args(2, "dualpipev", 3, 8), "num_microbatches >= 2*pp = 4"),
        (pp_args(4, "1f1b", 4, 3), "4 stages but model.num_layers = 3"),
        (pp_args(4, "interleaved", 4, 6), "8 stages but model.num_layers = 6"),
        (pp_args(2, "dualpipev", 4, 3), "4 stages but model.num_layers = 3"),
        (pp_args(2, "1f1b", 4, 4, "--parallel.pp_layers", "1,2"), "sums to 3"),
        (pp_args(2, "1f1b", 4, 4, "--parallel.pp_layers", "4"), "has 1 entries"),
        (pp_args(2, "1f1b", 4, 4, "--parallel.pp_layers", "0,4"), "at least one layer"),
        (pp_args(2, "1f1b", 4, 4, "--parallel.pp_split", "cost"), "parallel.pp_split"),
    ],
)
def test_bad_pipeline_configs_are_refused_in_one_line(tmp_path, args, words):
    with pytest.raises(ConfigError) as err:
        load(None, [*args, "--checkpoint.dir", str(tmp_path)])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_stage_names_are_logical_and_layers_balanced():
    assert [len(r) for r in layer_ranges(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in layer_ranges(8, 8)] == [1] * 8
    with pytest.raises(ValueError):
        layer_ranges(3, 4)
