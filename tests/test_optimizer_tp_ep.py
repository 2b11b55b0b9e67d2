"""The new optimizers under tensor and expert parallelism reproduce the single process.

Tensor parallelism, adamw8bit and adamw4bit. The default test model's row-parallel shards cut
its quantisation blocks (parallel/optim_base.py refuses that layout), so these runs take a
one-layer model whose row-parallel inputs are 512 wide (4 heads of 128, ffn 512) at hidden
128: every tp2 shard of every quantised tensor then holds whole blocks of 256 (8-bit) and
128 (4-bit) values, the same blocks as the whole tensor (o_proj's and down_proj's rows of 512
split into one 256-value block per rank; the column-parallel weights and the vocabulary-
parallel embedding are cut between rows, the embedding's 8-bit blocks spanning two of its
128-value rows). Two checks per optimizer, in one start of two ranks:

1. The same gradients: after each backward, every gradient is replaced by values drawn from
   its logical tensor's name and the step (each rank takes its slice). tp2's weights and
   dequantised moments then equal the single process's bit for bit after 2 steps (the second
   reads the first's codes back): the update is elementwise, on the same blocks, so nothing
   is summed in another order.
2. The same data (seed, global batch of 4 sequences of 32 tokens, 3 steps, constant lr, no
   clipping): the runs differ by the order of the float32 sums (tests/tolerances.py at 128
   tokens, 3 GEMMs of length <= 512) and then by the codes that difference flips
   (tests/optimizer_bounds.py: losses, gradient norms and each weight tensor).
   Measured here: at most 1.2% of the bound for 8-bit weights, 0.6% for 4-bit: the float32
   model is loose, and a flip turns its square root into a code step. What check 2 still
   catches: lr doubled on one rank's shards (tried once) puts the quantised tensors 24-29x
   (8-bit) and 2.9-4.2x (4-bit) past their bounds after 3 steps and the losses of steps 2
   and 3 over 200x past theirs; check 1 catches any such change bit for bit.

Expert parallelism, adamw8bit, adamw4bit, Adafactor and Muon (fp32 Newton-Schulz), at dp2 x
ep2 and with ZeRO over dp: see `test_new_optimizers_under_expert_parallelism_track_one_process`.
"""

from __future__ import annotations

import pathlib
import zlib

import pytest
import torch
from common import small_config
from harness import run_ranks
from optimizer_bounds import Run, muon_mover, parity_bounds, quantised_mover
from tolerances import loss_rtol, within

from fivefold.config.optim import ns_coefficients
from fivefold.numerics.optim_states import quantisable
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.muon import takes
from fivefold.train.trainer import Trainer

WIDE = ["--model.hidden_size", "128", "--model.head_dim", "128", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.intermediate_size", "512",
        "--model.num_layers", "1",
        "--train.lr", "3e-3", "--train.lr_schedule", "constant", "--train.grad_clip", "0"]
STEPS, SAME_GRAD_STEPS, LR = 3, 2, 3e-3
# gbs 4 x seq 32 tokens; o_proj, down_proj, gate/up; GEMMs of length <= 512
TP_RUN = Run(tokens=4 * 32, depth=3, width=512, lr=LR, steps=STEPS)
OPTIMIZERS = {"adamw8bit": 8, "adamw4bit": 4}


def _trainer(tmp, optimizer, tp):
    cfg = small_config(pathlib.Path(tmp), *WIDE, "--train.optimizer", optimizer,
                       "--parallel.tp", str(tp))
    dims = ParallelDims.from_config(cfg.parallel) if tp > 1 else ParallelDims.single()
    return Trainer(cfg, dims, quiet=True)


def _same_gradients(trainer):
    """After each backward, every gradient becomes a draw seeded by its logical name and the
    step (rows of different scales, so blocks see different absmaxes); a tp rank takes its
    slice of the logical tensor."""
    backward = trainer.forward_backward

    def replaced(*args, **kw):
        loss = backward(*args, **kw)
        for name, p in trainer.model.named_parameters():
            shape = tuple(getattr(p, "_full_shape", p.shape))
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{trainer.step}".encode()))
            full = torch.randn(shape, generator=gen) * 1e-3
            full *= torch.rand(shape[:1] + (1,) * (len(shape) - 1), generator=gen) * 10
            spec = getattr(p, "_tp_slice", None)
            if spec is not None:
                dim, start, stop = spec
                full = full.narrow(dim, start, stop - start)
            p.grad.copy_(full.reshape(p.shape))
        return loss

    trainer.forward_backward = replaced


