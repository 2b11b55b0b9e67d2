"""Expert parallelism reproduces the single process, and the planner predicts it.

The dispatcher alone: one MoE block of the engine (softmax router, top-2 of 4 SwiGLU
experts, balance and z losses) with its local dispatcher computes the reference on one
process; at ep 2 and ep 4 each rank routes its own slice of the tokens through the
all-to-all dispatcher.
Outputs and input gradients ≤ 1e-6, parameter gradients ≤ 1e-5, relative (‖a − b‖ / ‖b‖;
experts: each rank's block; router: summed over the ranks). Under full recomputation the
all-to-alls are replayed, not sent again: the ledger is the same as without it.

Training (a 2-layer MoE with a gated shared expert, fp32, same seed and global batch as the
single process), the float32 error model of tests/tolerances.py: loss and aux loss ≤
LOSS_RTOL relative per step, gradient norm ≤ TRAINED_RTOL, tokens per expert equal, final
weights ≤ TRAINED_RTOL relative per logical tensor (each expert its own), expert biases ≤
1e-6 absolute (sign steps of a fixed size: equal when the token counts are); resumed losses
≤ LOSS_RTOL relative. The ledger and the
model states per rank agree with the planner (states within 1%, saved activations of a
micro-batch within 10%). One forked start of 4
ranks runs every layout of a test in turn.
"""

import contextlib
import pathlib

import pytest
import torch
from common import small_config
from harness import run_ranks
from tolerances import loss_rtol, trained_rtol, within

from fivefold.config import ConfigError
from fivefold.models.init import materialize
from fivefold.models.moe import MoE
from fivefold.models.presets import ModelConfig
from fivefold.parallel.expert import apply_expert_parallel
from fivefold.parallel.memory import SavedActivations
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.recompute import _checkpointed
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.comm import ledger_volume
from fivefold.plan.inputs import training_plan_inputs
from fivefold.plan.model_states import model_state_bytes
from fivefold.train.checkpoint import load_model_for_inference
from fivefold.train.trainer import Trainer

E, H, K = 4, 8, 2
CFG = ModelConfig(name="moe-unit", vocab_size=16, hidden_size=H, intermediate_size=16,
                  num_layers=1, num_heads=2, num_kv_heads=2, num_experts=E, experts_top_k=K,
                  moe_intermediate_size=16, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                  init_std=0.3)
SEQUENCES = 4


def layer_and_tokens():
    """The engine's MoE block (local dispatcher), drawn from names as `materialize` does."""
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = MoE(CFG)
    layer = materialize(layer, CFG, seed=0)
    layer.aux_grad_scale = 1.0 / SEQUENCES  # the aux losses weigh every sequence alike
    return layer, torch.randn(SEQUENCES, 6, H)


def loss_of(y):  # position-dependent, so every output element's gradient differs
    return (y * torch.arange(y.numel()).view_as(y)).sum()


def ep_rank(rank, world):
    """Without and with full recomputation of the block: {recompute: results}."""
    dims = ParallelDims(dp=world, ep=world, rank=rank)
    dims.build_groups()
    out = {}
    for recompute in (False, True):
        layer, x = layer_and_tokens()
        apply_expert_parallel(layer, dims)
        dims.ledger.reset()
        dims.ledger.enabled = True
        mine = x.chunk(world)[rank].clone().requires_grad_()
        y = (_checkpointed(layer.forward) if recompute else layer.forward)(mine)
        loss_of(y).backward()
        dims.ledger.enabled = False
        ledger = [(e.op, e.group, e.dtype, e.bytes) for e in dims.ledger.entries]
        out[recompute] = (y.detach(), mine.grad, {n: p.grad for n, p in
                                                  layer.named_parameters()}, ledger)
    return out


def close(a, b, tol):
    return float((a - b).norm() / b.norm()) <= tol


