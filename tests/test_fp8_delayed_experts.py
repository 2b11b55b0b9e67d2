"""Delayed FP8 scaling (lowp/delayed.py) of routed experts: an amax history per expert and
projection (w_gate, w_up, w_down; x, W and ∂y each), against the single-device run.

What one device does: the tensorwise experts run a loop over the experts (lowp/experts.py),
and an expert that meets no token in a micro-batch casts nothing there, so it records
nothing; in a step where it met no token at all its history does not move (no 0 record is
pushed) and its next scale is the one it had. Under data parallelism an expert may meet
tokens on one rank and none on another: each rank sends a flag with its records, and
`end_step` pushes an expert's reduced record where any rank recorded it, so every rank
pushes what the single device pushes.

The error model is that of tests/test_fp8_delayed_parallel.py and
tests/test_fp8_delayed_pp.py: dp2 and pp2 run each micro-batch through the single device's
casts (an expert's rows of a micro-batch are the same rows), so step 1's records, experts'
included, are bit-equal and later steps differ by gradients summed in another order: loss
1e-4, gradient norm 3e-3 relative per step (measured: loss <= 1.7e-5, gradient norm <=
4.4e-4). Under ep2 an expert's rows in a micro-batch come from both ranks' micro-batches, so
on the first step (no history yet) its own amax is that union's, as dynamic tensorwise's is
there, and from step 2 the scales are the reduced histories': the cp2 tolerances, loss 1e-4
and gradient norm 5e-3 (measured: loss <= 5.0e-5, gradient norm <= 9.7e-4).
"""

import pathlib

import pytest
import torch
import torch.distributed as dist
from common import small_config
from harness import run_ranks
from test_fp8_delayed_parallel import all_reduce_bytes
from torch import nn

from fivefold.lowp.convert import convert_to_fp8
from fivefold.lowp.delayed import end_step, histories
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.moe import GroupedExperts
from fivefold.parallel.mesh import ParallelDims
from fivefold.train.trainer import Trainer

E, H, I = 4, 32, 16  # noqa: E741


def experts_model() -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = GroupedExperts(E, H, I, impl="loop")
    for w in holder.experts.parameters():
        nn.init.normal_(w, std=0.2)
    holder.to(torch.bfloat16)
    convert_to_fp8(holder, FP8Recipe.from_name("tensorwise", scaling="delayed",
                                               history_len=4))
    return holder.experts


def micro_batch(seed: int, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(counts), H, generator=g) * (1 + seed)).bfloat16()
    return x.requires_grad_(), torch.randn(sum(counts), H, generator=g).bfloat16()


def run(experts, batches) -> None:
    for seed, counts in batches:
        x, g = micro_batch(seed, counts)
        experts(x, torch.tensor(counts)).backward(g)


# step: the micro-batches (seed, tokens per expert) of rank 0 and of rank 1; expert 3 meets
# no token in step 1, expert 1 none on rank 0, expert 2 none on rank 1; expert 0 none in step 3
STEPS = [([(0, [3, 0, 5, 0])], [(1, [4, 6, 0, 0])]),
         ([(2, [2, 3, 4, 5])], [(3, [5, 4, 3, 2])]),
         ([(4, [0, 3, 4, 5])], [(5, [0, 4, 3, 2])])]


def two_ranks(rank, world):
    experts, after, known = experts_model(), [], []
    for batches in STEPS:
        run(experts, batches[rank])
        end_step([experts], lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))
        after.append(experts.fp8_amax_history.clone())
        known.append(experts._fp8_filled is not None)
    return after, known


