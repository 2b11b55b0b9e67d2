"""What a trainer saves and loads: each rank's parts of every logical tensor, as views of its
shards (train/checkpoint.py writes and reads them), the trainer's own state, and the checks
around a save (no NaN weights, a writable directory) and a load (the same model, adapters and
optimizer, every rank agreeing). `Trainer`'s checkpoint methods call these."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint import CheckpointException

from fivefold.config import ConfigError, RunError
from fivefold.finetune.attach import check_resume
from fivefold.parallel import comm
from fivefold.train import checkpoint as ckpt
from fivefold.train.lifecycle import ledger_paused
from fivefold.train.optim import resume_conversion
from fivefold.train.recovery import agree, one_line, save_error, save_failed, unwritable


class NonFiniteError(RunError):
    """The run produced NaN or inf weights; it stops without saving them."""


def logical_tensors(trainer) -> dict[str, torch.Tensor]:
    """Every tensor of this rank under its logical name, gathered to its full shape (stacked
    expert weights: one tensor per expert, `NAME[j]`, only this rank's experts). For
    comparisons in tests; checkpoints never gather, see `checkpoint_parts`."""
    from fivefold.parallel.expert import expert_param_ids
    from fivefold.parallel.shards import logical_entries

    out = {}
    states = trainer.optimizer.param_states()
    experts = expert_param_ids(trainer.model.chunks)
    for name, p in trainer.model.named_parameters():
        for key, value in states[name].items():
            for logical, full in logical_entries(name, p, value, trainer.dims,
                                                 id(p) in experts).items():
                out[f"model/{logical}" if key == "param" else f"optim/{logical}/{key}"] = full
    if trainer.moe is not None:  # the aux-loss-free biases are training state too
        for name, bias in trainer.moe.expert_biases().items():
            out[f"buffer/{name}"] = bias.detach().clone()
    for key, history in fp8_histories(trainer).items():
        out[key] = history.detach().clone()
    return out


def fp8_histories(trainer) -> dict[str, torch.Tensor]:
    """Delayed FP8 scaling's amax histories (lowp/delayed.py), training state: those of
    this rank's model chunks, under the unsplit model's module names (so any pp layout
    reads any other's); routed experts': this rank's experts' rows."""
    return {key: h for key, (_, _, h) in fp8_history_parts(trainer).items()}


def fp8_history_parts(trainer) -> dict[str, tuple[tuple, tuple, torch.Tensor]]:
    """(logical shape, this rank's offset, local tensor) of every amax history: under
    expert parallelism an experts' history is cut along its experts as their weights are."""
    from fivefold.lowp.delayed import history_parts

    return {f"fp8/{name}.amax_history": part for chunk in trainer.model.chunks
            for name, part in history_parts(chunk).items()}


def checkpoint_parts(trainer, load: bool = False, convert_from: str | None = None
                     ) -> dict[str, ckpt.Chunked]:
    """What this rank owns of every logical tensor, as views of its shards (see
    train/checkpoint.py). Saving, a tied embedding's second copy (last pipeline stage)
    is left to the first stage, whose ZeRO layout cuts it differently."""
    from fivefold.parallel.expert import expert_param_ids
    from fivefold.parallel.shards import logical_parts, per_expert_parts

    experts = expert_param_ids(trainer.model.chunks)
    out: dict[str, ckpt.Chunked] = {}
    states = (trainer.optimizer.shard_states(load, convert_from) if convert_from
              else trainer.optimizer.shard_states(load))
    for name, p, lo, hi, views in states:
        if not load and getattr(p, "_pp_replicas", 1) > 1 and trainer.dims.pp_rank != 0:
            continue
        for key, flat in views.items():
            # a state shaped unlike its parameter comes with its own descriptor
            # (parallel/optim_base.py): quantisation scales, packed codes, Adafactor's
            q, a, b = p, lo, hi
            if isinstance(flat, tuple):
                q, a, b, flat = flat
            size = tuple(getattr(q, "_full_shape", q.shape))
            parts = logical_parts(q, a, b, flat)
            by_name = (per_expert_parts(name, q, parts) if id(p) in experts
                       else {name: parts})
            for logical, pieces in by_name.items():
                key_name = (f"model/{logical}" if key == "param"
                            else f"optim/{logical}/{key}")
                shape = size[1:] if id(p) in experts else size
                out.setdefault(key_name, ckpt.Chunked(shape, [])).parts.extend(pieces)
    if trainer.moe is not None:  # the aux-loss-free biases are training state too
        for name, bias in trainer.moe.expert_biases().items():
            out[f"buffer/{name}"] = ckpt.Chunked(tuple(bias.shape),
                                                 [((0,) * bias.dim(), bias.detach())])
    for key, (shape, offset, history) in fp8_history_parts(trainer).items():  # in place
        out[key] = ckpt.Chunked(shape, [(offset, history)])
    return out


def trainer_state(trainer) -> dict:
    return {"step": trainer.step, "optim_step": trainer.optimizer.step_count(),
            "loader": trainer.loader.state_dict(), "scaler": trainer.scaler.state_dict()}


def nonfinite_tensors(trainer, tensors: dict[str, ckpt.Chunked]) -> int:
    """How many of the tensors to save hold a NaN or an infinity in this rank's parts: the
    most any rank found (every rank takes the same decision)."""
    bad = torch.tensor([float(sum(not all(bool(torch.isfinite(t).all()) for _, t in c.parts)
                                  for c in tensors.values()))], device=trainer.device)
    with ledger_paused(trainer.dims):
        comm.all_reduce(bad, trainer.dims["world"], op="max")
    return int(bad.item())


def save_checkpoint(trainer) -> None:
    """Save this step, unless its weights or optimizer states are not finite: a NaN
    checkpoint would rotate the good ones out, so the run stops instead."""
    trainer.settle()  # the steps' records first: a run of bad steps stops before a save
    cfg = trainer.cfg
    meta = {"step": trainer.step, "model": dataclasses.asdict(trainer.model_cfg),
            "config": cfg.to_dict(), "tokenizer": trainer.tokenizer_spec,
            "precision": trainer.precision}
    if getattr(cfg, "auto_layout", None):  # parallel.layout = auto: what it chose (resume)
        meta["auto_layout"] = cfg.auto_layout
    tensors = trainer.checkpoint_parts()
    bad = trainer.nonfinite_tensors(tensors)
    if bad:
        raise NonFiniteError(
            f"step {trainer.step}: {bad} weight/optimizer tensor(s) hold NaN or inf, so no "
            f"checkpoint is saved and the earlier ones in {cfg.checkpoint.dir} are kept; "
            f"resume from the latest one with a lower train.lr (or train.grad_clip)")
    problem = unwritable(cfg.checkpoint.dir) if trainer.dims.rank == 0 else None
    if agree(trainer, problem) is not None:  # rank 0 alone writes there first: all stop here
        raise save_failed(trainer, OSError(problem or "rank 0 cannot write there"))
    try:
        ckpt.save(cfg.checkpoint.dir, trainer.step, tensors, trainer.trainer_state(), meta,
                  cfg.checkpoint.keep)
    except (Exception, CheckpointException) as e:  # DCP raises on every rank together
        failure = save_error(trainer, e)  # disk full, unwritable, a rank lost (recovery.py)
        if failure is None:
            raise
        raise failure from e


def load_checkpoint(trainer, path) -> str | None:
    """Load `path` into this trainer; returns why it could not be read (None: loaded).
    A checkpoint of another model shape or data position is a ConfigError, raised. A
    failed read may have filled some shards: the caller loads another checkpoint over
    them, or stops."""
    meta = problem = None
    try:
        meta = ckpt.read_meta(path)
    except (ConfigError, OSError) as e:
        problem = one_line(e)
    problem = agree(trainer, problem)
    if problem is not None:
        return problem
    ckpt.check_model_shape(meta, trainer.model_cfg, path)
    check_resume(meta, trainer.cfg, path)  # the same adapters (or none) as this run
    convert_from = resume_conversion(meta, trainer.cfg, path)
    state = {"step": 0, "optim_step": 0, "loader": trainer.loader.state_dict(),
             "scaler": trainer.scaler.state_dict()}
    try:
        with torch.no_grad():
            ckpt.load(path, trainer.checkpoint_parts(True, convert_from), state)
    except ckpt.ModelMismatch:  # another model, on every rank: a bad input, no fallback
        raise
    except (Exception, CheckpointException) as e:  # DCP raises on every rank together;
        problem = one_line(e)  # the rng file is read per rank
    problem = agree(trainer, problem)
    if problem is not None:
        return problem
    trainer.optimizer.loaded(state["optim_step"])
    from fivefold.lowp.delayed import forget_filled

    for chunk in trainer.model.chunks:  # the histories were written: read them again
        forget_filled(chunk)
    trainer.loader.load_state_dict(state["loader"])
    trainer.scaler.load_state_dict(state["scaler"])
    trainer.step = state["step"]
    trainer.resumed_from = str(path)
    trainer.resumed_meta = meta
    return None
