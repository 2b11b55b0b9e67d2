"""[train]: the optimisation (steps, batch, learning rate, precision, recompute) and its
rules, including the batch's division into micro-batches and pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.fp8 import check_fp8
from fivefold.config.parallel import check_pipeline
from fivefold.config.rules import choice, positive
from fivefold.errors import ConfigError


@dataclass
class TrainSection:
    steps: int = 450
    gbs: int = 16  # global batch, in sequences
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30  # capped at 10% of train.steps
    lr_schedule: str = "cosine"  # cosine | linear | wsd | constant
    decay_fraction: float = 0.2  # wsd: the share of steps spent decaying
    optimizer: str = "adamw"  # adamw | adamw8bit | adamw4bit | adafactor | muon ([optim] keys)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 | fp8 (bf16 with FP8 GEMMs)
    fp8_recipe: str = "blockwise"  # blockwise | rowwise | rowwise_gw_hp | tensorwise
    fp8_grad_format: str = "auto"  # auto | e4m3 | e5m2: the output gradient's FP8 format
    fp8_keep_out: str = ""  # comma list of module-name patterns whose linears stay bf16
    fp8_kernel: str = "auto"  # blockwise GEMMs: auto | scaled_mm | emulated (config/fp8.py)
    fp8_scaling: str = "dynamic"  # tensorwise: dynamic | delayed (amax history, config/fp8.py)
    fp8_history_len: int = 16  # fp8_scaling = delayed: the amax history's length in steps
    recompute: str = "none"  # none | selective | full | auto (per layer, under memory_budget_gib)
    memory_budget_gib: float = 0.0  # recompute = auto: the peak allocated GiB per rank to fit
    compile: str = "auto"  # auto (on CUDA each block compiled, on a CPU eager) | true | false
    seed: int = 1234
    deterministic: bool = False
    max_bad_steps: int = 3  # non-finite loss/gradient: skip the step; stop after this many in a row
    device: str = "auto"  # auto | cpu | cuda
    eval_every: int = 100  # 0 disables validation
    eval_batches: int = 4


PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8")
RECOMPUTE = ("none", "selective", "full", "auto")


def check_train(cfg, mc) -> None:
    """The training keys against the model shape `mc` and the (resolved) layout."""
    par, tr = cfg.parallel, cfg.train
    positive("train.steps", tr.steps)
    positive("train.gbs", tr.gbs)
    positive("train.seq_len", tr.seq_len)
    if tr.seq_len > mc.max_seq_len:
        raise ConfigError(f"train.seq_len = {tr.seq_len} exceeds model.max_seq_len = "
                          f"{mc.max_seq_len}; lower seq_len or raise max_seq_len")
    if tr.gbs % (par.mbs * par.dp):
        raise ConfigError(f"train.gbs = {tr.gbs} is not divisible by parallel.mbs × parallel.dp ="
                          f" {par.mbs * par.dp}; make gbs a multiple of it")
    num_micro = tr.gbs // (par.mbs * par.dp)
    check_pipeline(par, mc.num_layers, num_micro)
    if tr.lr <= 0:
        raise ConfigError(f"train.lr = {tr.lr} must be > 0")
    if not 0 <= tr.seed < 2**32:  # numpy's and torch's generators take 32-bit unsigned seeds
        raise ConfigError(f"train.seed = {tr.seed} must lie in [0, 2**32); pick e.g. 1234")
    if tr.min_lr < 0 or tr.min_lr > tr.lr:
        raise ConfigError(f"train.min_lr = {tr.min_lr} must lie in [0, train.lr = {tr.lr}]")
    positive("train.warmup_steps", tr.warmup_steps, allow_zero=True)
    choice("train.lr_schedule", tr.lr_schedule, ("cosine", "linear", "wsd", "constant"))
    if not 0 <= tr.decay_fraction <= 1:
        raise ConfigError(f"train.decay_fraction = {tr.decay_fraction} must lie in [0, 1]")
    choice("train.precision", tr.precision, PRECISIONS)
    choice("train.recompute", tr.recompute, RECOMPUTE)
    check_memory_budget(cfg, mc)
    choice("train.device", tr.device, ("auto", "cpu", "cuda"))
    if not 0 <= tr.beta1 < 1 or not 0 <= tr.beta2 < 1:
        raise ConfigError("train.beta1 and train.beta2 must lie in [0, 1)")
    positive("train.eps", tr.eps)
    positive("train.grad_clip", tr.grad_clip, allow_zero=True)
    positive("train.weight_decay", tr.weight_decay, allow_zero=True)
    positive("train.eval_every", tr.eval_every, allow_zero=True)
    positive("train.eval_batches", tr.eval_batches)
    positive("train.max_bad_steps", tr.max_bad_steps)
    check_fp8(cfg, mc)


def check_budget_is_used(cfg) -> None:
    """A budget the user gives bounds recompute = auto's plan or parallel.layout = auto's
    search; with neither it is a bound nothing would hold to. A check of the user's config
    alone: the planner's trial configs carry a budget with any recompute."""
    tr = cfg.train
    if tr.memory_budget_gib > 0 and tr.recompute != "auto" and cfg.parallel.layout != "auto":
        raise ConfigError(f"train.memory_budget_gib = {tr.memory_budget_gib:g} bounds "
                          f"train.recompute = 'auto' or parallel.layout = 'auto' only, and "
                          f"train.recompute is '{tr.recompute}'; set one of them to 'auto' "
                          f"or drop the budget")


def check_memory_budget(cfg, mc) -> None:
    """recompute = auto needs a budget at or above full recomputation's peak (the planner's,
    for this layout; plan/recompute_plan.py), and a layout whose blocks it can checkpoint per
    operator: no tensor, context or expert parallelism, no experts. A pipeline is fine: the
    policies are applied block by block in forward order before the stages are cut, each
    stage's blocks from the plan of the pipeline rank that holds them."""
    par, tr = cfg.parallel, cfg.train
    positive("train.memory_budget_gib", tr.memory_budget_gib, allow_zero=True)
    if tr.recompute != "auto":
        return
    if tr.memory_budget_gib <= 0:
        raise ConfigError("train.recompute = 'auto' needs train.memory_budget_gib > 0 (the "
                          "peak GiB per rank to fit); set it, or pick none, selective or full")
    others = [f"parallel.{k} = {getattr(par, k)}" for k in ("tp", "cp", "ep")
              if getattr(par, k) > 1] + (["model.num_experts > 0"] if mc.num_experts else [])
    if others:
        raise ConfigError(f"train.recompute = 'auto' runs without tensor, context or expert "
                          f"parallelism and on dense models; {others[0]}: use selective or "
                          f"full")


def compile_value(value) -> str:
    """train.compile as given (a TOML boolean, or true/false/auto in any of the spellings a
    boolean key takes) → "auto" | "true" | "false"."""
    text = str(value).lower()
    if value is True or text in ("true", "1", "yes", "on"):
        return "true"
    if value is False or text in ("false", "0", "no", "off"):
        return "false"
    if text == "auto":
        return "auto"
    raise ConfigError(f"train.compile = {value!r}: use auto (compiled on CUDA, eager on a "
                      f"CPU), true or false")


def resolve_compile(value, device_type: str) -> bool:
    """Whether the blocks compile on a device of `device_type`: auto compiles on CUDA (each
    block on its own, as torchtitan does), not on a CPU, where a compile costs minutes of
    the system C++ compiler for a small model's seconds of training."""
    choice = compile_value(value)
    return choice == "true" or (choice == "auto" and device_type == "cuda")
