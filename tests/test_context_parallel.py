"""Context parallelism: ring and all-gather attention against a plain reference, the
zig-zag balance, exact ledger counts, and whole-model parity through the trainer.

Tolerances (fp32): attention outputs and dQ/dK/dV ≤ 1e-5 relative (‖a − b‖ / ‖b‖) against
float64 math attention; against the single process, from the float32 error model of
tests/tolerances.py (4 sequences of 32 tokens per step, 2 blocks of 3 GEMMs): trainer losses
≤ LOSS_RTOL relative per step, gradient norms, every parameter's gradient after step one and
the parameters after the steps ≤ TRAINED_RTOL.
"""

import math

import pytest
import torch
from harness import run_ranks

from fivefold.parallel.context import ContextAttentionCore, shard_sequence
from fivefold.parallel.context.layout import (
    block_calls,
    local_chunks,
    local_positions,
    ring_sources,
    score_pairs_per_rank,
)
from fivefold.parallel.mesh import ParallelDims


def reference_attention(q, k, v):
    """Plain causal softmax attention in float64, kv heads shared by their query group."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double()


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def attention_case(rank, world, seq, heads, kv_heads):
    torch.manual_seed(0)
    shape = (2, heads, seq, 8)
    q = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(shape, dtype=torch.float64)
    ref = reference_attention(q, k, v)
    ref.backward(grad)
    dims = ParallelDims(cp=world, rank=rank)
    dims.build_groups()
    dims.ledger.enabled = True
    results = {}
    for scheme in ("ring", "allgather"):
        for layout in ("zigzag", "contiguous"):

            def local(t, layout=layout):  # this rank's tokens of (b, h, s, d), seq on dim 2
                return shard_sequence(t.detach().transpose(1, 2), layout, world,
                                      rank).transpose(1, 2).float()

            ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
            core = ContextAttentionCore(dims["cp"], layout, scheme)
            core.counter = []
            dims.ledger.reset()
            out = core(ql, kl, vl)
            forward_ledger = dims.ledger.totals()
            dims.ledger.reset()
            out.backward(local(grad))
            errors = {"out": rel(out, local(ref)), "dq": rel(ql.grad, local(q.grad)),
                      "dk": rel(kl.grad, local(k.grad)), "dv": rel(vl.grad, local(v.grad))}
            results[(scheme, layout)] = (errors, forward_ledger, dims.ledger.totals(),
                                         sum(core.counter))
    return results


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 2), (4, 4, 1)])
def test_attention_matches_reference(cp, heads, kv_heads):
    seq = 8 * cp
    c = seq // (2 * cp)
    for rank, results in enumerate(run_ranks(attention_case, cp, seq, heads, kv_heads)):
        for (scheme, layout), (errors, fwd, bwd, pairs) in results.items():
            for name, err in errors.items():
                assert err <= 1e-5, (cp, rank, scheme, layout, name, err)
            kv_bytes = 2 * 2 * kv_heads * 2 * c * 8 * 4  # (k, v) × b × kv heads × 2c × d, fp32
            if scheme == "ring":  # cp − 1 K/V transfers forward; cp − 1 again + cp dK/dV back
                assert fwd == {("cp", op): {"calls": cp - 1, "elements": (cp - 1) * kv_bytes
                               // 4, "bytes": (cp - 1) * kv_bytes} for op in ("send", "recv")}
                for op in ("send", "recv"):
                    assert bwd[("cp", op)]["calls"] == 2 * cp - 1
                    assert bwd[("cp", op)]["bytes"] == (2 * cp - 1) * kv_bytes
            else:  # one all-gather forward, one reduce-scatter (fp32) backward
                assert fwd == {("cp", "all_gather"): {"calls": 1, "elements": cp * kv_bytes
                                                      // 4, "bytes": cp * kv_bytes}}
                assert bwd == {("cp", "reduce_scatter"): {"calls": 1, "elements": cp
                                                          * kv_bytes // 4,
                                                          "bytes": cp * kv_bytes}}
            expected = score_pairs_per_rank(layout, cp, seq)[rank] * 2 * heads
            assert pairs == expected


def test_zigzag_balances_causal_work():
    """Score pairs per rank from the block calls the engine makes: equal under zig-zag
    (within 5%), and under the contiguous split rank r does (4r + 1)/(4·0 + 1)… as theory
    says: rank r's queries see 2r + 1 earlier-or-own chunks of 2·cp."""
    seq = 4096
    for cp in (2, 4, 8):
        zig = score_pairs_per_rank("zigzag", cp, seq)
        assert max(zig) / min(zig) <= 1.05, (cp, zig)
        assert sum(zig) == seq * (seq + 1) // 2
        contiguous = score_pairs_per_rank("contiguous", cp, seq)
        c = seq // (2 * cp)
        # rank r: its two chunks 2r, 2r+1 see 2r and 2r+1 full earlier chunks + diagonals
        theory = [(4 * r + 1) * c * c + 2 * c * (c + 1) // 2 for r in range(cp)]
        assert contiguous == theory
        assert sum(contiguous) == seq * (seq + 1) // 2


def test_positions_and_block_calls():
    assert local_positions("zigzag", 2, 0, 8) == [0, 1, 6, 7]
    assert local_positions("zigzag", 2, 1, 8) == [2, 3, 4, 5]
    assert local_positions("contiguous", 2, 1, 8) == [4, 5, 6, 7]
    # zig-zag rank 1 of 4 (chunks 1, 6): from rank 0 (chunks 0, 7) both queries see chunk 0;
    # from rank 2 (chunks 2, 5) only the late query chunk, over both.
    assert [(c.q0, c.q1, c.k0, c.k1) for c in block_calls("zigzag", 4, 1, 0)] == [(0, 2, 0, 1)]
    assert [(c.q0, c.q1, c.k0, c.k1) for c in block_calls("zigzag", 4, 1, 2)] == [(1, 2, 0, 2)]
    assert block_calls("contiguous", 4, 1, 2) == []


def test_every_unmasked_block_is_computed_once():
    """Over all ranks and ring steps, the block calls cover each (query chunk, key chunk)
    pair with key ≤ query exactly once, and no masked pair (a causal call over a rank's two
    chunks skips the masked one)."""
    for layout in ("zigzag", "contiguous"):
        for cp in (2, 3, 4, 8):
            seen = []
            for rank in range(cp):
                mine = local_chunks(layout, cp, rank)
                for src in ring_sources(cp, rank):
                    theirs = local_chunks(layout, cp, src)
                    for call in block_calls(layout, cp, rank, src):
                        for qc in mine[call.q0:call.q1]:
                            for kc in theirs[call.k0:call.k1]:
                                assert call.causal or kc < qc, (layout, cp, rank, src)
                                if kc <= qc:
                                    seen.append((qc, kc))
            lower = [(q, k) for q in range(2 * cp) for k in range(q + 1)]
            assert sorted(seen) == lower, (layout, cp)


# --- the whole model through the trainer ------------------------------------------------
import pathlib  # noqa: E402

from common import small_config  # noqa: E402
from tolerances import loss_rtol, trained_rtol, within  # noqa: E402

from fivefold.data.loader import BatchLoader  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402

BASE = ["--train.gbs", "4", "--parallel.mbs", "2", "--train.steps", "3", "--train.lr", "1e-3",
        "--train.grad_clip", "0", "--train.seq_len", "32"]
STEPS = 3
LOSS_RTOL = loss_rtol(tokens=4 * 32, depth=3 * 2)
TRAINED_RTOL = trained_rtol(tokens=4 * 32, depth=3 * 2)


class MaskedLoader(BatchLoader):
    """Targets of the first quarter of every sequence are ignored, so cp shards hold
    different numbers of valid targets (zig-zag rank 0 holds all the masked ones at cp 2)."""

    def next_batch(self):
        out = []
        for x, y in super().next_batch():
            y = y.clone()
            y[:, : self.seq_len // 4] = -100
            out.append((x, y))
        return out

    @property
    def num_target_tokens(self) -> int:
        return self.gbs * (self.seq_len - self.seq_len // 4)


def train_run(tmp, args, world):
    """Losses and gradient norms of STEPS steps, every gradient of step one (Adam's first
    moment / (1 − β1), clipping off), and the final parameters, as logical tensors."""
    cfg = small_config(pathlib.Path(tmp), *BASE, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    trainer.loader.__class__ = MaskedLoader
    records = [trainer.train_step()]
    beta1 = cfg.train.beta1
    grads = {k.split("/")[1]: v / (1 - beta1) for k, v in trainer.logical_tensors().items()
             if k.endswith("/exp_avg")}
    records += [trainer.train_step() for _ in range(STEPS - 1)]
    params = {k[len("model/"):]: v for k, v in trainer.logical_tensors().items()
              if k.startswith("model/")}
    return [(r["loss"], r["grad_norm"]) for r in records], grads, params


def train_layouts(rank, world, tmp, layouts):
    return {name: train_run(f"{tmp}/{name}", args, world) for name, args in layouts.items()}


def assert_matches(got, ref, label):
    (steps, grads, params), (ref_steps, ref_grads, ref_params) = got, ref
    for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps):
        assert within(abs(loss - ref_loss) / abs(ref_loss), LOSS_RTOL, label), (loss, ref_loss)
        assert within(abs(norm - ref_norm) / abs(ref_norm), TRAINED_RTOL, label), (norm,
                                                                                  ref_norm)
    assert grads.keys() == params.keys() and set(grads) <= set(ref_grads), label
    for key, value in grads.items():  # a pipeline rank holds its stage's tensors only
        err = rel(value, ref_grads[key])
        assert within(err, TRAINED_RTOL, f"{label} {key}"), (label, "grad", key, err)
        err = rel(params[key], ref_params[key])
        assert within(err, TRAINED_RTOL, f"{label} {key}"), (label, "param", key, err)
    return set(grads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return train_run(str(tmp), [], 1)


def cp_args(cp, comm, layout, *more):
    return ["--parallel.cp", str(cp), "--parallel.cp_comm", comm, "--parallel.cp_layout",
            layout, *more]


CP2 = {f"cp2-{comm}-{layout}": cp_args(2, comm, layout)
       for comm in ("ring", "allgather") for layout in ("zigzag", "contiguous")}
CP2.update({"cp2-ring-selective": cp_args(2, "ring", "zigzag", "--train.recompute", "selective"),
            "cp2-ring-full": cp_args(2, "ring", "zigzag", "--train.recompute", "full")})
WORLD4 = {f"cp4-{comm}-{layout}": cp_args(4, comm, layout)
          for comm in ("ring", "allgather") for layout in ("zigzag", "contiguous")}
WORLD4.update({
    "cp2-dp2-zero3": cp_args(2, "ring", "zigzag", "--parallel.dp", "2", "--parallel.zero", "3"),
    "cp2-tp2-sp": cp_args(2, "ring", "zigzag", "--parallel.tp", "2", "--parallel.sp", "true"),
    "cp2-pp2-1f1b": cp_args(2, "ring", "zigzag", "--parallel.pp", "2"),
    "cp2-pp2-zb-full": cp_args(2, "allgather", "zigzag", "--parallel.pp", "2",
                               "--parallel.schedule", "zb", "--train.recompute", "full"),
})


@pytest.mark.parity
@pytest.mark.parametrize("world,layouts", [(2, CP2), (4, WORLD4)], ids=["world2", "world4"])
def test_trainer_parity(world, layouts, reference, tmp_path):
    results = run_ranks(train_layouts, world, str(tmp_path), layouts)
    for name in layouts:
        covered = set()
        for rank, by_layout in enumerate(results):
            covered |= assert_matches(by_layout[name], reference, f"{name} rank {rank}")
        assert covered == set(reference[1]), name  # every gradient checked somewhere


@pytest.mark.slow
@pytest.mark.parity
def test_cp2_tp2_pp2_parity(reference, tmp_path):
    layouts = {"cp2-tp2-sp-pp2": cp_args(2, "ring", "zigzag", "--parallel.tp", "2",
                                         "--parallel.sp", "true", "--parallel.pp", "2")}
    covered = set()
    for rank, by_layout in enumerate(run_ranks(train_layouts, 8, str(tmp_path), layouts)):
        covered |= assert_matches(by_layout["cp2-tp2-sp-pp2"], reference, f"rank {rank}")
    assert covered == set(reference[1])


# --- low precision, memory, checkpoints -------------------------------------------------
def precision_runs(rank, world, tmp):
    return {p: train_run(f"{tmp}/{p}", cp_args(world, "ring", "zigzag", "--train.precision", p),
                         world)[0] for p in ("bf16", "fp16")}


def test_low_precision_matches_single_process(tmp_path):
    """bf16 and fp16 at cp 2 against the single process in the same precision. The two runs
    add the same terms in another order (the LSE merge, the dp×cp gradient sum in the
    parameter dtype), so they differ by a few roundings of that dtype: loss within 4 ulps of
    bf16 (2^-8 each) or fp16 (2^-11), gradient norms within 8."""
    refs = {p: train_run(str(tmp_path / f"ref-{p}"), ["--train.precision", p], 1)[0]
            for p in ("bf16", "fp16")}
    ulp = {"bf16": 2.0**-8, "fp16": 2.0**-11}
    for got in run_ranks(precision_runs, 2, str(tmp_path)):
        for p, steps in got.items():
            for (loss, norm), (ref_loss, ref_norm) in zip(steps, refs[p]):
                assert abs(loss - ref_loss) <= 4 * ulp[p] * abs(ref_loss), (p, loss, ref_loss)
                assert abs(norm - ref_norm) <= 8 * ulp[p] * abs(ref_norm), (p, norm, ref_norm)


def saved_bytes(rank, world, tmp, seq_len):
    """Bytes autograd saves for one micro-batch through the whole model on this rank."""
    from fivefold.parallel.memory import SavedActivations

    args = ["--train.seq_len", str(seq_len), "--model.max_seq_len", str(seq_len),
            "--parallel.mbs", "1", "--train.gbs", "1"]
    if world > 1:
        args += cp_args(world, "ring", "zigzag")
    cfg = small_config(pathlib.Path(tmp), *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    x, y = trainer.shard_sequences(trainer.loader.next_batch())[0]
    model = trainer.model.chunks[0]
    with SavedActivations([p for _, p in trainer.model.named_parameters()]) as meter:
        model(x, y)
    return meter.bytes


def test_saved_activations_at_cp4_are_a_quarter(tmp_path):
    """Within 10% of a quarter at 2048 tokens; what does not shrink with cp (the head's saved
    weight, 32 KiB here) is the rest."""
    seq = 2048
    single = saved_bytes(0, 1, str(tmp_path), seq)
    for got in run_ranks(saved_bytes, 4, str(tmp_path), seq):
        assert abs(got / single - 0.25) <= 0.025, (got, single)


def save_then_continue(rank, world, tmp, args):
    cfg = small_config(pathlib.Path(tmp), *BASE, "--train.steps", "4", *args)
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint()
    return [trainer.train_step()["loss"] for _ in range(2)]


def resume_and_continue(rank, world, tmp, args):
    cfg = small_config(pathlib.Path(tmp), *BASE, "--train.steps", "4", *args,
                       "--checkpoint.resume", "latest")
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    assert trainer.step == 2
    return [trainer.train_step()["loss"] for _ in range(2)]


def resume_layouts(rank, world, tmp, layouts):
    return [resume_and_continue(rank, world, tmp, args) for args in layouts]


@pytest.mark.parity
def test_checkpoint_resumes_across_cp_layouts(tmp_path):
    """Saved at cp 2 × tp 2 (zig-zag, SP), resumed at cp 1, dp 4 and cp 4 (all-gather): the
    next losses match the saving run's (LOSS_RTOL), the data position included."""
    saved = cp_args(2, "ring", "zigzag", "--parallel.tp", "2", "--parallel.sp", "true")
    expected = run_ranks(save_then_continue, 4, str(tmp_path), saved)[0]
    single = resume_and_continue(0, 1, str(tmp_path), [])
    layouts = [["--parallel.dp", "4", "--parallel.zero", "1", "--parallel.mbs", "1"],
               cp_args(4, "allgather", "contiguous")]
    four = run_ranks(resume_layouts, 4, str(tmp_path), layouts)[0]
    for got in [single, *four]:
        for a, b in zip(got, expected):
            assert within(abs(a - b) / abs(b), LOSS_RTOL, "cp resume"), (got, expected)
