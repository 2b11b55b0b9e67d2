"""LoRA in the training engine: what the trainer, `generate` and `convert` call.

Order in a run (train/trainer.py):

    build_meta -> add_adapters (LoraLinear on meta) -> parallelize (TP, PP split,
    materialise) -> load the base (model.hf_path; base names without `.base_layer`)
    -> finish_adapters: A/B from their names or lora.init_from; a quantised base (nf4, int8)
    replaces each frozen linear -> optimizer over the trainable parameters only

Only adapters require a gradient, so the optimizer, the DP/ZeRO buffers and the checkpoint
(`Trainer.checkpoint_parts`, through the optimizer's shards) hold adapters alone; the
checkpoint's meta.json keeps the config, whose `model.hf_path` (or preset and seed) is the
reference to the base. `load_for_inference` rebuilds base + adapters from that.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from fivefold.config import ConfigError
from fivefold.finetune.inject import (
    apply_lora,
    base_name,
    init_adapters,
    is_adapter,
    lora_modules,
    parameter_counts,
)
from fivefold.finetune.io import load_peft_into
from fivefold.finetune.lora import LoraLinear
from fivefold.finetune.tensor_parallel import quantize_parallel_base


def lora_enabled(cfg) -> bool:
    lo = getattr(cfg, "lora", None)
    return lo is not None and lo.rank > 0


def add_adapters(model: nn.Module, lora) -> list[str]:
    """Wrap the targeted linears of a (meta-built) plain model; freeze everything else."""
    return apply_lora(model, lora.rank, lora.alpha, lora.targets, lora.dropout, lora.rslora)


def base_tensors(named_params) -> list[tuple[str, nn.Parameter]]:
    """The frozen base's parameters under their logical (Hugging Face) names."""
    return [(base_name(n), p) for n, p in named_params if not is_adapter(n)]


def logical_adapter_shapes(model_cfg, lora) -> dict[str, tuple]:
    """Every adapter tensor of the whole model (all pipeline stages) and its full shape."""
    from fivefold.models.init import build_meta

    model = build_meta(model_cfg)
    add_adapters(model, lora)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter(n)}


def finish_adapters(chunks: list[nn.Module], named_params, cfg, model_cfg) -> None:
    """Adapter values (from their names, or lora.init_from), then the quantised base."""
    lo = cfg.lora
    init_adapters(named_params, cfg.train.seed)
    if lo.init_from:
        load_peft_into(named_params, lo.init_from, logical_adapter_shapes(model_cfg, lo))
    if lo.base != "none":
        for chunk in chunks:
            quantize_bases(chunk, lo.base)


def quantize_bases(model: nn.Module, kind: str) -> int:
    """Replace the frozen `nn.Linear` base of every `LoraLinear` by its NF4 or int8 copy
    (fivefold.quant.linear), or under tensor parallelism the base's local weight shard
    (finetune/tensor_parallel.py); the float weight is dropped. Returns how many were replaced."""
    from fivefold.quant.linear import Int8Linear, NF4Linear

    cls = {"nf4": NF4Linear, "int8": Int8Linear}[kind]
    count = 0
    for name, module in lora_modules(model).items():
        base = module.base_layer
        if isinstance(base, nn.Linear):
            module.base_layer = cls.from_float(base)
            count += 1
        elif isinstance(getattr(base, "weight", None), nn.Parameter) and hasattr(
                base, "linear_fn"):  # a tensor-parallel shard: quantised where it lies
            quantize_parallel_base(base, kind, name)
            count += 1
    return count


def frozen_state(chunks: list[nn.Module]) -> list[torch.Tensor]:
    """The frozen base: parameters without a gradient and a quantised base's buffers."""
    out = [p for c in chunks for p in c.parameters() if not p.requires_grad]
    for chunk in chunks:
        for module in lora_modules(chunk).values():
            out.extend(module.base_layer.buffers())
    return out


