"""[parallel]: the layout (dp, tp, pp, cp, ep, ZeRO, SP, schedules, buckets) and its rules,
including the automatic micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.config.rules import choice, positive
from fivefold.errors import ConfigError


@dataclass
class ParallelSection:
    # manual: the keys below are the layout; auto: the planner picks dp, tp, pp, cp, ep, zero,
    # mbs, recomputation, grad_sync and offload for the launched ranks, and every key below
    # that is set is a constraint it keeps (plan/auto_layout.py)
    layout: str = "manual"  # manual | auto
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # 0: plain DP; 1, 2, 3: ZeRO stages
    # true = cpu, false = none; nvme: files under offload_dir, streamed in chunks
    offload: str = "none"  # where the fp32 master and Adam's moments live: none | cpu | nvme
    offload_dir: str = ""  # offload = "nvme": the directory (a fast local disk) for them
    sp: bool = False  # sequence parallelism (needs tp > 1)
    # full | shard: what SP column linears keep for backward. full by default: measured on CPU/
    # gloo, shard saved 9% of saved bytes for a 12% slower step (bench/parallel/sp_saved_input.py)
    sp_saved_input: str = "full"
    cp_comm: str = "ring"  # context parallelism's K/V exchange: ring | allgather
    cp_layout: str = "zigzag"  # sequence split over cp ranks: zigzag | contiguous
    mbs: int = 0  # micro-batch size, in sequences; 0: auto (up to 4096 tokens; 1 under pp > 1)
    schedule: str = "1f1b"  # afab | 1f1b | interleaved | zb | dualpipev
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules)
    pp_split: str = "even"  # even | balanced: layers per stage (plan/split.py)
    pp_layers: list = field(default_factory=list)  # explicit layers per stage, e.g. [3, 4, 4, 3]
    bucket_mb: float = 25.0  # gradient bucket size for DP reduction, in MB
    buckets_in_flight: int = 2  # ZeRO-2/3: buckets filling or reducing at once (ZeRO-3 head apart)
    # step: once, after the last micro-batch (the whole gradient accumulates meanwhile);
    # microbatch: every micro-batch, into the shard (pp = 1); auto: microbatch where the
    # planner predicts a step at most 2% slower, or where once per step does not fit the
    # GPU (plan/grad_sync.py)
    grad_sync: str = "auto"  # ZeRO-2/3 gradient reduce-scatter: auto | step | microbatch
    timeout_s: float = 300.0  # a collective waiting longer than this fails the run
    # needs zero = 3, train.precision = fp8 and fp8_recipe = tensorwise (parallel/zero3_fp8.py)
    fp8_allgather: bool = False  # ZeRO-3 gathers FP8 linears' weights in FP8 (half of bf16)
    backend: str = "auto"  # auto | gloo | nccl

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


# parallel.timeout_s below this ends healthy runs: at 0.01 s gloo's own collectives time out
# while every rank is alive, and at 1-2 s the rendezvous itself (the TCP store waits
# parallel.timeout_s for every rank to join) fails when ranks start a few seconds apart.
MIN_TIMEOUT_S = 5.0


def check_parallel(cfg, mc) -> None:
    """The layout's keys against the model shape `mc` (the micro-batch resolved first)."""
    par, tr = cfg.parallel, cfg.train
    positive("parallel.mbs", par.mbs, allow_zero=True)
    resolve_mbs(cfg)
    for name in ("dp", "tp", "pp", "cp", "ep", "mbs", "virtual_stages"):
        positive(f"parallel.{name}", getattr(par, name))
    if par.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {par.zero} is not a ZeRO stage; use 0, 1, 2 or 3")
    choice("parallel.schedule", par.schedule, ("afab", "1f1b", "interleaved", "zb", "dualpipev"))
    choice("parallel.backend", par.backend, ("auto", "gloo", "nccl"))
    choice("parallel.sp_saved_input", par.sp_saved_input, ("full", "shard"))
    if par.sp and par.tp == 1:
        raise ConfigError("parallel.sp = true needs parallel.tp > 1; set parallel.tp or sp=false")
    if par.tp > 1:
        check_tensor(par, mc)
    check_expert(par, mc)
    if par.sp and tr.seq_len % par.tp:
        raise ConfigError(f"train.seq_len = {tr.seq_len} is not divisible by parallel.tp = "
                          f"{par.tp}, which sequence parallelism needs")
    check_context(par, tr)
    if par.bucket_mb <= 0:
        raise ConfigError(f"parallel.bucket_mb = {par.bucket_mb} must be > 0")
    if par.buckets_in_flight < 1:
        raise ConfigError(f"parallel.buckets_in_flight = {par.buckets_in_flight} must be >= 1 "
                          f"(2 keeps one bucket filling while the one before it is reduced)")
    check_grad_sync(par)
    check_offload(par)
    if par.timeout_s < MIN_TIMEOUT_S:
        raise ConfigError(f"parallel.timeout_s = {par.timeout_s} is below the floor of "
                          f"{MIN_TIMEOUT_S:g} s: healthy collectives wait that long for a slow "
                          f"peer (a checkpoint save, an evaluation) and would end the run; use "
                          f">= {MIN_TIMEOUT_S:g} (the default is 300)")


