"""DP and ZeRO-1/2/3 (+ offload) against the single-process run, torch DDP and FSDP2.

Every multi-rank test starts its ranks once and runs several configurations in them. The
oracle is the single-process `MasterWeightOptimizer` over the same global batch: 16
sequences of 16 random tokens per step, split into 2 micro-batches on every rank (so
gradient accumulation is always exercised), loss = summed CE / tokens of the global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tolerances import loss_rtol, trained_rtol, within

from fivefold.config import Config, ParallelSection
from fivefold.models.init import build_model
from fivefold.parallel.apply import ParallelModel
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.zero import DataParallelOptimizer, build_data_parallel_optimizer
from fivefold.train.optim import MasterWeightOptimizer, decays
from fivefold.train.precision import LossScaler

GBS, SEQ, STEPS, LR = 16, 16, 5, 3e-3
BUCKET_MB = 0.02  # ~5 buckets for the nano model in fp32: overlap and ordering are exercised


def make_cfg(dp=1, zero=0, offload=False, tied=False, preset="nano") -> Config:
    cfg = Config()
    cfg.model.preset = preset
    if tied:
        cfg.model.overrides = {"tie_embeddings": True}
    cfg.parallel = ParallelSection(dp=dp, zero=zero, offload=offload, bucket_mb=BUCKET_MB, mbs=1,
                                   timeout_s=60.0)
    tr = cfg.train
    tr.lr, tr.warmup_steps, tr.lr_schedule, tr.grad_clip = LR, 0, "constant", 1.0
    return cfg


def global_batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(vocab, (GBS, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, opt, rank: int, world: int, steps: int = STEPS, forward=None):
    """Each rank's contiguous share of every global batch, as 2 micro-batches."""
    forward = forward or model
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else 64
    losses, norms = [], []
    for step in range(steps):
        x, y = global_batch(step, vocab)
        per = GBS // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        local = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            opt.prepare_backward(final_microbatch=i == 1)
            loss_sum = forward(xm, ym)
            (loss_sum / (GBS * SEQ)).backward()
            local += loss_sum.detach().float()
        opt.finish_grad_sync()
        stats = opt.step(LR)
        if world > 1:
            dist.all_reduce(local)
        losses.append(float(local) / (GBS * SEQ))
        norms.append(stats.grad_norm)
    return losses, norms


def build(cfg: Config, dtype=torch.float32):
    """Model, topology and optimizer of `cfg` on this rank (dp = 1: the reference)."""
    dims = ParallelDims.from_config(cfg.parallel) if cfg.parallel.dp > 1 else ParallelDims.single()
    model = build_model(cfg.model.resolve(), cfg.train.seed, dtype=dtype)
    named = list(model.named_parameters())
    if cfg.parallel.dp == 1 and cfg.parallel.zero == 0:
        return model, dims, MasterWeightOptimizer(named, cfg.train, dims, LossScaler())
    opt = build_data_parallel_optimizer(ParallelModel([model], dims), named, dims, cfg,
                                        LossScaler())
    return model, dims, opt


def final_params(opt) -> dict[str, torch.Tensor]:
    return {k: v["param"].float().clone() for k, v in opt.param_states().items()}


def reference(tied=False, dtype=torch.float32):
    model, _, opt = build(make_cfg(tied=tied), dtype)
    losses, norms = train(model, opt, 0, 1)
    return losses, norms, final_params(opt)


def _grid(rank, world, configs, dtype):
    out = {}
    for zero, offload, tied in configs:
        model, _, opt = build(make_cfg(world, zero, offload, tied), dtype)
        losses, norms = train(model, opt, rank, world)
        params = final_params(opt)  # a collective under ZeRO: every rank calls it
        opt.close()
        if rank == 0:
            out[(zero, offload, tied)] = (losses, norms, params)
    return out