def tp_runs(rank, world, tmp):
    """{optimizer: (each step's loss and gradient norm, weights, the stored moments after
    each step (the reference's only), everything after the same-gradient steps)}; rank 0's."""
    out = {}
    for optimizer in OPTIMIZERS:
        with _trainer(f"{tmp}/{optimizer}", optimizer, world) as trainer:
            records, states = [], []
            for _ in range(STEPS):
                rec = trainer.train_step()
                records.append((rec["loss"], rec["grad_norm"]))
                assert rec["lr"] == LR
                if world == 1:  # the reference's stored moments, for the flip model
                    states.append({k: v for k, v in trainer.logical_tensors().items()
                                   if k.startswith("optim/") and "/exp_avg" in k})
            weights = {k: v for k, v in trainer.logical_tensors().items()
                       if k.startswith("model/")}
        with _trainer(f"{tmp}/{optimizer}-same", optimizer, world) as trainer:
            _same_gradients(trainer)
            for _ in range(SAME_GRAD_STEPS):
                trainer.train_step()
            same = trainer.logical_tensors()
        if rank == 0:
            out[optimizer] = (records, weights, states, same)
    return out


def _one_thread(fn, *args):
    """The in-process reference on one thread, as each rank: on shared cores, spinning
    OpenMP threads slow a step down many times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(0, 1, *args)
    finally:
        torch.set_num_threads(threads)


def _check(label, got, ref, bounds):
    """Losses and gradient norms per step, weights per tensor, against `parity_bounds`."""
    (records, weights), (ref_records, ref_weights) = got, ref
    weight_bounds, loss_bounds, norm_bounds = bounds
    for t, ((a, na), (b, nb)) in enumerate(zip(records, ref_records, strict=True)):
        assert within(abs(a - b) / b, loss_bounds[t], f"{label} loss"), (label, t, a, b)
        assert within(abs(na - nb) / nb, norm_bounds[t], f"{label} norm"), (label, t, na, nb)
    for name, value in weights.items():  # what this rank holds (an ep rank: its experts)
        ref = ref_weights[name]
        err = float((value - ref).norm() / ref.norm())
        assert within(err, weight_bounds[name], f"{label} {name}"), (label, name, err)


@pytest.mark.parity
def test_quantised_adamw_under_tp2_tracks_one_process(tmp_path):
    got = run_ranks(tp_runs, 2, str(tmp_path / "tp2"))[0]
    ref = _one_thread(tp_runs, str(tmp_path / "ref"))
    for optimizer, bits in OPTIMIZERS.items():
        records, weights, _, same = got[optimizer]
        ref_records, ref_weights, ref_states, ref_same = ref[optimizer]
        assert same.keys() == ref_same.keys()
        assert any(k.endswith("o_proj.weight/exp_avg") for k in same)
        for key, value in ref_same.items():  # 1. the same gradients: bit for bit
            assert torch.equal(same[key], value), (optimizer, key)
        sizes = {n: w.numel() for n, w in ref_weights.items()}
        move = quantised_mover(TP_RUN, bits, ref_states,
                               lambda n, b=bits, sizes=sizes: quantisable(sizes[n], b))
        bounds = parity_bounds(TP_RUN, move, ref_weights, ref_records)
        assert weights.keys() == ref_weights.keys()
        _check(f"tp2 {optimizer}", (records, weights), (ref_records, ref_weights), bounds)


# --- expert parallelism --------------------------------------------------------------------
# test_expert_parallel.py's MoE (2 layers of 4 top-2 experts and a gated shared expert, balance
# and z losses), at a constant lr without clipping. Quantised: the embedding (8192 values) and
# each stacked expert weight (4 x 32 x 32: whole blocks per expert, so an ep rank holds its
# experts' blocks whole); Muon takes each expert's matrix.
MOE = ["--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "32", "--model.shared_expert_intermediate_size", "16",
       "--model.shared_expert_gate", "true", "--model.num_layers", "2",
       "--model.aux_loss_coeff", "0.01", "--model.z_loss_coeff", "0.001",
       "--train.gbs", "8", "--parallel.mbs", "1", "--train.lr", "1e-3",
       "--train.lr_schedule", "constant", "--train.grad_clip", "0"]
EXPERTS, EP_LR = 4, 1e-3
# 8 sequences of 32 tokens; 2 blocks of 3 GEMMs (attention output, expert down, gate/up) of
# length <= 64, as test_expert_parallel.py
EP_RUN = Run(tokens=8 * 32, depth=3 * 2, width=64, lr=EP_LR, steps=STEPS)
DP2_EP2 = ["--parallel.dp", "2", "--parallel.ep", "2"]
EP_CASES = [("adamw8bit", "dp2-ep2", DP2_EP2),
            ("adamw8bit", "dp2-ep2-zero1", [*DP2_EP2, "--parallel.zero", "1"]),
            ("adamw4bit", "dp2-ep2", DP2_EP2),
            ("adafactor", "dp2-ep2-zero3", [*DP2_EP2, "--parallel.zero", "3"]),
            ("muon", "dp2-ep2", DP2_EP2),
            ("muon", "dp2-ep2-zero1", [*DP2_EP2, "--parallel.zero", "1"])]


def _moe_run(tmp, optimizer, layout, world, keep_states):
    extra = ["--optim.muon_ns_dtype", "fp32"] if optimizer == "muon" else []
    cfg = small_config(pathlib.Path(tmp), *MOE, "--train.optimizer", optimizer, *extra,
                       *layout)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    records, routing, states = [], [], []
    with Trainer(cfg, dims, quiet=True) as trainer:
        for _ in range(STEPS):
            rec = trainer.train_step()
            assert rec["lr"] == EP_LR
            records.append((rec["loss"], rec["grad_norm"]))
            routing.append((rec["moe_aux_loss"], rec["moe_tokens_max"], rec["moe_tokens_min"]))
            if keep_states:  # the reference's stored moments, for the flip model
                states.append({k: v for k, v in trainer.logical_tensors().items()
                               if k.startswith("optim/") and "/exp_avg" in k})
        weights = {k: v for k, v in trainer.logical_tensors().items()
                   if k.startswith("model/")}
    return records, routing, weights, states


def ep_runs(rank, world, tmp):
    if world == 1:
        return {opt: _moe_run(f"{tmp}/{opt}", opt, [], 1, opt.startswith("adamw"))
                for opt in dict.fromkeys(o for o, _, _ in EP_CASES)}
    return {(opt, name): _moe_run(f"{tmp}/{opt}-{name}", opt, layout, world, False)
            for opt, name, layout in EP_CASES}


def _ep_mover(optimizer, ref_weights, ref_states):
    def base(n):  # model/NAME or model/NAME[j] -> NAME
        return n.removeprefix("model/").split("[")[0]

    if optimizer in OPTIMIZERS:
        bits = OPTIMIZERS[optimizer]
        stacked = {n: w.numel() * (EXPERTS if n.endswith("]") else 1)
                   for n, w in ref_weights.items()}
        return quantised_mover(EP_RUN, bits, ref_states,
                               lambda n: quantisable(stacked[n], bits))
    if optimizer == "muon":
        from fivefold.config.optim import OptimSection

        oc = OptimSection()
        return muon_mover(EP_RUN, lambda n: takes(base(n), ref_weights[n], oc.muon_exclude),
                          ns_coefficients(oc.muon_ns_coefficients), oc.muon_ns_steps)
    return lambda *args: 0.0  # Adafactor: the update is scale-free, as Adam's (trained_rtol)


@pytest.mark.parity
def test_new_optimizers_under_expert_parallelism_track_one_process(tmp_path):
    """dp2 x ep2 (and ZeRO over dp) against one process: losses, gradient norms and weights
    within `parity_bounds` (adamw8bit/4bit: code flips; Muon, fp32 Newton-Schulz: its gain;
    Adafactor: the float32 model alone); tokens per expert equal; the aux loss within the
    gradient norm's bound (a forward quantity that moves with the weights as gradients do)."""
    by_rank = run_ranks(ep_runs, 2, str(tmp_path / "ep"))
    ref = _one_thread(ep_runs, str(tmp_path / "ref"))
    for optimizer, name, _ in EP_CASES:
        ref_records, ref_routing, ref_weights, ref_states = ref[optimizer]
        bounds = parity_bounds(EP_RUN, _ep_mover(optimizer, ref_weights, ref_states),
                               ref_weights, ref_records)
        label, seen = f"{name} {optimizer}", set()
        for rank_result in by_rank:
            records, routing, weights, _ = rank_result[(optimizer, name)]
            _check(label, (records, weights), (ref_records, ref_weights), bounds)
            for t, ((aux, most, least), (ref_aux, ref_most, ref_least)) in enumerate(
                    zip(routing, ref_routing, strict=True)):
                assert (most, least) == (ref_most, ref_least), (label, t)
                assert within(abs(aux - ref_aux) / ref_aux, bounds[2][t], f"{label} aux"), \
                    (label, t, aux, ref_aux)
            seen.update(weights)
        assert seen == set(ref_weights), label  # every expert is held by some rank
        assert "model/layers.1.mlp.experts.w_down[3]" in seen


