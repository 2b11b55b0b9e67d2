"""PEFT adapter directories in and out: `adapter_config.json` + `adapter_model.safetensors`.

The format (PEFT 0.21, `PeftModel.save_pretrained` / `from_pretrained`):
- adapter_config.json: `peft_type` "LORA", `r`, `lora_alpha`, `lora_dropout`,
  `target_modules`, `use_rslora`, `bias` "none", `task_type` "CAUSAL_LM",
  `base_model_name_or_path`, `init_lora_weights`, ...
- adapter_model.safetensors: one tensor per adapter matrix, named by the module's path in
  PEFT's wrapper without the adapter name:
  `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (r × in) and
  `...lora_B.weight` (out × r).

fivefold's parameter names are Hugging Face's without the leading `model.` (models/hf.py), so
the key of our `layers.0.self_attn.q_proj.lora_A.weight` is `base_model.model.` + the HF name.
Writes are atomic (a temporary directory renamed into place); a non-empty target is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fivefold.config import ConfigError
from fivefold.finetune.inject import ALL_LINEAR, is_adapter, parse_targets
from fivefold.models.hf import hf_to_ours, ours_to_hf

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_key(name: str) -> str:
    """Our adapter name -> PEFT's saved key."""
    return PEFT_PREFIX + ours_to_hf(name)


def our_name(key: str) -> str:
    """PEFT's saved key -> our adapter name (PEFT's adapter name, if stored, is dropped)."""
    key = key.removeprefix(PEFT_PREFIX)
    for leaf in ("lora_A", "lora_B"):  # `...lora_A.default.weight` from old saves
        key = key.replace(f".{leaf}.default.", f".{leaf}.")
    return hf_to_ours(key)


def adapter_config(rank: int, alpha: float, targets, dropout: float = 0.0,
                   rslora: bool = False, base_model: str = "") -> dict:
    """The adapter_config.json PEFT writes for this LoRA (the fields its LoraConfig reads)."""
    wanted = parse_targets(targets)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "auto_mapping": None,
        "base_model_name_or_path": base_model or None, "revision": None,
        "inference_mode": True, "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": ALL_LINEAR if wanted == [ALL_LINEAR] else sorted(wanted),
        "use_rslora": rslora, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "use_dora": False, "lora_bias": False,
    }


def save_peft(directory: str | os.PathLike, adapters: dict[str, torch.Tensor],
              config: dict, overwrite: bool = False) -> Path:
    """Write a PEFT adapter directory from {our adapter name: full tensor}."""
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise ConfigError(f"{target} already exists and is not empty; choose a new directory "
                          f"or remove this one")
    tensors = {peft_key(n): t.detach().to("cpu").contiguous() for n, t in adapters.items()
               if is_adapter(n)}
    if not tensors:
        raise ConfigError("there are no LoRA adapters to export (was the run trained with "
                          "lora.rank > 0?)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(tmp, 0o755)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read_peft_config(directory: str | os.PathLike) -> dict:
    """adapter_config.json of a LoRA adapter directory, checked (one line otherwise)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"lora.init_from {directory}: no {CONFIG_FILE} there; give a PEFT "
                          f"adapter directory (PeftModel.save_pretrained writes one)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON ({e.msg}); re-save the adapter") from None
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ConfigError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA; "
                          f"fivefold loads LoRA adapters only")
    for key in ("use_dora", "lora_bias"):
        if config.get(key):
            raise ConfigError(f"{path}: {key} = true is not supported; train a plain LoRA")
    return config


def read_peft_tensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """{our adapter name: tensor} from adapter_model.safetensors."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(f"lora.init_from {directory}: no {WEIGHTS_FILE} there; fivefold "
                          f"reads safetensors adapters only")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {our_name(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except SafetensorError as e:
        raise ConfigError(f"{path} is damaged ({str(e).strip()}); re-save the adapter") from None


def check_adapter_fits(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple],
                       source: str) -> None:
    """Every stored tensor is an adapter this model has, with its shape; none is missing."""
    for name, t in tensors.items():
        if name not in shapes:
            raise ConfigError(f"{source}: adapter tensor '{peft_key(name)}' has no module in "
                              f"this model; the adapter was made for another architecture or "
                              f"other lora.targets")
        if tuple(t.shape) != tuple(shapes[name]):
            raise ConfigError(f"{source}: adapter tensor '{peft_key(name)}' has shape "
                              f"{tuple(t.shape)}, this model needs {tuple(shapes[name])}; the "
                              f"adapter was made for another architecture or rank")
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise ConfigError(f"{source}: no tensor '{peft_key(missing[0])}' in the adapter"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                          f"the adapter was made for other lora.targets")


def load_peft_into(named_params, directory: str | os.PathLike,
                   logical_shapes: dict[str, tuple] | None = None) -> None:
    """Copy a PEFT adapter into this rank's adapter parameters (logical names; a tensor-
    parallel shard takes its slice), after checking every name and shape against
    `logical_shapes` (the whole model's adapters; default: those of `named_params`, which
    is right unless the model is split into pipeline stages)."""
    tensors = read_peft_tensors(directory)
    params = [(n, p) for n, p in named_params if is_adapter(n)]
    shapes = logical_shapes or {n: tuple(getattr(p, "_full_shape", p.shape)) for n, p in params}
    check_adapter_fits(tensors, shapes, str(directory))
    with torch.no_grad():
        for name, p in params:
            value = tensors[name].float()
            shard_fn = getattr(p, "_shard_fn", None)
            p.copy_((shard_fn(value) if shard_fn is not None else value).to(p.dtype))