def test_all_to_all_dispatch_matches_local_experts():
    for world in (2, 4):
        layer, x = layer_and_tokens()
        x.requires_grad_()
        pieces = [layer(c) for c in x.chunk(world)]
        sum(loss_of(y) for y in pieces).backward()
        ledgers, tokens = {}, x.shape[0] * x.shape[1] // world
        by_rank = run_ranks(ep_rank, world)
        for recompute in (False, True):
            results = [r[recompute] for r in by_rank]
            assert close(torch.cat([r[0] for r in results]), torch.cat(pieces).detach(), 1e-6)
            assert close(torch.cat([r[1] for r in results]), x.grad, 1e-6)
            for name, p in layer.named_parameters():
                if "experts" in name:  # rank r holds experts [r·E/ep, (r+1)·E/ep)
                    got = torch.cat([r[2][name] for r in results])
                else:
                    got = sum(r[2][name] for r in results)
                assert close(got, p.grad, 1e-5), (world, name)
            ledgers[recompute] = [r[3] for r in results]
            for ledger in ledgers[recompute]:
                # counts, dispatch, combine; in backward the combine's and dispatch's reverse
                assert [(op, g, dtype) for op, g, dtype, _ in ledger] == (
                    [("all_to_all", "ep", "int64")] + [("all_to_all", "ep", "float32")] * 4)
                assert ledger[0][3] == E * 8
                assert ledger[1][3] == ledger[3][3] == tokens * K * H * 4  # own routed rows
            combined = sum(ledger[2][3] for ledger in ledgers[recompute])
            assert combined == world * tokens * K * H * 4  # the experts' rows: all, once
        assert ledgers[True] == ledgers[False]  # recomputation sends nothing again


MOE = ["--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "32", "--model.shared_expert_intermediate_size", "16",
       "--model.shared_expert_gate", "true", "--model.num_layers", "2",
       "--train.gbs", "8", "--parallel.mbs", "1", "--train.lr", "1e-3", "--train.steps", "6"]
STEPS = 3
# The float32 error model (tests/tolerances.py): 8 sequences of 32 tokens per step, 2 blocks
# of 3 GEMMs (attention output, expert down, expert gate/up) of length ≤ 64.
LOSS_RTOL = loss_rtol(tokens=8 * 32, depth=3 * 2)
TRAINED_RTOL = trained_rtol(tokens=8 * 32, depth=3 * 2)