def check_grad_sync(par: ParallelSection) -> None:
    """Per micro-batch reduction runs without a pipeline only: pipeline ranks interleave the
    backwards of many micro-batches (and of tied embedding copies) before any is complete."""
    choice("parallel.grad_sync", par.grad_sync, ("auto", "step", "microbatch"))
    if par.grad_sync == "microbatch" and par.pp > 1:
        raise ConfigError(f"parallel.grad_sync = 'microbatch' needs parallel.pp = 1 (pipeline "
                          f"stages reduce once per step), not {par.pp}; use 'step' or 'auto'")
    if par.grad_sync == "microbatch" and par.zero < 2:
        raise ConfigError(f"parallel.grad_sync = 'microbatch' reduce-scatters each micro-batch "
                          f"into ZeRO-2/3 gradient shards, and parallel.zero = {par.zero} keeps "
                          f"no such shard; set parallel.zero = 2 or 3, or grad_sync = 'auto'")


OFFLOAD_TIERS = ("none", "cpu", "nvme")


def offload_value(value):
    """parallel.offload as given: a tier name, or the boolean it used to be (true = cpu)."""
    if isinstance(value, bool):
        return "cpu" if value else "none"
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no",
                                                    "on", "off"):
        return "cpu" if value.lower() in ("true", "1", "yes", "on") else "none"
    return value


def check_offload(par: ParallelSection) -> None:
    """The tier; nvme streams ZeRO's sharded states, so it needs a ZeRO stage and a dir."""
    par.offload = offload_value(par.offload)  # a config built in code may still say a bool
    choice("parallel.offload", par.offload, OFFLOAD_TIERS)
    if par.offload != "nvme":
        return
    if par.zero == 0:
        raise ConfigError("parallel.offload = 'nvme' streams ZeRO's sharded optimizer states "
                          "and needs parallel.zero >= 1; set parallel.zero = 1, 2 or 3")
    if not par.offload_dir:
        raise ConfigError("parallel.offload = 'nvme' needs parallel.offload_dir, a directory "
                          "on a fast local disk for the optimizer states")


def offload_dir_problem(path: str) -> str | None:
    """Why `path` cannot hold offload files, or None. Nothing is created here: the directory,
    or where it does not exist yet its nearest existing parent, must be a writable
    directory (the run creates it, and its files, when the optimizer is built)."""
    import os
    from pathlib import Path

    target = Path(path).absolute()
    while not target.exists():
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"{target} is not writable"
    return None


def check_offload_dir(cfg) -> None:
    """Before training: offload = "nvme" needs a directory it can write (exit 2 if not)."""
    par = cfg.parallel
    if par.offload == "nvme":
        problem = offload_dir_problem(par.offload_dir)
        if problem:
            raise ConfigError(f"parallel.offload_dir = {par.offload_dir!r} cannot take the "
                              f"optimizer states: {problem}; give a writable directory")


