"""Hugging Face checkpoints in and out: config.json plus safetensors, by renaming alone.

Our parameter names are HF `LlamaForCausalLM`'s without the `model.` prefix (`lm_head.weight`
keeps its name), so import is a rename and a strict check: every tensor the model needs must
be there with its logical shape, and nothing else may be. Loading goes through
`iter_hf_tensors` -> `load_hf_into`, one tensor at a time, so a tensor-parallel or pipeline
model can take just its slice of each tensor without ever holding the whole checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from fivefold.config import ConfigError
from fivefold.models.hf_config import (
    EXPERT_BIAS_ARCHS,
    hf_config_from_model,
    model_config_from_hf,
)
from fivefold.models.hf_moe import EXPERT_BIAS, stack_experts, unstack_experts
from fivefold.models.init import build_meta
from fivefold.models.llama import Llama, Rotary, rope_inv_freq
from fivefold.models.presets import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' long-standing default, "5GB"


def hf_to_ours(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def ours_to_hf(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def check_tensor(source, name: str, shape: tuple, logical_shapes: dict) -> None:
    """One line naming a stored tensor the model does not have, or one of the wrong shape."""
    if name not in logical_shapes:
        raise ConfigError(f"{source}: unexpected tensor '{ours_to_hf(name)}' for this "
                          f"model config; check config.json matches the weights")
    if shape != logical_shapes[name]:
        raise ConfigError(f"{source}: tensor '{ours_to_hf(name)}' has shape {shape}, "
                          f"config.json implies {logical_shapes[name]}; the weights do not "
                          f"fit the config")


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise ConfigError(f"{index} is not a safetensors index (no weight_map); "
                              f"re-download or re-export the checkpoint") from None
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
    elif (directory / SINGLE_FILE).is_file():
        files = [directory / SINGLE_FILE]
    else:
        raise ConfigError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; fivefold "
                          f"reads safetensors weights only (re-save with safe_serialization)")
    for f in files:
        if not f.is_file():
            raise ConfigError(f"shard {f} named in {INDEX_FILE} is missing; copy it there")
    return files


def iter_hf_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(our_name, tensor) for every stored weight, read lazily one tensor at a time.

    Dropped on the way: rotary `inv_freq` buffers (old transformers saved them; we recompute
    them) and `lm_head.weight` of a tied model (some exporters store the shared matrix twice).
    """
    directory = Path(directory)
    cfg = model_config_from_hf(directory / "config.json")
    stream = _renamed(directory, cfg.tie_embeddings)
    if cfg.num_experts:  # per-expert tensors -> one stack per layer and projection
        stream = stack_experts(stream, cfg.num_experts, str(directory))
    yield from stream


def _renamed(directory: Path, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                names = [n for n in f.keys()  # noqa: SIM118 - safe_open is not iterable
                         if not n.endswith("rotary_emb.inv_freq")
                         and not (tied and n == "lm_head.weight")]
                for hf_name in names:
                    yield hf_to_ours(hf_name), f.get_tensor(hf_name)
        except SafetensorError as e:  # a truncated or overwritten download
            raise ConfigError(f"{path} is damaged ({str(e).strip()}); re-download or "
                              f"re-export it") from None


def _reset_rotary(model: nn.Module, device) -> None:
    for module in model.modules():
        if isinstance(module, Rotary):  # fp32 frequencies, whatever the parameters' dtype
            module.inv_freq = rope_inv_freq(module.cfg).to(device)
        if hasattr(module, "reset_buffers"):  # MoE: a zero expert bias, empty statistics
            module.reset_buffers()


def load_hf_into(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 cfg: ModelConfig | None = None, names: dict[str, str] | None = None,
                 device="cpu", source: str = "checkpoint") -> nn.Module:
    """Copy (logical_name, full tensor) pairs into `model`, strictly.

    `model` may be on the meta device (it is then allocated on `device` in its own dtype), a
    pipeline stage (`names` maps a local parameter name to its logical one, as in
    `init.materialize`; tensors of other stages are skipped) or tensor-parallel (a parameter
    with a `_shard_fn` receives that function's slice of the full tensor). Every name is
    checked against the full logical model of `cfg`: an unknown name, a wrong shape, or a
    parameter left unfilled raises ConfigError naming the tensor.
    """
    cfg = cfg or model.cfg
    logical_shapes = {n: tuple(p.shape) for n, p in build_meta(cfg).named_parameters()}
    local = {(names or {}).get(n, n): (n, p) for n, p in model.named_parameters()}
    shard_fns = {n: getattr(p, "_shard_fn", None) for n, p in model.named_parameters()}
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        local = {(names or {}).get(n, n): (n, p) for n, p in model.named_parameters()}
    filled: set[str] = set()
    biases: dict[str, torch.Tensor] = {}  # the routers' expert biases: buffers, set last
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith(f".mlp.{EXPERT_BIAS}"):
                biases[name] = tensor
                continue
            check_tensor(source, name, tuple(tensor.shape), logical_shapes)
            if name in filled:
                raise ConfigError(f"{source}: tensor '{ours_to_hf(name)}' is stored twice; "
                                  f"fix the safetensors index")
            if name not in local:
                continue  # held by another pipeline stage
            local_name, param = local[name]
            if shard_fns.get(local_name) is not None:
                tensor = shard_fns[local_name](tensor)
            param.copy_(tensor.to(param.dtype))
            filled.add(name)
    missing = [n for n in local if n not in filled]
    if missing:
        raise ConfigError(f"{source}: missing tensor '{ours_to_hf(missing[0])}'"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''};"
                          f" the checkpoint is incomplete or for another model")
    _reset_rotary(model, next(model.parameters()).device)
    _load_expert_biases(model, biases, names or {}, source)
    return model