def describe(chunks: list[nn.Module], lora, dims=None) -> str:
    """One line for the start of a run: adapters, and trainable / total parameters (this
    rank's share under tensor or pipeline parallelism)."""
    trainable = total = modules = 0
    for chunk in chunks:
        t, n = parameter_counts(chunk)
        trainable, total = trainable + t, total + n
        modules += len(lora_modules(chunk))
    share = "" if dims is None or dims.world_size == 1 else " on this rank"
    scaling = f"alpha/sqrt(r) = {lora.alpha / lora.rank ** 0.5:g}" if lora.rslora else \
        f"alpha/r = {lora.alpha / lora.rank:g}"
    return (f"LoRA rank {lora.rank} ({scaling}) on {modules} linears, base {lora.base}: "
            f"{trainable:,} trainable of {total:,} parameters{share} "
            f"({100 * trainable / max(total, 1):.2f}%)")


def check_resume(meta: dict, cfg, path) -> None:
    """A checkpoint's adapters must be the ones this run trains."""
    saved = (meta.get("config") or {}).get("lora") or {}
    mine = cfg.lora if lora_enabled(cfg) else None
    saved_rank = int(saved.get("rank", 0) or 0)
    if (mine.rank if mine else 0) != saved_rank:
        raise ConfigError(f"checkpoint {path} was saved with lora.rank = {saved_rank}, this "
                          f"run has lora.rank = {mine.rank if mine else 0}; use the same "
                          f"lora settings or a different checkpoint.dir")
    saved_base = ((meta.get("config") or {}).get("model") or {}).get("init_from") or ""
    if mine and saved_base != cfg.model.init_from:  # a frozen base must stay the same
        raise ConfigError(f"checkpoint {path} trained adapters on model.init_from = "
                          f"'{saved_base}', this run starts from '{cfg.model.init_from}'; "
                          f"use the same model.init_from, or a different checkpoint.dir")
    if mine and saved.get("targets") != mine.targets:
        raise ConfigError(f"checkpoint {path} was saved with lora.targets = "
                          f"'{saved.get('targets')}', this run has '{mine.targets}'; use the "
                          f"same lora settings or a different checkpoint.dir")


# --- inference: base + adapters from a checkpoint ---------------------------------------
def load_for_inference(path: str):
    """(model, model_cfg, tokenizer_spec, lora settings or None) from a checkpoint directory,
    on CPU: a LoRA checkpoint gives its base (from the reference in meta.json) with the
    adapters loaded (LoraLinear modules; an NF4/int8 base stays quantised); any other goes
    to `train.checkpoint.load_model_for_inference`, which checks it."""
    from fivefold.train.checkpoint import inference_step, load_model_for_inference

    lora = _lora_settings(_step_dir(Path(path)))
    if lora is None:
        return (*load_model_for_inference(str(path)), None)
    p, meta, model_cfg = inference_step(path)  # the manifest, the model keys: one line each
    return (*_load_lora(p, meta, model_cfg, lora), lora)


def _step_dir(p: Path) -> Path:
    """A checkpoint root's `latest` step, or the step directory itself."""
    if (p / "latest").is_file() and (p / (p / "latest").read_text().strip()).is_dir():
        return p / (p / "latest").read_text().strip()
    return p