def test_an_expert_without_tokens_pushes_nothing_on_one_device_and_under_dp2():
    one, after = experts_model(), []
    for batches in STEPS:
        run(one, [*batches[0], *batches[1]])  # the global batch: both ranks' micro-batches
        end_step([one])
        after.append(one.fp8_amax_history.clone())
    first, second, third = after
    assert not first[3].any()  # expert 3 met no token: no record, not a 0 pushed
    assert first[:3, :, :, 0].amax(-1).gt(0).all() and not first[:, :, :, 1:].any()
    assert torch.equal(second[3, :, :, 1:], torch.zeros_like(second[3, :, :, 1:]))
    assert torch.equal(third[0], second[0])  # expert 0 idle in step 3: its history kept
    assert torch.equal(third[1:, :, :, 1:], second[1:, :, :, :-1])  # the others moved
    for ranks, known in run_ranks(two_ranks, 2):  # each rank the single device's, bitwise
        assert all(torch.equal(a, b) for a, b in zip(ranks, after))
        # which rows hold a record is read from the device again (one host sync) only
        # after a step where some expert met no token on this rank: not after step 2
        assert known == [False, True, False]


DELAYED = ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
           "--train.fp8_scaling", "delayed", "--train.fp8_history_len", "4",
           "--train.gbs", "8", "--parallel.mbs", "2", "--train.lr", "1e-3",
           "--model.num_experts", "4", "--model.experts_top_k", "2",
           "--model.moe_intermediate_size", "16"]


def train(rank, world, tmp, args, steps=3, save=False):
    cfg = small_config(pathlib.Path(tmp), *DELAYED, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    dims.ledger.enabled = True
    loaded = {k: h.clone() for c in trainer.model.chunks for k, h in histories(c).items()}
    runs, after = [], []
    for _ in range(steps):
        rec = trainer.train_step()
        runs.append((rec["loss"], rec["grad_norm"]))
        after.append({k: h.clone() for c in trainer.model.chunks
                      for k, h in histories(c).items()})
    amax = [e.elements for e in dims.ledger.entries if (e.group, e.op) == ("stage",
                                                                           "all_reduce")]
    if save:
        trainer.save_checkpoint()
    ep = next((m._ep_range for m in trainer.model.chunks[0].modules()
               if hasattr(m, "_ep_range")), None)
    trainer.close()
    reduced, planned = all_reduce_bytes(cfg, dims)
    return {"runs": runs, "after": after, "amax": amax, "planned": planned, "ledger": reduced,
            "loaded": loaded, "ep": ep}


LAYOUTS = {"dp2": (["--parallel.dp", "2"], 1e-4, 3e-3),
           "pp2": (["--parallel.pp", "2"], 1e-4, 3e-3),
           "ep2": (["--parallel.dp", "2", "--parallel.ep", "2"], 1e-4, 5e-3)}


def every_layout(rank, world, tmp):
    out = {name: train(rank, world, f"{tmp}/{name}", args)
           for name, (args, _, _) in LAYOUTS.items()}
    return out


def rel(a, b):
    return abs(a - b) / abs(b)


def test_delayed_experts_under_dp2_pp2_ep2_track_the_single_device(tmp_path):
    ref = train(0, 1, str(tmp_path / "ref"), [])
    experts = [k for k in ref["after"][0] if k.endswith("experts")]
    assert len(experts) == 2 and all(ref["after"][0][k].shape == (4, 3, 3, 4)
                                     for k in experts)
    ranks = run_ranks(every_layout, 2, str(tmp_path))
    for name, (_, loss_tol, norm_tol) in LAYOUTS.items():
        a, b = ranks[0][name], ranks[1][name]
        assert a["runs"] == b["runs"], name
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(a["runs"],
                                                                        ref["runs"])):
            assert rel(loss, ref_loss) <= loss_tol, (name, step, loss, ref_loss)
            assert rel(norm, ref_norm) <= norm_tol, (name, step, norm, ref_norm)
        for r in (a, b):
            assert r["planned"] == r["ledger"], (name, r["planned"], r["ledger"])
            if name != "ep2":  # step 1's records, experts' included: the single device's
                assert all(torch.equal(h, ref["after"][0][k])
                           for k, h in r["after"][0].items()), name
    for step in range(3):  # dp2: the same rows on both ranks after every step
        one, other = ranks[0]["dp2"]["after"][step], ranks[1]["dp2"]["after"][step]
        assert all(torch.equal(one[k], other[k]) for k in one)
    # ep2: 2 layers x (q, k, v, o + all 4 experts' 3 projections with a flag each) x 3
    assert ranks[0]["ep2"]["amax"] == [2 * (4 * 3 + 4 * 9 * 2)]
    assert [r["ep2"]["ep"] for r in ranks] == [(0, 2, 4), (2, 4, 4)]
    for k in experts:  # ep2: each rank holds its experts' rows, every one recorded
        assert all(r["ep2"]["after"][-1][k].shape == (2, 3, 3, 4) for r in ranks)