# The float32 error model of tests/tolerances.py at this file's sizes: GBS·SEQ tokens per
# step, 2 blocks of 3 GEMMs (the model of `build`); the gradient norms of steps after the
# first and the final parameters are after AdamW steps.
LOSS_RTOL = loss_rtol(tokens=GBS * SEQ, depth=3 * 2)
TRAINED_RTOL = trained_rtol(tokens=GBS * SEQ, depth=3 * 2)


def assert_close_run(got, ref, loss_tol, norm_tol, param_tol, label, param_abs=False):
    """Losses and gradient norms relative; parameters in each tensor's norm, relative, or
    (param_abs) as the largest absolute difference of an element."""
    losses, norms, params = got
    for step, (a, b) in enumerate(zip(losses, ref[0])):
        assert within(abs(a - b) / abs(b), loss_tol, label), f"{label} step {step} loss {a} vs {b}"
    for step, (a, b) in enumerate(zip(norms, ref[1])):
        assert within(abs(a - b) / abs(b), norm_tol, label), \
            f"{label} step {step} grad norm {a} vs {b}"
    for name, value in ref[2].items():
        diff = params[name].float() - value.float()
        err = float(diff.abs().max() if param_abs else diff.norm() / value.float().norm())
        assert within(err, param_tol, f"{label} {name}"), f"{label} {name}: {err:.3g}"


GRID = [(zero, offload) for zero in (0, 1, 2, 3) for offload in (False, True)]