def _adafactor_trainer(tmp, world, layout, resume=""):
    cfg = small_config(pathlib.Path(tmp), *MOE, "--train.optimizer", "adafactor", *layout,
                       *(["--checkpoint.resume", resume] if resume else []))
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    return Trainer(cfg, dims, quiet=True)


def _save_at_2_and_go_on(rank, world, tmp):
    with _adafactor_trainer(tmp, world, DP2_EP2) as trainer:
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint()
        return [trainer.train_step()["loss"] for _ in range(2)]


@pytest.mark.parity
def test_adafactor_states_saved_at_ep2_resume_in_one_process(tmp_path):
    """Each ep rank saves R and C of its own experts, one logical tensor per expert; one
    process resumes all four: its steps 3-4 equal the ep2 run's within `loss_rtol` (the
    states are read back exactly; the runs differ by the order of their float32 sums)."""
    import torch.distributed.checkpoint as dcp

    went_on = run_ranks(_save_at_2_and_go_on, 2, str(tmp_path))[0]
    with _adafactor_trainer(str(tmp_path), 1, [], "latest") as trainer:
        assert trainer.step == 2
        resumed = [trainer.train_step()["loss"] for _ in range(2)]
    bound = loss_rtol(EP_RUN.tokens, EP_RUN.depth, EP_RUN.width)
    for a, b in zip(resumed, went_on, strict=True):
        assert within(abs(a - b) / b, bound, "adafactor ep2 resume"), (resumed, went_on)
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "step_00000002")).read_metadata()
    names = keys.state_dict_metadata
    for j in range(EXPERTS):
        assert names[f"optim/layers.0.mlp.experts.w_gate[{j}]/row_var"].size == (32, 1)
        assert names[f"optim/layers.0.mlp.experts.w_gate[{j}]/col_var"].size == (1, 32)


