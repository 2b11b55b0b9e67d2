"""Typed configuration: TOML sections, `--section.key value` overrides, validation in one place.

Every check of a config happens in `validate()`, before any process group exists. A bad
value raises `ConfigError`, whose message is one line naming the key, the value and the fix;
the CLI prints it and exits with code 2.
This module imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.models.presets import PRESETS, ModelConfig, preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A user-facing configuration problem: one line, naming the key and the fix."""


class RunError(RuntimeError):
    """A run that stopped for a reason it can name in one line (NaN weights, a lost rank).
    The CLI prints the message and exits with `exit_code`."""

    exit_code = 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad or missing argument in one line with exit code 2, like
    every other input error, instead of printing its usage block first (every command's
    parser is one of these)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


@dataclass
class ModelSection:
    preset: str = "tiny-bpe"
    hf_path: str = ""  # a local Hugging Face checkpoint directory (config.json + safetensors)
    # Any ModelConfig field may be overridden here (hidden_size, num_layers, ...).
    overrides: dict = field(default_factory=dict)

    def resolve(self) -> ModelConfig:
        """The model shape: the preset (or the HF config.json) with the overrides applied."""
        if self.hf_path:
            from fivefold.models.hf_config import model_config_from_hf

            base = model_config_from_hf(Path(self.hf_path) / "config.json")
        else:
            base = preset(self.preset)
        return base.replace(**self.overrides) if self.overrides else base


@dataclass
class ParallelSection:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # 0: plain DP; 1, 2, 3: ZeRO stages
    offload: bool = False  # fp32 master weights and optimizer states on CPU
    sp: bool = False  # sequence parallelism (needs tp > 1)
    # full | shard: what SP column linears keep for backward. full by default: measured on
    # CPU/gloo, shard saved 9% of saved bytes for a 12% slower step (bench/sp_saved_input.py)
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
    timeout_s: float = 300.0  # a collective waiting longer than this fails the run
    backend: str = "auto"  # auto | gloo | nccl

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


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
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    recompute: str = "none"  # none | selective | full
    compile: bool = False  # torch.compile each transformer block (inductor)
    seed: int = 1234
    deterministic: bool = False
    max_bad_steps: int = 3  # non-finite loss/gradient: skip the step; stop after this many in a row
    device: str = "auto"  # auto | cpu | cuda
    eval_every: int = 100  # 0 disables validation
    eval_batches: int = 4


@dataclass
class DataSection:
    path: str = ""  # a token file from `fivefold prepare`; empty: the bundled corpus
    val_fraction: float = 0.05
    tokenizer: str = "auto"  # auto: corpus-bpe if model.vocab_size >= 2048, else byte; or a .json


CORPUS_TOKENIZERS = ("auto", "corpus-bpe", "byte")
CORPUS_BPE_VOCAB = 2048  # data/corpus/bpe-2048.json


def corpus_tokenizer(spec: str, vocab_size: int) -> str:
    """data.tokenizer for the bundled corpus, with auto resolved: the shipped BPE when the
    model's vocabulary holds it, bytes otherwise (the byte-vocabulary presets tiny and tiny-moe
    keep training on bytes)."""
    if spec != "auto":
        return spec
    return "corpus-bpe" if vocab_size >= CORPUS_BPE_VOCAB else "byte"


# "latest" (the pointer file) and "" (fresh) are the older spellings of auto and never.
RESUME_MODES = ("auto", "latest", "never", "")


@dataclass
class CheckpointSection:
    dir: str = "runs/default/checkpoints"
    every: int = 100  # 0: only at the end
    keep: int = 2
    resume: str = "auto"  # auto (newest loadable, if any) | never | a step_* directory
    save_on_signal: bool = True  # SIGTERM: write a checkpoint at the next step boundary, exit


@dataclass
class LogSection:
    dir: str = "runs/default"
    every: int = 10
    progress: bool = True
    tensorboard: bool = True
    ledger: bool = False  # print a per-step summary of the communication ledger
    peak_tflops: float = 0.0  # 0: take the device's peak from the hardware table


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = {"preset": self.model.preset, "hf_path": self.model.hf_path,
                        **self.model.overrides}
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}