def check_tensor(par: ParallelSection, mc) -> None:
    """tp shards heads, the MLP and the vocabulary: each must divide (parallel/tensor.py)."""
    if mc.num_heads % par.tp:
        raise ConfigError(f"parallel.tp = {par.tp} does not divide model.num_heads = "
                          f"{mc.num_heads}; pick a tp that divides the heads")
    if mc.intermediate_size % par.tp:
        raise ConfigError(f"parallel.tp = {par.tp} does not divide model.intermediate_size ="
                          f" {mc.intermediate_size}; pick a tp that divides it")
    rows_per_rank = -(-mc.vocab_size // par.tp)  # the vocabulary is padded to tp pieces
    if (par.tp - 1) * rows_per_rank >= mc.vocab_size:
        raise ConfigError(f"model.vocab_size = {mc.vocab_size} is too small for parallel.tp "
                          f"= {par.tp}: a rank would hold only padding rows; lower tp")
    if mc.num_kv_heads % par.tp and par.tp % mc.num_kv_heads:
        raise ConfigError(f"parallel.tp = {par.tp} and model.num_kv_heads = "
                          f"{mc.num_kv_heads}: one must divide the other")


def check_expert(par: ParallelSection, mc) -> None:
    """ep ranks split the experts and are carved out of dp·cp (parallel/mesh.py)."""
    if par.ep == 1:
        return
    if not mc.num_experts:
        raise ConfigError(f"parallel.ep = {par.ep} needs a mixture-of-experts model "
                          f"(model.num_experts > 0); set parallel.ep = 1")
    if mc.num_experts % par.ep:
        raise ConfigError(f"parallel.ep = {par.ep} does not divide model.num_experts = "
                          f"{mc.num_experts}; pick an ep that divides the experts")
    if (par.dp * par.cp) % par.ep:
        raise ConfigError(f"parallel.ep = {par.ep} does not divide parallel.dp·cp = "
                          f"{par.dp * par.cp}; expert ranks are carved out of dp×cp: pick an "
                          f"ep dividing it or raise dp")


def check_context(par: ParallelSection, tr) -> None:
    choice("parallel.cp_comm", par.cp_comm, ("ring", "allgather"))
    choice("parallel.cp_layout", par.cp_layout, ("zigzag", "contiguous"))
    if par.cp > 1 and tr.seq_len % (2 * par.cp):
        raise ConfigError(f"train.seq_len = {tr.seq_len} is not divisible by 2·parallel.cp = "
                          f"{2 * par.cp} (each sequence is cut into 2·cp chunks); pick a "
                          f"seq_len that is a multiple of {2 * par.cp} or another cp")
    if par.cp > 1 and par.sp and tr.seq_len % (par.cp * par.tp):
        raise ConfigError(f"train.seq_len = {tr.seq_len} is not divisible by parallel.cp·tp = "
                          f"{par.cp * par.tp}, which sequence parallelism under cp needs")


def check_pipeline(par: ParallelSection, num_layers: int, num_micro: int) -> None:
    """Ask the schedule itself (pure Python, no torch), so the engine and this agree."""
    choice("parallel.pp_split", par.pp_split, ("even", "balanced"))
    if par.pp == 1:
        if par.pp_layers:
            raise ConfigError(f"parallel.pp_layers = {par.pp_layers} needs parallel.pp > 1; "
                              f"leave it empty")
        if par.virtual_stages > 1:
            raise ConfigError(f"parallel.virtual_stages = {par.virtual_stages} needs "
                              f"parallel.pp > 1 and parallel.schedule = 'interleaved'")
        # (under layout = auto the planner may pick pp = 1 for a schedule it was given)
        if par.schedule != "1f1b" and par.layout == "manual":
            raise ConfigError(f"parallel.schedule = '{par.schedule}' needs parallel.pp > 1 (a "
                              f"schedule orders pipeline stages); set parallel.pp or drop it")
        return
    from fivefold.parallel.pipeline.schedules import build_schedule

    try:
        schedule = build_schedule(par.schedule, par.pp, num_micro, par.virtual_stages)
    except ValueError as e:
        raise ConfigError(f"parallel.schedule = '{par.schedule}' at parallel.pp = {par.pp} with "
                          f"{num_micro} micro-batches (train.gbs / (mbs·dp)): {e}") from None
    from fivefold.plan.split import check_split

    problem = check_split(num_layers, schedule.num_stages, par.pp_split, par.pp_layers)
    if problem and (par.pp_layers or par.pp_split != "even"):
        raise ConfigError(problem)
    if schedule.num_stages > num_layers:
        raise ConfigError(f"parallel.pp = {par.pp} with schedule '{par.schedule}' makes "
                          f"{schedule.num_stages} stages but model.num_layers = {num_layers}; "
                          f"every stage needs a layer: lower pp or virtual_stages")


# The most tokens an automatic micro-batch holds per rank: one 4096-token sequence, so that
# auto never keeps more activations than mbs = 1 did at sequence 4096 or longer (at 8192
# tokens an 8B model's micro-batch of 4 needs 133 GiB per GPU where 1 fits in 68).
AUTO_MBS_TOKENS = 4096


def resolve_mbs(cfg) -> None:
    """parallel.mbs = 0 (auto), made concrete in place: without a pipeline, the largest
    micro-batch that divides the rank's share of the global batch within AUTO_MBS_TOKENS
    tokens per rank (at least 1), so that a run of short sequences does not accumulate many
    small micro-batches (the default job: one micro-batch of 16 x 128 instead of 16 of one
    sequence); with a pipeline, 1, which gives the most micro-batches and so the smallest
    bubble. A given mbs is kept as it is."""
    par, tr = cfg.parallel, cfg.train
    if par.mbs:
        return
    if par.pp > 1 or par.dp < 1 or tr.gbs < 1 or tr.gbs % par.dp:
        par.mbs = 1  # (a bad gbs or dp is reported by validate with these numbers)
        return
    per_rank = tr.gbs // par.dp
    cap = max(1, AUTO_MBS_TOKENS * max(par.cp, 1) // max(tr.seq_len, 1))
    par.mbs = max(b for b in range(1, min(per_rank, cap) + 1) if per_rank % b == 0)