def test_tensor_parallel_cuts_of_quantisation_blocks():
    """`derived`: a cut between rows is taken where it falls on a block boundary, counted in
    values (an embedding of 128-value rows, 8-bit blocks of 256: after an even row), else
    refused in one line, as is a row-parallel cut through a block."""
    from fivefold.config import ConfigError
    from fivefold.parallel.optim_base import PieceInfo, derived

    def info(local, full, spec):
        p = torch.nn.Parameter(torch.zeros(local))
        p._full_shape, p._tp_slice = full, spec
        return PieceInfo(0, "w", p, 0, p.numel(), True)

    d = derived(info((128, 128), (256, 128), (0, 128, 256)), 256, "quantisation blocks")
    assert (d.shape, d._full_shape, d._tp_slice) == ((64,), (128,), (0, 64, 128))
    for local, full, spec in (((2, 128), (8, 128), (0, 1, 3)),  # from an odd row
                              ((512, 128), (512, 256), (1, 128, 256))):  # row-parallel
        with pytest.raises(ConfigError) as e:
            derived(info(local, full, spec), 256, "quantisation blocks")
        assert str(e.value).startswith(f"w {full} ") or f"cuts w {full}" in str(e.value)
        assert "quantisation blocks of 256" in str(e.value)
        assert "\n" not in str(e.value)
