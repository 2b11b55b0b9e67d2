"""Putting adapters into a model and taking them out again: a model transformation.

    apply_lora(model, rank=8, alpha=16, targets="q_proj,v_proj")   # wraps matching linears
    init_adapters(model, seed)          # A from a seed per logical name, B = 0 (any layout)
    merge_and_unload(model)             # back to plain linears holding W + scaling · B A

Target matching follows PEFT's rules for a list of names (LoraModel._check_target_module_exists):
a module matches a target `t` when its name is `t` or ends with `.t`; `all-linear` takes every
`nn.Linear` except the output head (PEFT's `_maybe_include_all_linear_layers`). Everything
that is not an adapter is frozen (PEFT's `bias = "none"`).

Applied to the plain model before any parallel transformation, so tensor and pipeline
parallelism see `LoraLinear` modules and the optimizer, data parallelism and checkpoints see
only the adapters (the parameters that require a gradient).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from fivefold.config import ConfigError
from fivefold.finetune.lora import LoraLinear, kaiming_uniform_bound
from fivefold.models.init import name_seed

ALL_LINEAR = "all-linear"
OUTPUT_HEADS = ("lm_head",)
ADAPTER_LEAVES = (".lora_A.weight", ".lora_B.weight")


def parse_targets(spec: str | Iterable[str]) -> list[str]:
    """'q_proj, v_proj' -> ['q_proj', 'v_proj']; 'all-linear' stays one entry."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return [t.strip() for t in items if t.strip()]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def target_modules(model: nn.Module, targets: str | Iterable[str]) -> list[str]:
    """Names of the `nn.Linear` modules that `targets` selects (adapters' own excluded)."""
    wanted = parse_targets(targets)
    linears = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and ".lora_" not in f".{n}"
               and not n.endswith(".base_layer")]
    if wanted == [ALL_LINEAR]:
        return [n for n in linears if n.rsplit(".", 1)[-1] not in OUTPUT_HEADS]
    return [n for n in linears if any(_matches(n, t) for t in wanted)]


def check_targets(model: nn.Module, targets: str | Iterable[str]) -> list[str]:
    """`target_modules`, refusing a target that matches nothing (one line naming it)."""
    wanted = parse_targets(targets)
    if not wanted:
        raise ConfigError("lora.targets is empty; name modules, e.g. "
                          "'q_proj,k_proj,v_proj,o_proj', or 'all-linear'")
    found = target_modules(model, wanted)
    if wanted != [ALL_LINEAR]:
        for t in wanted:
            if not any(_matches(n, t) for n in found):
                leaves = sorted({n.rsplit(".", 1)[-1] for n in target_modules(model,
                                                                             ALL_LINEAR)})
                raise ConfigError(f"lora.targets: '{t}' matches no linear module of this model;"
                                  f" its linears are {','.join(leaves)} (or use all-linear)")
    if not found:
        raise ConfigError("lora.targets = all-linear found no linear module in this model")
    return found


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: str | Iterable[str],
               dropout: float = 0.0, rslora: bool = False) -> list[str]:
    """Wrap every targeted linear in a `LoraLinear` and freeze all non-adapter weights.

    Works on a meta-built model (adapters are created on meta and drawn by `init_adapters`
    after materialising) or a real one (adapters get PEFT's initialisation at once).
    Returns the wrapped module names."""
    if rank <= 0:
        raise ConfigError(f"lora.rank = {rank} must be a positive integer, e.g. 8 or 16")
    names = check_targets(model, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, LoraLinear(getattr(owner, child), rank, alpha, dropout, rslora))
    return names


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_LEAVES)


def base_name(name: str) -> str:
    """A wrapped base's parameter under its unwrapped (logical, Hugging Face) name."""
    return name.replace(".base_layer.", ".")


def adapter_init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 initial value of adapter tensor `name`: A Kaiming-uniform from a generator
    seeded by (seed, name), B zero; the same on every layout (cf. models/init.py)."""
    if name.endswith(".lora_B.weight"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    bound = kaiming_uniform_bound(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def init_adapters(named_params: Iterable[tuple[str, nn.Parameter]], seed: int) -> None:
    """Draw every adapter tensor from its logical name; a tensor-parallel shard (`_shard_fn`)
    takes its slice of the full tensor."""
    with torch.no_grad():
        for name, p in named_params:
            if not is_adapter(name):
                continue
            full_shape = tuple(getattr(p, "_full_shape", p.shape))
            value = adapter_init_value(name, full_shape, seed)
            shard_fn = getattr(p, "_shard_fn", None)
            p.copy_((shard_fn(value) if shard_fn is not None else value).to(p.dtype))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> adapter tensor (detached, on its device)."""
    return {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) logical parameters; a packed quantised base counts its weights (a
    tensor-parallel shard's `_full_shape`: the whole tensor's, as a sharded parameter)."""
    trainable = total = 0
    for m in model.modules():
        for p in m.parameters(recurse=False):
            n = math.prod(getattr(p, "_full_shape", p.shape))
            total += n
            trainable += n if p.requires_grad else 0
        if hasattr(m, "quantized_bytes"):  # a quantised base (quant/linear.py): its weights
            total += math.prod(getattr(m, "_full_shape", (m.out_features, m.in_features)))
    return trainable, total


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace every `LoraLinear` by a plain `nn.Linear` holding W + scaling · B A (a quantised
    base is dequantised first). Returns the model, changed in place."""
    for name, module in list(lora_modules(model).items()):
        base = _as_linear(module.base_layer)
        weight = base.weight
        with torch.no_grad():
            weight.copy_((weight.float() + module.delta_weight().to(weight.device))
                         .to(weight.dtype))
        for p in base.parameters():
            p.requires_grad_(True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)
    return model


def unload(model: nn.Module) -> nn.Module:
    """Replace every `LoraLinear` by its base alone as a plain `nn.Linear` (a quantised base
    dequantised: the weights the adapters were trained on). Returns the model, changed in
    place."""
    for name, module in list(lora_modules(model).items()):
        base = _as_linear(module.base_layer)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)
    return model


def _as_linear(base: nn.Module) -> nn.Linear:
    if isinstance(base, nn.Linear):
        return base
    dequantize = getattr(base, "dequantize", None) or getattr(base, "to_float", None)
    if dequantize is None:
        raise TypeError(f"cannot merge into a {type(base).__name__}: it has no dequantize()")
    weight = dequantize()
    bias = getattr(base, "bias", None)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out