def test_an_ep2_checkpoint_of_expert_histories_resumes_on_one_device(tmp_path):
    """Saved under ep2 (each rank its 2 experts' rows), loaded by one device: its 4
    experts' histories are the two ranks' rows, bit for bit."""
    saved = run_ranks(train, 2, str(tmp_path), LAYOUTS["ep2"][0], 2, True)
    one = train(0, 1, str(tmp_path), ["--checkpoint.resume", "latest"], 1)
    for k, h in one["loaded"].items():
        if k.endswith("experts"):
            want = torch.cat([saved[0]["after"][-1][k], saved[1]["after"][-1][k]])
        else:
            want = saved[0]["after"][-1][k]
        assert torch.equal(h, want), k
    assert all(h.any() for h in one["loaded"].values())


FUSED = r"""
import json, torch
from torch import nn
from fivefold.lowp import fused, linear
from fivefold.lowp.convert import convert_to_fp8
from fivefold.lowp.delayed import end_step
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.moe import GroupedExperts

def run(use_fused):
    fused.fused = (lambda t: True) if use_fused else (lambda t: False)
    linear._LAST[0] = None
    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = GroupedExperts(4, 64, 32, impl="loop")
    for w in holder.experts.parameters():
        nn.init.normal_(w, std=0.2)
    convert_to_fp8(holder, FP8Recipe.from_name("tensorwise", scaling="delayed", history_len=4))
    experts, out = holder.experts, []
    for step, counts in enumerate(([5, 0, 7, 3], [4, 6, 2, 8], [0, 3, 9, 4])):
        x = (torch.randn(sum(counts), 64) * (1 + step)).requires_grad_()
        experts.zero_grad()
        y = experts(x, torch.tensor(counts))
        y.backward(torch.randn_like(y))
        end_step([experts])
        out += [y.detach(), x.grad, *(p.grad.clone() for p in experts.parameters())]
    return out + [experts.fp8_amax_history.clone()]

from fivefold.numerics import fp8_cast
calls, cast = [0], fp8_cast.fp8_cast_delayed
def counted(*args):
    calls[0] += 1
    return cast(*args)
fp8_cast.fp8_cast_delayed = counted
ref = run(False)
before = calls[0]
got = run(True)
print(json.dumps([[bool(torch.equal(a, b)) for a, b in zip(ref, got)], before, calls[0]]))
"""


@pytest.mark.slow  # Triton's interpreter: about 20 s
def test_delayed_experts_on_the_fused_casts_in_the_interpreter():
    """The GPU's path (the fused delayed cast and amax fold of numerics/fp8_cast.py, on each
    expert projection's rows of the histories) against the CPU's, fp32 in Triton's
    interpreter, three steps with idle experts: outputs, gradients and histories bit-equal."""
    from common import run_interpreted

    same, cpu_casts, fused_casts = run_interpreted(["-c", FUSED])
    assert len(same) == 3 * 5 + 1 and all(same), same
    # the fused run cast every operand of every expert that met tokens on the GPU's kernel:
    # W, ∂y and Wᵀ of each projection, x of gate (up shares it) and of down: 11 a step
    # for each expert that met tokens (3, 4, 3 of them in the three steps)
    assert cpu_casts == 0 and fused_casts == 11 * (3 + 4 + 3), (cpu_casts, fused_casts)