def _load_expert_biases(model: nn.Module, biases: dict[str, torch.Tensor],
                        names: dict[str, str], source: str) -> None:
    """Copy saved router biases (logical names) into the MoE layers' fp32 buffers, after
    `_reset_rotary` zeroed them; a layer that has none, or a bias of another size, is an
    error naming the tensor."""
    if not biases:
        return
    local = {}
    for n, b in model.named_buffers():
        if n.endswith(f".mlp.{EXPERT_BIAS}"):
            weight = n.removesuffix(EXPERT_BIAS) + "router.weight"
            local[names.get(weight, weight).removesuffix("router.weight") + EXPERT_BIAS] = b
    for name, tensor in biases.items():
        if name not in local:
            if not names:  # a whole model: no layer takes it
                raise ConfigError(f"{source}: unexpected tensor '{ours_to_hf(name)}' for this "
                                  f"model config; check config.json matches the weights")
            continue  # held by another pipeline stage
        if tuple(tensor.shape) != tuple(local[name].shape):
            raise ConfigError(f"{source}: tensor '{ours_to_hf(name)}' has shape "
                              f"{tuple(tensor.shape)}, config.json implies "
                              f"{tuple(local[name].shape)}; the weights do not fit the config")
        local[name].copy_(tensor.float())


def load_hf(directory: str | os.PathLike, dtype: torch.dtype = torch.float32,
            device="cpu") -> Llama:
    """A ready fivefold `Llama` from a Hugging Face checkpoint directory."""
    directory = Path(directory)
    cfg = model_config_from_hf(directory / "config.json")
    model = build_meta(cfg).to(dtype)
    return load_hf_into(model, iter_hf_tensors(directory), cfg, device=device,
                        source=str(directory))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict]:
    """Greedy split in model order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _expert_biases(model: nn.Module, cfg: ModelConfig, arch: str
                   ) -> list[tuple[str, torch.Tensor]]:
    """The routers' aux-loss-free biases to export: all of them for a family with a place
    for one (DeepSeek-V3's `e_score_correction_bias`), none for the others, where a bias that
    is not zero is a ConfigError (the export would route differently: issue 27)."""
    biases = [(n, b) for n, b in model.named_buffers() if n.endswith(f".mlp.{EXPERT_BIAS}")]
    if arch in EXPERT_BIAS_ARCHS:
        return biases
    used = next((n for n, b in biases if bool(b.ne(0).any())), None)
    if used is not None:
        raise ConfigError(f"model '{cfg.name}' routes with an expert bias (model."
                          f"expert_bias_rate = {cfg.expert_bias_rate}; {used} is not zero) and "
                          f"{arch} has no place for one, so the export would choose other "
                          f"experts; export a model trained with expert_bias_rate = 0, or with "
                          f"sigmoid scores, per-head qk_norm and ungated shared experts "
                          f"(dots.llm1, which keeps the bias)")
    return []


def save_hf(model: nn.Module, cfg: ModelConfig, directory: str | os.PathLike,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            generation_config: dict | None = None, extra_config: dict | None = None,
            extra_files: Iterable[str | os.PathLike] = (), overwrite: bool = False) -> Path:
    """Write `model` as a Hugging Face checkpoint that `AutoModelForCausalLM` loads.

    config.json, optional generation_config.json, the weights as `model.safetensors` or as
    shards with `model.safetensors.index.json` when they exceed `max_shard_bytes`, and any
    `extra_files` (tokenizer files) copied alongside. Everything is written to a temporary
    directory beside the target and renamed into place, so a crash never leaves half a
    checkpoint. An existing non-empty `directory` is refused unless `overwrite`.
    """
    target = Path(directory)
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"{target} already exists and is not empty; choose a new directory "
                          f"or remove this one")
    dtype = next(model.parameters()).dtype
    config = hf_config_from_model(cfg, _dtype_name(dtype))
    arch = config["architectures"][0]
    state = {}
    for n, p in model.named_parameters():
        for name, t in unstack_experts(n, p.detach(), arch):
            state[ours_to_hf(name)] = t.to("cpu").contiguous()
    for n, bias in _expert_biases(model, cfg, arch):  # fp32, as DeepSeek-V3 keeps it
        for name, t in unstack_experts(n, bias.detach().float(), arch):
            state[ours_to_hf(name)] = t.to("cpu").contiguous()
    config.update(extra_config or {})
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if generation_config is not None:
            (tmp / "generation_config.json").write_text(
                json.dumps(generation_config, indent=2) + "\n")
        shards = _shards(state, max_shard_bytes)
        metadata = {"format": "pt"}  # transformers checks this header field
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata=metadata)
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
