"""Building a model on the meta device and initialising it from its parameter names.

Each logical tensor is drawn from a generator seeded by (seed, name), so the initial weights
never depend on how the model is later split: a tensor-parallel shard is a slice of the same
full tensor a single device would draw, and a pipeline stage draws only its own layers.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from fivefold.models.llama import Llama, Rotary, rope_inv_freq
from fivefold.models.presets import ModelConfig


def build_meta(cfg: ModelConfig) -> Llama:
    """The model's structure without storage: nothing is allocated until `materialize`."""
    with torch.device("meta"):
        return Llama(cfg)


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape, seed: int,
               experts: range | None = None) -> torch.Tensor:
    """The full fp32 initial value of the logical tensor `name` (a CPU tensor); for stacked
    expert weights, `experts` draws only those experts (a rank's block under ep).

    Norm weights are ones and biases zeros; matrices are N(0, init_std), with the output
    projections of each residual branch (o_proj, down_proj) scaled by 1/sqrt(2·layers) as in
    GPT-2 (Radford et al. 2019, section 2.3), so the residual stream's variance stays flat.
    """
    # A linear wrapped by an adapter (finetune/lora.py keeps it as `base_layer`) is drawn
    # as the unwrapped one, so the frozen base equals the plain model's weight.
    name = name.replace(".base_layer.", ".")
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w_down")):
        std /= math.sqrt(2 * cfg.num_layers)
    if ".experts.w_" in name:
        # Stacked experts [E, ...]: expert j is drawn from its own name, so a rank holding
        # experts a..b (expert parallelism) draws the same values a single device does.
        return torch.stack([_normal(shape[1:], std, name_seed(seed, f"{name}.{j}"))
                            for j in (experts or range(shape[0]))])
    return _normal(shape, std, name_seed(seed, name))


def _normal(shape, std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def logical_name(module_name: str) -> str:
    """Name of the tensor in the unsplit model (pipeline stages may rename their prefixes)."""
    return module_name


def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device="cpu",
                dtype: torch.dtype = torch.float32,
                names: dict[str, str] | None = None) -> nn.Module:
    """Allocate a meta-built model on `device` and fill every tensor from its logical name.

    `names` maps a local parameter name to its logical name where the two differ (a pipeline
    stage holding layers 4..7 as layers 0..3). Tensors whose parallel transformation left a
    `_shard_fn` attribute (tensor parallelism) are drawn in full and then sliced by it;
    stacked experts split by expert parallelism (`_ep_slice`) draw only this rank's experts.
    """
    shard_fns = {n: getattr(p, "_shard_fn", None) for n, p in model.named_parameters()}
    ep_slices = {n: getattr(p, "_ep_slice", None) for n, p in model.named_parameters()}
    full_shapes = {n: getattr(p, "_full_shape", p.shape) for n, p in model.named_parameters()}
    model.to(dtype=dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            logical = (names or {}).get(name, name)
            if ep_slices.get(name) is not None:
                _, start, stop = ep_slices[name]
                value = init_value(cfg, logical, full_shapes[name], seed, range(start, stop))
            else:
                value = init_value(cfg, logical, full_shapes[name], seed)
                if shard_fns.get(name) is not None:
                    value = shard_fns[name](value)
            param.copy_(value.to(dtype))
    for module in model.modules():
        if isinstance(module, Rotary):  # fp32 frequencies whatever the parameters' dtype
            module.inv_freq = rope_inv_freq(module.cfg).to(device)
        if hasattr(module, "reset_buffers"):  # MoE: expert bias and statistics start at zero
            module.reset_buffers()
    return model


def build_model(cfg: ModelConfig, seed: int, device="cpu", dtype=torch.float32) -> Llama:
    """A ready, initialised single-device model."""
    return materialize(build_meta(cfg), cfg, seed, device, dtype)