def _section_class(name: str):
    return {
        "model": ModelSection, "parallel": ParallelSection, "train": TrainSection,
        "data": DataSection, "checkpoint": CheckpointSection, "log": LogSection,
    }[name]


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(key: str, value, typ):
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    if isinstance(typ, str):
        typ = eval(typ, {"dict": dict, "float": float, "int": int, "str": str, "bool": bool,
                         "None": type(None), "list": list})
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or value == "none":
            return None
        typ = args[0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key} = {value!r} is not a boolean; use true or false")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not an integer; give a whole number")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} = {value!r} is not an integer; give a whole number") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not a number; give a number such as 3e-4")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{key} = {value!r} is not a number; give a number such as 3e-4") from None
        if not math.isfinite(number):  # nan passes every `<` check, inf overflows later
            raise ConfigError(f"{key} = {value!r} is not a finite number; give e.g. 3e-4")
        return number
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not a string; quote it")
        return str(value)
    if typ is list:  # a list of whole numbers: a TOML array, or "3,4,4,3" on the command line
        items = value.replace(" ", "").strip("[]").split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{key} = {value!r} is not a list; write e.g. [3, 4, 4, 3]")
        return [_coerce(key, v, int) for v in items if v != ""]
    if typ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} is not a table")
        return value
    return value


def _model_override(key: str, value):
    from fivefold.models.presets import MODEL_FIELDS

    if key not in MODEL_FIELDS or key == "name":
        allowed = ["preset", "hf_path", *MODEL_FIELDS]
        raise ConfigError(f"unknown key model.{key}{_suggest(key, allowed)}; "
                          f"model takes preset, hf_path or a model field")
    return _coerce(f"model.{key}", value, MODEL_FIELDS[key].type)


def set_value(cfg: Config, dotted: str, value) -> None:
    """Set `section.key` on cfg from a TOML or command-line value, with type checks."""
    if "." not in dotted:
        raise ConfigError(f"override '{dotted}' needs the form --section.key value; "
                          f"sections: {', '.join(SECTIONS)}")
    section, key = dotted.split(".", 1)
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}'{_suggest(section, SECTIONS)}; "
                          f"sections: {', '.join(SECTIONS)}")
    obj = getattr(cfg, section)
    if section == "model" and key not in ("preset", "hf_path"):
        obj.overrides[key] = _model_override(key, value)
        return
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields or key == "overrides":
        names = [n for n in fields if n != "overrides"]
        raise ConfigError(f"unknown key {section}.{key}{_suggest(key, names)}; "
                          f"{section} takes: {', '.join(names)}")
    setattr(obj, key, _coerce(dotted, value, fields[key].type))


def from_dict(data: dict, cfg: Config | None = None) -> Config:
    cfg = cfg or Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]{_suggest(section, SECTIONS)}; "
                              f"sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}' must be a [section] table, not a value")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value)
    return cfg