@pytest.mark.parametrize("dp", [2, pytest.param(4, marks=pytest.mark.slow),
                                pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parity
def test_fp32_parity_grid(dp):
    """Loss (LOSS_RTOL), gradient norm of each of 5 steps and final parameters (TRAINED_RTOL,
    relative) match the single-process run, for every ZeRO stage with and without offload.
    dp 2 uses tied embeddings (ZeRO-3 keeps one weight at both ends), dp 4 and 8 untied."""
    tied = dp == 2
    ref = reference(tied)
    results = run_ranks(_grid, dp, [(z, o, tied) for z, o in GRID], torch.float32)[0]
    for (zero, offload, _), got in results.items():
        label = f"dp={dp} zero={zero} offload={offload}"
        assert_close_run(got, ref, LOSS_RTOL, TRAINED_RTOL, TRAINED_RTOL, label)


def test_bf16_parity():
    """bf16 parameters and gradients (fp32 master and Adam) at dp 4 against the single-
    process bf16 run. Tolerance: bf16 keeps 8 significant bits (unit roundoff 2^-9 ≈ 2e-3);
    the gradients of 4 ranks are summed in bf16 in another order than one process adds its
    micro-batches, so each element may differ by a few ulps. Over 5 steps we accept 1e-3
    relative on the loss, 2e-2 on the gradient norm and, on each parameter element, 2 bf16
    ulps of a weight of magnitude ~1 (2·2^-7 = 1.6e-2 absolute). Not relative to a tensor's
    norm: an element whose reduced gradient rounds to the other side of zero takes AdamW's
    step the other way (±lr), a difference set by the learning rate, not by the weights'
    size, and small-normed weights such as o_proj's read up to 2e-2 of their norm from it.
    A wrong reduction (mean instead of sum) moves the gradient norm by 4x, far outside."""
    ref = reference(dtype=torch.bfloat16)
    configs = [(zero, offload, False) for zero, offload in ((0, False), (1, True), (2, False),
                                                            (3, True))]
    results = run_ranks(_grid, 4, configs, torch.bfloat16)[0]
    for (zero, offload, _), got in results.items():
        assert_close_run(got, ref, 1e-3, 2e-2, 1.6e-2, f"bf16 zero={zero} offload={offload}",
                         param_abs=True)


# --- torch's own DDP and FSDP2 as second oracles -------------------------------------------
def _peers(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    tr = make_cfg().train
    out = {}
    for kind in ("ddp", "fsdp2"):
        model = build_model(make_cfg().model.resolve(), tr.seed)
        if kind == "ddp":
            wrapped = DistributedDataParallel(model)
        else:
            mesh = init_device_mesh("cpu", (world,))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": 0.1},
                  {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
        adam = torch.optim.AdamW(groups, lr=LR, betas=(tr.beta1, tr.beta2), eps=tr.eps,
                                 foreach=True)
        out[kind] = _peer_loop(wrapped, model, adam, rank, world, kind)
    return out if rank == 0 else None


def _peer_loop(wrapped, model, adam, rank, world, kind):
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, 64)
        per = GBS // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        adam.zero_grad()
        local = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            final = i == 1
            if kind == "ddp":
                ctx = wrapped.no_sync() if not final else torch.enable_grad()
            else:
                wrapped.set_requires_gradient_sync(final)
                ctx = torch.enable_grad()
            with ctx:
                loss_sum = wrapped(xm, ym)
                # DDP and FSDP2 average over ranks; scaling by the world size makes it a sum.
                (loss_sum * world / (GBS * SEQ)).backward()
            local += loss_sum.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        adam.step()
        dist.all_reduce(local)
        losses.append(float(local) / (GBS * SEQ))
        norms.append(float(norm))
    params = {}
    for name, p in model.named_parameters():
        params[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return losses, norms, params


@pytest.mark.parity
def test_torch_ddp_and_fsdp2_agree():
    """torch's DDP and FSDP2 (fully_shard per block + root), same init and data, match the
    same single-process reference as fivefold does, at the same tolerances."""
    ref = reference()
    results = run_ranks(_peers, 2)[0]
    for kind, got in results.items():
        assert_close_run(got, ref, LOSS_RTOL, TRAINED_RTOL, TRAINED_RTOL, kind)


# --- communication ledger, overlap, memory -------------------------------------------------
def _ledger(rank, world):
    out = {}
    for zero in (0, 1, 2, 3):
        model, dims, opt = build(make_cfg(world, zero))
        dims.ledger.enabled = True
        x, y = global_batch(0, 64)
        per = GBS // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        # The embedding's gradient is the last one backward produces: this hook runs inside
        # backward's last node, so whatever was launched by then was launched during backward.
        launched_before_end: list[list[int]] = []

        def note(_, log=launched_before_end, reducer=opt.reducer):
            log.append(list(reducer.launch_log))
        handle = model.embed_tokens.weight.register_post_accumulate_grad_hook(note)
        dims.ledger.reset()
        opt.zero_grad()
        after_first = None
        for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            opt.prepare_backward(final_microbatch=i == 1)
            (model(xm, ym) / (GBS * SEQ)).backward()
            if i == 0:
                after_first = dims.ledger.totals()
        opt.finish_grad_sync()
        opt.step(LR)
        handle.remove()
        layout = opt.layout
        out[zero] = {"totals": dims.ledger.totals(), "after_first": after_first,
                     "launched": launched_before_end[-1], "order": opt.reducer.order,
                     "segments": len(layout.segments), "total": layout.total,
                     "numel": layout.numel}
        opt.close()
    return out


def test_ledger_and_overlap():
    """Per step at dp 4 (2 micro-batches): DP all-reduces every gradient element once, one
    call per bucket; ZeRO-1/2 reduce-scatter and all-gather every element once per bucket;
    ZeRO-3 all-gathers every parameter twice per micro-batch (forward and backward, so 4×
    here) and reduce-scatters once; stages 1-3 add one 1-element all-reduce (the squared
    norm of the shards, a float64: 8 bytes). The first micro-batch sends nothing (ZeRO-3:
    only its gathers).
    Overlap: when the last gradient arrives, every bucket but the last has been launched."""
    results = run_ranks(_ledger, 4)
    for rank_result in results:
        for zero, r in rank_result.items():
            t, n, total, numel = r["totals"], r["segments"], r["total"], r["numel"]
            assert total - numel < n * 4  # padding: under N elements per segment
            ar, rs, ag = (("dp_cp", op) for op in ("all_reduce", "reduce_scatter", "all_gather"))
            if zero == 0:
                assert t == {ar: {"calls": n, "elements": numel, "bytes": 4 * numel}}
                assert r["after_first"] == {}
            elif zero in (1, 2):
                assert t == {rs: {"calls": n, "elements": total, "bytes": 4 * total},
                             ag: {"calls": n, "elements": total, "bytes": 4 * total},
                             ar: {"calls": 1, "elements": 1, "bytes": 8}}
                assert r["after_first"] == {}
            else:
                assert t == {ag: {"calls": 4 * n, "elements": 4 * total, "bytes": 16 * total},
                             rs: {"calls": n, "elements": total, "bytes": 4 * total},
                             ar: {"calls": 1, "elements": 1, "bytes": 8}}
                assert r["after_first"] == {ag: {"calls": 2 * n, "elements": 2 * total,
                                                 "bytes": 8 * total}}
            assert n >= 3, "the test needs several buckets"
            # When backward produced its last gradient (final micro-batch), every bucket but
            # the last had been launched, in order: the reductions overlapped backward.
            assert r["launched"][:n - 1] == r["order"][:n - 1], (zero, r["launched"])


def _memory(rank, world):
    out = {}
    for zero in (0, 1, 2, 3):
        cfg = make_cfg(world, zero, preset="tiny")
        cfg.parallel.bucket_mb = 25.0
        model = build_model(cfg.model.resolve(), cfg.train.seed, dtype=torch.bfloat16)
        dims = ParallelDims.from_config(cfg.parallel)
        opt = build_data_parallel_optimizer(ParallelModel([model], dims),
                                            list(model.named_parameters()), dims, cfg,
                                            LossScaler())
        x = torch.randint(256, (2, 33))
        opt.zero_grad()
        opt.prepare_backward(True)
        model(x[:, :-1], x[:, 1:]).backward()
        opt.finish_grad_sync()
        opt.step(LR)
        out[zero] = (opt.memory_bytes(), opt.layout.numel, opt.layout.padding,
                     len(opt.layout.segments))
        opt.close()
    return out


@pytest.mark.parametrize("dp", [2, 8])
def test_memory_per_rank_bf16(dp):
    """Bytes per rank after a step (tiny preset, 0.8M parameters, bf16), from storages:
    2+2+12, 2+2+12/N, 2+(2+12)/N, (2+2+12)/N bytes per parameter within 1%, plus padding
    (under N elements per bucket or block, stated by the layout)."""
    per_param = {0: (2, 2, 4, 8), 1: (2, 2, 4 / dp, 8 / dp), 2: (2, 2 / dp, 4 / dp, 8 / dp),
                 3: (2 / dp, 2 / dp, 4 / dp, 8 / dp)}
    for zero, (mem, numel, padding, segments) in run_ranks(_memory, dp)[0].items():
        assert padding < segments * dp
        for key, bpp in zip(("params", "grads", "master", "optimizer"), per_param[zero]):
            expected = bpp * numel
            pad_bytes = bpp * padding
            assert abs(mem[key] - expected) <= 0.01 * expected + pad_bytes, (zero, key, mem)
        assert sum(mem.values()) <= 1.01 * sum(per_param[zero]) * (numel + padding)


def test_optimizer_is_torch_adamw_over_shards():
    """Sanity of the building block: a stage-0 optimizer alone (dp_cp of one) is the
    reference optimizer: losses and parameters bit for bit (the same foreach AdamW); the
    gradient norm to 1e-6 (summed per tensor with _foreach_norm, another rounding order)."""
    ref = reference()
    cfg = make_cfg(zero=0)
    dims = ParallelDims.single()
    model = build_model(cfg.model.resolve(), cfg.train.seed)
    opt = DataParallelOptimizer(list(model.named_parameters()), dims, cfg.train, LossScaler())
    losses, norms = train(model, opt, 0, 1)
    assert losses == ref[0]
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms, ref[1]))
    for name, value in ref[2].items():
        assert torch.equal(final_params(opt)[name], value), name