def _lora_settings(step: Path) -> dict | None:
    """The [lora] section a step was saved with, if it trained adapters (a glance at
    meta.json; the loaders check the step in full)."""
    try:
        meta = json.loads((step / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    lora = ((meta.get("config") or {}).get("lora") or {}) if isinstance(meta, dict) else {}
    return lora if int(lora.get("rank", 0) or 0) else None


def _load_lora(p: Path, meta: dict, model_cfg, lora: dict):
    from types import SimpleNamespace

    from fivefold.models.init import build_meta, materialize
    from fivefold.train.checkpoint import Chunked, load

    config = meta.get("config") or {}
    hf_path = (config.get("model") or {}).get("hf_path") or ""
    init_from = (config.get("model") or {}).get("init_from") or ""
    seed = (config.get("train") or {}).get("seed")
    settings = SimpleNamespace(**lora)
    if init_from and not (Path(init_from) / "meta.json").is_file():
        raise ConfigError(f"--checkpoint {p}: its base model.init_from = '{init_from}' is not "
                          f"there any more; put the base checkpoint back at that path")
    if settings.base != "none" and not (hf_path or init_from):
        raise ConfigError(f"--checkpoint {p}: a lora.base = {settings.base} checkpoint must "
                          f"name its base (model.hf_path) in meta.json, and this one names "
                          f"none; it cannot be rebuilt")
    if not hf_path and seed is None:
        raise ConfigError(f"--checkpoint {p}: meta.json names no base model (model.hf_path "
                          f"or train.seed); it cannot be rebuilt")
    if hf_path and not (Path(hf_path) / "config.json").is_file():
        raise ConfigError(f"--checkpoint {p}: its base model.hf_path = '{hf_path}' is not "
                          f"there any more; put the base model back at that path")
    model = build_meta(model_cfg)
    add_adapters(model, settings)
    materialize(model, model_cfg, int(seed or 0))
    if hf_path:
        from fivefold.models.hf_slices import load_hf_slices

        load_hf_slices(hf_path, base_tensors(model.named_parameters()), model_cfg)
    elif init_from:  # the fivefold checkpoint the run started from (merged, if LoRA)
        from fivefold.finetune.inject import merge_and_unload

        source, _, _, source_lora = load_for_inference(init_from)
        full = dict((merge_and_unload(source) if source_lora else source).named_parameters())
        with torch.no_grad():
            for name, param in base_tensors(model.named_parameters()):
                param.copy_(full[name])
    tensors = {f"model/{n}": Chunked(tuple(t.shape), [((0,) * t.dim(), t.detach())])
               for n, t in model.named_parameters() if is_adapter(n)}
    with torch.no_grad():
        load(p, tensors, {}, fix="--checkpoint")
    if settings.base != "none":
        quantize_bases(model, settings.base)
    return model.eval(), model_cfg, meta.get("tokenizer", "byte")


def lora_settings_of(checkpoint_dir: str) -> dict:
    """The [lora] section of a LoRA checkpoint; one line for any other checkpoint."""
    from fivefold.train.checkpoint import read_meta

    p = _step_dir(Path(checkpoint_dir))
    read_meta(p, fix="--checkpoint")
    lora = _lora_settings(p)
    if lora is None:
        raise ConfigError(f"--checkpoint {checkpoint_dir} is not a LoRA run (lora.rank = 0): "
                          f"there are no adapters; drop --peft to export the whole model")
    return lora


def export_peft(checkpoint_dir: str, outdir: str, base_model: str) -> Path:
    """`fivefold convert --checkpoint C --out DIR --peft`: the adapters of a LoRA checkpoint
    as a PEFT directory whose base_model_name_or_path is `base_model`, a Hugging Face
    directory (models/convert.py chooses it: PEFT's AutoPeftModel loads the base from it)."""
    from fivefold.finetune.io import adapter_config, save_peft

    lora = lora_settings_of(checkpoint_dir)
    model, _, _, _ = load_for_inference(str(_step_dir(Path(checkpoint_dir))))
    config = adapter_config(lora["rank"], lora["alpha"], lora["targets"], lora["dropout"],
                            lora["rslora"], base_model=base_model)
    return save_peft(outdir, adapters_of(model), config)


def adapters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}


__all__ = ["LoraLinear", "add_adapters", "adapters_of", "base_tensors", "check_resume",
           "describe", "export_peft", "finish_adapters", "frozen_state", "load_for_inference",
           "lora_enabled", "lora_settings_of", "quantize_bases"]