def load(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (optional), apply `--section.key value` overrides, validate."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise ConfigError(f"config file {p} {what}; give the path of a .toml file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML ({e}); fix the syntax") from None
        from_dict(data, cfg)
    apply_overrides(cfg, overrides or [])
    validate(cfg)
    return cfg


def apply_overrides(cfg: Config, args: list[str]) -> None:
    """Apply ['--train.lr', '1e-3', '--parallel.dp=2', ...] to cfg."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --train.lr 1e-3")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value; write {arg} VALUE")
            key, value = arg[2:], args[i + 1]
            i += 2
        set_value(cfg, key, value)


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key} = '{value}' is not one of {', '.join(choices)}"
                          f"{_suggest(value, choices)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} = {value} must be {'>= 0' if allow_zero else '> 0'}")


def _check_context(par, tr) -> None:
    _choice("parallel.cp_comm", par.cp_comm, ("ring", "allgather"))
    _choice("parallel.cp_layout", par.cp_layout, ("zigzag", "contiguous"))
    if par.cp > 1 and tr.seq_len % (2 * par.cp):
        raise ConfigError(f"train.seq_len = {tr.seq_len} is not divisible by 2·parallel.cp = "
                          f"{2 * par.cp} (each sequence is cut into 2·cp chunks); pick a "
                          f"seq_len that is a multiple of {2 * par.cp} or another cp")
    if par.cp > 1 and par.sp and tr.seq_len % (par.cp * par.tp):
        raise ConfigError(f"train.seq_len = {tr.seq_len} is not divisible by parallel.cp·tp = "
                          f"{par.cp * par.tp}, which sequence parallelism under cp needs")
    if par.cp > 1 and tr.device == "cuda":
        raise ConfigError("parallel.cp > 1 with train.device = 'cuda': the ring's block kernel "
                          "(attention with its log-sum-exp) is CPU-only in this version; set "
                          "train.device = 'cpu' or parallel.cp = 1")


def writable_dir(key: str, path: str) -> None:
    """An output directory must be one (or creatable) and writable, before training starts:
    the first save is too late to find out."""
    p = Path(path)
    named = f"{key} {path}" if key.startswith("-") else f"{key} = '{path}'"
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{named} is a file, not a directory; give a directory path")
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{named} cannot be created: {existing} is a file; give "
                          f"another directory path")
    try:  # a real probe: permission bits say nothing for root or on a read-only mount
        tempfile.TemporaryDirectory(dir=existing, prefix=".fivefold-probe-").cleanup()
    except OSError as e:
        raise ConfigError(f"{named} is not writable ({e.strerror} in {existing}); "
                          f"give a directory you can write to") from None


def writable_file(key: str, path: str) -> None:
    """An output file's path must not be a directory, and its directory must be writable."""
    if Path(path).is_dir():
        raise ConfigError(f"{key} {path} is a directory; give a file name inside it")
    writable_dir(key, str(Path(path).parent))


def _check_pipeline(par: ParallelSection, num_layers: int, num_micro: int) -> None:
    """Ask the schedule itself (pure Python, no torch), so the engine and this agree."""
    _choice("parallel.pp_split", par.pp_split, ("even", "balanced"))
    if par.pp == 1:
        if par.pp_layers:
            raise ConfigError(f"parallel.pp_layers = {par.pp_layers} needs parallel.pp > 1; "
                              f"leave it empty")
        if par.virtual_stages > 1:
            raise ConfigError(f"parallel.virtual_stages = {par.virtual_stages} needs "
                              f"parallel.pp > 1 and parallel.schedule = 'interleaved'")
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


def _check_moe(mc, par: ParallelSection) -> None:
    """Mixture-of-experts keys (models/moe.py)."""
    e, k = mc.num_experts, mc.experts_top_k
    if not 1 <= k <= e:
        raise ConfigError(f"model.experts_top_k = {k} must lie in [1, model.num_experts = {e}]")
    _positive("model.moe_intermediate_size", mc.moe_intermediate_size)
    _positive("model.moe_layer_freq", mc.moe_layer_freq)
    _positive("model.moe_first_dense", mc.moe_first_dense, allow_zero=True)
    if mc.num_moe_layers == 0:
        raise ConfigError(f"model.moe_first_dense = {mc.moe_first_dense} and moe_layer_freq = "
                          f"{mc.moe_layer_freq} leave no MoE layer among {mc.num_layers}; "
                          f"lower them or set model.num_experts = 0")
    _choice("model.router_score", mc.router_score, ("softmax", "sigmoid"))
    groups = mc.router_groups
    if groups < 1 or e % groups:
        raise ConfigError(f"model.router_groups = {groups} must divide model.num_experts = {e}")
    if not 1 <= mc.router_topk_groups <= groups:
        raise ConfigError(f"model.router_topk_groups = {mc.router_topk_groups} must lie in "
                          f"[1, model.router_groups = {groups}]")
    if k > mc.router_topk_groups * (e // groups):
        raise ConfigError(f"model.experts_top_k = {k} exceeds the experts of the "
                          f"{mc.router_topk_groups} kept groups; raise router_topk_groups")
    _positive("model.routed_scaling_factor", mc.routed_scaling_factor)
    for name in ("shared_expert_intermediate_size", "capacity_factor", "aux_loss_coeff",
                 "z_loss_coeff", "expert_bias_rate"):
        _positive(f"model.{name}", getattr(mc, name), allow_zero=True)
    cut = [n for n in ("aux_loss_coeff", "z_loss_coeff", "capacity_factor") if getattr(mc, n)]
    if par.cp > 1 and cut:
        raise ConfigError(f"model.{cut[0]} = {getattr(mc, cut[0])} with parallel.cp = {par.cp}: "
                          f"the per-sequence balance losses and capacity need whole sequences; "
                          f"set it to 0 (the expert bias balances without it) or cp = 1")
    if par.sp:
        raise ConfigError("parallel.sp = true with a mixture-of-experts model: sequence "
                          "parallelism would cut the sequences the balance loss is taken over; "
                          "set parallel.sp = false (tp shards the attention, experts replicate)")


def validate(cfg: Config) -> None:
    """Every check of a config, in one place. Raises ConfigError with a one-line fix."""
    validate_layout(cfg)
    _validate_files(cfg)


def engine_refusal(cfg: Config) -> str | None:
    """Why `fivefold train` would refuse this config's model, layout and batch, or None. The
    planner asks it before recommending a layout, so it never suggests what train refuses."""
    try:
        validate_layout(cfg)
    except ConfigError as e:
        return str(e)
    return None


def validate_layout(cfg: Config) -> None:
    """The checks of the model, the parallel layout and the training shape (no files)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    if not m.hf_path and m.preset.lower() not in PRESETS:
        raise ConfigError(f"model.preset = '{m.preset}' is unknown{_suggest(m.preset, PRESETS)};"
                          f" known presets: {', '.join(PRESETS)}")
    if m.hf_path and not (Path(m.hf_path) / "config.json").is_file():
        raise ConfigError(f"model.hf_path = '{m.hf_path}' has no config.json; give a Hugging "
                          f"Face checkpoint directory")
    mc = m.resolve()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_seq_len"):
        _positive(f"model.{name}", getattr(mc, name))
    if mc.num_heads % mc.num_kv_heads:
        raise ConfigError(f"model.num_heads = {mc.num_heads} is not a multiple of "
                          f"model.num_kv_heads = {mc.num_kv_heads}; pick kv heads dividing it")
    if mc.head_dim is None and mc.hidden_size % mc.num_heads:
        raise ConfigError(f"model.hidden_size = {mc.hidden_size} is not divisible by "
                          f"model.num_heads = {mc.num_heads}; set model.head_dim or change them")
    if mc.dim_per_head % 2:
        raise ConfigError(f"head dimension {mc.dim_per_head} is odd; RoPE needs an even one")
    _positive("model.rope_theta", mc.rope_theta)
    _positive("model.norm_eps", mc.norm_eps, allow_zero=True)
    _positive("model.init_std", mc.init_std, allow_zero=True)
    if mc.rope_scaling is not None:
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if k not in mc.rope_scaling]
        if missing:
            raise ConfigError(f"model.rope_scaling lacks {', '.join(missing)}; give all four "
                              f"keys of Llama-3.1 scaling, or leave rope_scaling unset")
    _positive("model.num_experts", mc.num_experts, allow_zero=True)
    if mc.num_experts:
        _check_moe(mc, par)
    if mc.qk_norm and mc.qk_norm_whole and par.tp > 1:
        raise ConfigError(f"model.qk_norm_whole = true with parallel.tp = {par.tp}: a norm over "
                          f"all heads' q and k spans the tp ranks; use tp = 1")
    _choice("model.mlp", mc.mlp, ("swiglu", "gelu"))
    _choice("model.norm", mc.norm, ("rmsnorm", "layernorm"))

    _positive("parallel.mbs", par.mbs, allow_zero=True)
    resolve_mbs(cfg)
    for name in ("dp", "tp", "pp", "cp", "ep", "mbs", "virtual_stages"):
        _positive(f"parallel.{name}", getattr(par, name))
    if par.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {par.zero} is not a ZeRO stage; use 0, 1, 2 or 3")
    _choice("parallel.schedule", par.schedule, ("afab", "1f1b", "interleaved", "zb", "dualpipev"))
    _choice("parallel.backend", par.backend, ("auto", "gloo", "nccl"))
    _choice("parallel.sp_saved_input", par.sp_saved_input, ("full", "shard"))
    if par.sp and par.tp == 1:
        raise ConfigError("parallel.sp = true needs parallel.tp > 1; set parallel.tp or sp=false")
    if par.tp > 1:
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
    _check_expert_parallel(par, mc)
    if par.sp and tr.seq_len % par.tp:
        raise ConfigError(f"train.seq_len = {tr.seq_len} is not divisible by parallel.tp = "
                          f"{par.tp}, which sequence parallelism needs")
    _check_context(par, tr)
    if par.bucket_mb <= 0:
        raise ConfigError(f"parallel.bucket_mb = {par.bucket_mb} must be > 0")
    if par.buckets_in_flight < 1:
        raise ConfigError(f"parallel.buckets_in_flight = {par.buckets_in_flight} must be >= 1 "
                          f"(2 keeps one bucket filling while the one before it is reduced)")
    if par.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s = {par.timeout_s} must be > 0 seconds; the "
                          f"default is 300")

    _positive("train.steps", tr.steps)
    _positive("train.gbs", tr.gbs)
    _positive("train.seq_len", tr.seq_len)
    if tr.seq_len > mc.max_seq_len:
        raise ConfigError(f"train.seq_len = {tr.seq_len} exceeds model.max_seq_len = "
                          f"{mc.max_seq_len}; lower seq_len or raise max_seq_len")
    if tr.gbs % (par.mbs * par.dp):
        raise ConfigError(f"train.gbs = {tr.gbs} is not divisible by parallel.mbs × parallel.dp ="
                          f" {par.mbs * par.dp}; make gbs a multiple of it")
    num_micro = tr.gbs // (par.mbs * par.dp)
    _check_pipeline(par, mc.num_layers, num_micro)
    if tr.lr <= 0:
        raise ConfigError(f"train.lr = {tr.lr} must be > 0")
    if not 0 <= tr.seed < 2**32:  # numpy's and torch's generators take 32-bit unsigned seeds
        raise ConfigError(f"train.seed = {tr.seed} must lie in [0, 2**32); pick e.g. 1234")
    if tr.min_lr < 0 or tr.min_lr > tr.lr:
        raise ConfigError(f"train.min_lr = {tr.min_lr} must lie in [0, train.lr = {tr.lr}]")
    _positive("train.warmup_steps", tr.warmup_steps, allow_zero=True)
    _choice("train.lr_schedule", tr.lr_schedule, ("cosine", "linear", "wsd", "constant"))
    if not 0 <= tr.decay_fraction <= 1:
        raise ConfigError(f"train.decay_fraction = {tr.decay_fraction} must lie in [0, 1]")
    _choice("train.precision", tr.precision, ("auto", "fp32", "bf16", "fp16"))
    _choice("train.recompute", tr.recompute, ("none", "selective", "full"))
    _choice("train.device", tr.device, ("auto", "cpu", "cuda"))
    if not 0 <= tr.beta1 < 1 or not 0 <= tr.beta2 < 1:
        raise ConfigError("train.beta1 and train.beta2 must lie in [0, 1)")
    _positive("train.eps", tr.eps)
    _positive("train.grad_clip", tr.grad_clip, allow_zero=True)
    _positive("train.weight_decay", tr.weight_decay, allow_zero=True)
    _positive("train.eval_every", tr.eval_every, allow_zero=True)
    _positive("train.eval_batches", tr.eval_batches)
    _positive("train.max_bad_steps", tr.max_bad_steps)


# The most tokens an automatic micro-batch holds per rank: one 4096-token sequence, so that
# auto never keeps more activations than mbs = 1 did at sequence 4096 or longer (at 8192
# tokens an 8B model's micro-batch of 4 needs 133 GiB per GPU where 1 fits in 68).
AUTO_MBS_TOKENS = 4096


def resolve_mbs(cfg: Config) -> None:
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


def _validate_files(cfg: Config) -> None:
    """Inputs that must exist and outputs that must be writable."""
    d = cfg.data
    if d.path and Path(d.path).is_dir():
        raise ConfigError(f"data.path = '{d.path}' is a directory; give the token file "
                          f"`fivefold prepare -o FILE` wrote (e.g. {d.path}/tokens.bin)")
    if d.path and not Path(d.path).exists():
        raise ConfigError(f"data.path = '{d.path}' does not exist; run `fivefold prepare` to make "
                          f"a token file, or leave data.path empty for the bundled corpus")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction = {d.val_fraction} must lie in [0, 1)")
    if d.tokenizer not in CORPUS_TOKENIZERS and not Path(d.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer = '{d.tokenizer}' is none of "
                          f"{', '.join(CORPUS_TOKENIZERS)} nor a tokenizer.json file")
    ck = cfg.checkpoint
    writable_dir("checkpoint.dir", ck.dir)
    writable_dir("log.dir", cfg.log.dir)
    _positive("checkpoint.every", ck.every, allow_zero=True)
    _positive("checkpoint.keep", ck.keep)
    if ck.resume not in RESUME_MODES and not Path(ck.resume).is_dir():
        raise ConfigError(f"checkpoint.resume = '{ck.resume}' is not a checkpoint directory; "
                          f"use 'auto', 'never' or a step_* path under checkpoint.dir")
    _positive("log.every", cfg.log.every)


def _check_expert_parallel(par, mc) -> None:
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