# Each variant has its own single-process reference. The balance and z losses need whole
# sequences, so the cp layout balances with the expert bias alone (models/moe.py).
AUX = ["--model.aux_loss_coeff", "0.01", "--model.z_loss_coeff", "0.001"]
BIAS = ["--model.expert_bias_rate", "0.01"]
PARITY = {
    "dp4-ep4": (AUX, ["--parallel.dp", "4", "--parallel.ep", "4"]),
    "dp4-ep2-zero1": (AUX, ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.zero", "1"]),
    "dp4-ep2-zero3": (AUX, ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.zero", "3"]),
    "dp2-ep2-tp2-full-recompute": (AUX, ["--parallel.dp", "2", "--parallel.ep", "2",
                                         "--parallel.tp", "2", "--train.recompute", "full"]),
    "dp2-ep2-pp2-1f1b": (AUX, ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.pp", "2",
                               "--parallel.schedule", "1f1b"]),
    "dp2-ep2-pp2-zb": (AUX, ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.pp", "2",
                             "--parallel.schedule", "zb"]),
    "dp2-cp2-ep2": (BIAS, ["--parallel.dp", "2", "--parallel.cp", "2", "--parallel.ep", "2"]),
}
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_tokens_max", "moe_tokens_min")


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def build(tmp, args, world):
    cfg = small_config(pathlib.Path(tmp), *MOE, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    return Trainer(cfg, dims, quiet=True), dims


def run(trainer, steps=STEPS):
    records = [trainer.train_step() for _ in range(steps)]
    tensors = {k: v for k, v in trainer.logical_tensors().items()
               if k.startswith(("model/", "buffer/"))}
    return [{k: r[k] for k in KEYS} for r in records], tensors


def parity_ranks(rank, world, tmp):
    out = {}
    for name, (variant, args) in PARITY.items():
        trainer, _ = build(f"{tmp}/{name}", [*variant, *args], world)
        out[name] = run(trainer)
        trainer.optimizer.close()
    return out


@contextlib.contextmanager
def one_thread():
    """The in-process runs use one thread, as the forked ranks do: on a machine whose cores
    are shared, OpenMP threads spinning against other jobs slow a step down 50-fold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    with one_thread():
        return {id(v): run(build(str(tmp / str(i)), v, 1)[0])
                for i, v in enumerate((AUX, BIAS))}


@pytest.mark.parity
def test_expert_parallel_matches_single_process(references, tmp_path):
    results = run_ranks(parity_ranks, 4, str(tmp_path))
    for name, (variant, _) in PARITY.items():
        ref_steps, ref_tensors = references[id(variant)]
        assert "model/layers.0.mlp.experts.w_gate[3]" in ref_tensors  # a tensor per expert
        seen = set()
        for steps, tensors in (r[name] for r in results):
            for got, want in zip(steps, ref_steps):
                assert within(rel(got["loss"], want["loss"]), LOSS_RTOL, name), (got, want)
                assert within(rel(got["grad_norm"], want["grad_norm"]), TRAINED_RTOL, name), \
                    (name, got, want)
                assert within(rel(got["moe_aux_loss"], want["moe_aux_loss"]), LOSS_RTOL, name), \
                    (name, got, want)
                assert got["moe_tokens_max"] == want["moe_tokens_max"], name
                assert got["moe_tokens_min"] == want["moe_tokens_min"], name
            for key, value in tensors.items():  # this rank's experts, and all it holds whole
                ref = ref_tensors[key]
                if key.startswith("buffer/"):
                    assert torch.allclose(value, ref, rtol=0, atol=1e-6), (name, key)
                else:
                    err = float((value - ref).norm() / ref.norm())
                    assert within(err, TRAINED_RTOL, f"{name} {key}"), (name, key, err)
            seen.update(tensors)
        assert seen == set(ref_tensors), name  # every expert is held by some rank


def save_then_continue(rank, world, tmp, args, steps):
    trainer, _ = build(tmp, [*BIAS, *args], world)  # the expert biases are saved too
    for _ in range(steps):
        trainer.train_step()
    trainer.save_checkpoint()
    return [trainer.train_step()["loss"] for _ in range(3)]


def resume_losses(rank, world, tmp, args, step):
    trainer, _ = build(tmp, [*BIAS, *args, "--checkpoint.resume", "latest"], world)
    assert trainer.step == step
    return [trainer.train_step()["loss"] for _ in range(3)]


def save_ep2_resume_tp2(rank, world, tmp):
    continued = save_then_continue(rank, world, tmp, ["--parallel.dp", "2", "--parallel.ep",
                                                      "2"], 2)
    resumed = resume_losses(rank, world, tmp, ["--parallel.tp", "2"], 2)
    return continued, resumed


@pytest.mark.parity
def test_checkpoints_reshard_experts(tmp_path):
    """ep 4 → ep 1 and ep 2 × dp 2 → tp 2 resume with the same losses."""
    ep4 = tmp_path / "ep4"
    continued = run_ranks(save_then_continue, 4, str(ep4), ["--parallel.dp", "4",
                                                            "--parallel.ep", "4"], 2)[0]
    with one_thread():
        # Inference loads the stacked experts (and the expert biases) from the same files.
        model = load_model_for_inference(str(ep4 / "ckpt"))[0]
        trainer, _ = build(str(ep4), [*BIAS, "--checkpoint.resume", "latest"], 1)
        loaded = dict(model.state_dict())
        for name, value in trainer.model.chunks[0].state_dict().items():
            assert torch.equal(loaded[name], value), name
        assert any(name.endswith("expert_bias") and v.abs().sum() > 0 for name, v in
                   loaded.items())
        resumed = resume_losses(0, 1, str(ep4), [], 2)
    for got, expected in zip(resumed, continued):
        assert within(rel(got, expected), LOSS_RTOL, "ep4 resumed at ep1")
    for continued, resumed in run_ranks(save_ep2_resume_tp2, 2, str(tmp_path / "ep2")):
        for got, expected in zip(resumed, continued):
            assert within(rel(got, expected), LOSS_RTOL, "ep2 resumed at tp2")


AGREEMENT = {f"dp4-ep{ep}-zero{zero}": ["--parallel.dp", "4", "--parallel.ep", str(ep),
                                         "--parallel.zero", str(zero)]
             for ep in (1, 2, 4) for zero in (0, 1, 3)}
TP2 = ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.ep", "2"]
FULL = ["--parallel.zero", "1", "--train.recompute", "full"]
AGREEMENT.update({"dp2-tp2-ep2": TP2, "dp2-tp2-ep2-full": [*TP2, *FULL],
                  "dp2-tp2-ep1-full": [*TP2[:4], *FULL]})


def measure_ranks(rank, world, tmp):
    out = {}
    for name, args in AGREEMENT.items():
        trainer, dims = build(tmp, [*AUX, *args], world)
        dims.ledger.enabled = True
        trainer.train_step()
        ledger = [(e.group, e.op, e.dtype, e.bytes) for e in dims.ledger.entries]
        dims.ledger.enabled = False
        x, y = trainer.loader.next_batch()[0]  # saved bytes of one micro-batch's forward
        with SavedActivations([p for _, p in trainer.model.named_parameters()]) as meter:
            trainer.model.chunks[0](x, y)
        out[name] = {"ledger": ledger, "memory": trainer.optimizer.memory_bytes(),
                     "activations": meter.bytes}
        trainer.optimizer.close()
    return out


def test_ledger_and_model_states_agree_with_planner(tmp_path):
    results = run_ranks(measure_ranks, 4, str(tmp_path))
    for name, args in AGREEMENT.items():
        cfg = small_config(tmp_path, *MOE, *AUX, *args)
        par, work_layout = cfg.parallel, training_plan_inputs(cfg)
        plan = ledger_volume(*work_layout)
        states = model_state_bytes(work_layout[0].model, dp=par.dp, tp=par.tp, ep=par.ep,
                                   zero=par.zero, precision="fp32")
        mc, m = cfg.model.resolve(), cfg.train.gbs // (par.dp * par.mbs)
        routed = par.mbs * cfg.train.seq_len * mc.experts_top_k * mc.hidden_size * 4
        acts = activation_bytes_per_microbatch(
            mc, par.mbs, cfg.train.seq_len, tp=par.tp, recompute=cfg.train.recompute,
            dtype_bytes=4, ep=par.ep)
        planned_acts = acts.layer * mc.num_layers + sum(acts.outside_terms[k] for k in (
            "embedding", "final_norm", "logits", "loss"))
        for got, base in zip((r[name] for r in results),
                             (r["dp2-tp2-ep1-full"] for r in results)):
            if cfg.train.recompute == "full" and par.ep > 1:
                # What expert parallelism adds under full recompute: the replayed rows, as
                # planned (the rest of a recomputed MoE layer is the ep 1 layout's business).
                kept = got["activations"] - base["activations"]
                planned = acts.layer_terms["ep_replay"] * mc.num_layers
                assert abs(kept - planned) <= 0.10 * planned, (name, kept, planned)
            elif cfg.train.recompute == "none":
                # Saved activations within 10% (how many rows a rank's experts get varies).
                assert abs(got["activations"] - planned_acts) <= 0.10 * planned_acts, (
                    name, got["activations"], planned_acts)
            for item in ("params", "grads", "master", "optimizer"):
                planned = getattr(states, item)
                assert abs(got["memory"][item] - planned) <= 0.01 * max(planned, 1), (
                    name, item, got["memory"], planned)
            ep_calls = [e for e in got["ledger"] if e[:2] == ("ep", "all_to_all")]
            if par.ep == 1:
                assert not ep_calls and "ep" not in plan
                continue
            tokens = [b for g, op, dtype, b in ep_calls if dtype == "float32"]
            counts = [b for g, op, dtype, b in ep_calls if dtype == "int64"]
            layers = mc.num_moe_layers
            # Per MoE layer and micro-batch: counts, dispatch and combine forward, then the
            # combine's and the dispatch's reverse in backward.
            assert counts == [mc.num_experts * 8] * (layers * m)
            assert len(tokens) == 4 * layers * m
            # Each micro-batch: [dispatch, combine] per layer, then [combine's backward,
            # dispatch's backward] per layer. Dispatch and the combine's backward send this
            # rank's routed rows; the other two the rows its experts ran.
            assert tokens[0::2] == [routed] * (2 * layers * m)
        for group in plan:
            for op, planned in plan[group].items():
                measured = [sum(b for g, o, _, b in got[name]["ledger"] if (g, o) == (group, op))
                            for got in results]
                if group == "ep":  # a combine carries the rows a rank's experts ran: exact
                    measured = [sum(measured)]  # over the ep group (here, all 4 ranks)
                    planned *= len(results)
                assert all(b == planned for b in measured), (name, group, op, measured, planned)


@pytest.mark.parametrize("args, message", [
    (["--parallel.dp", "2", "--parallel.ep", "2", "--model.num_experts", "3"],
     "parallel.ep = 2 does not divide model.num_experts = 3"),
    (["--parallel.dp", "3", "--parallel.ep", "2", "--train.gbs", "6"],
     "parallel.ep = 2 does not divide parallel.dp·cp = 3"),
    (["--parallel.ep", "2", "--parallel.dp", "2", "--model.num_experts", "0"],
     "parallel.ep = 2 needs a mixture-of-experts model"),
])
def test_bad_expert_parallel_inputs(tmp_path, args, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("·", ".")):
        small_config(tmp_path, *MOE, *args)


def test_planner_counts_moe_layers_per_stage(tmp_path):
    """First layer dense, then MoE: pp 2 over 4 layers puts one MoE layer on rank 0 and two
    on rank 1; each rank's expert parameters and all-to-alls follow its own MoE layers."""
    from fivefold.plan.layout import Layout
    from fivefold.plan.memory import rank_param_counts
    from fivefold.plan.placement import moe_layers_on_rank

    mc = small_config(tmp_path, *MOE, "--model.num_layers", "4",
                      "--model.moe_first_dense", "1").model.resolve()
    layout = Layout(pp=2, dp=2, ep=2)
    assert [moe_layers_on_rank(mc, layout, r) for r in (0, 1)] == [1, 2]
    routed = mc.num_experts // 2 * 3 * mc.hidden_size * mc.moe_intermediate_size
    assert [rank_param_counts(mc, layout, r)["expert"] for r in (0, 1)] == [routed, 2 * routed]


def ep2_hf_logits(rank, world, tmp, path):
    from test_hf_moe import tokens

    cfg = small_config(pathlib.Path(tmp), "--model.hf_path", str(path), "--parallel.dp", "2",
                       "--parallel.ep", "2")
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    with torch.no_grad():  # both ranks route the same tokens, each through its 3 experts
        return trainer.model.chunks[0].eval()(tokens())


def test_hf_moe_checkpoint_loads_at_ep2(tmp_path):
    """A Qwen3-MoE checkpoint (6 experts, top-3, renormalised) imported at dp 2 × ep 2:
    logits within 1e-5 of `transformers`."""
    pytest.importorskip("transformers")
    from test_hf_moe import hf_model, tokens

    with one_thread(), torch.no_grad():
        hf = hf_model("qwen3_moe-norm1")
        hf.save_pretrained(tmp_path / "hf")
        expected = hf(tokens()).logits
    for logits in run_ranks(ep2_hf_logits, 2, str(tmp_path), tmp_path / "hf"):
        assert (logits - expected).abs().max().item() <= 1e-5
