"""LoRA: a frozen linear plus a trainable low-rank update (Hu et al. 2021, arXiv 2106.09685).

    y = base_layer(x) + scaling · lora_B(lora_A(dropout(x)))      scaling = alpha / r
                                                                   (rsLoRA: alpha / sqrt(r),
                                                                    Kalajdzievski 2023)

`lora_A` is r×in, `lora_B` out×r, both bias-free `nn.Linear`s, named as PEFT names them so an
adapter's tensors keep PEFT's keys (`...q_proj.lora_A.weight`). Initialisation follows PEFT
(and the LoRA reference code): A Kaiming-uniform with a = √5 (nn.Linear's default), B zero,
so a fresh adapter leaves the model's output unchanged.

`base_layer` is whatever computes x Wᵀ + b: an `nn.Linear` (LoRA) or a frozen quantised
linear whose weight is stored in NF4 or int8 (QLoRA, Dettmers et al. 2023; fivefold.quant).
It is never trained: its parameters have requires_grad = False, so they get no gradient, no
optimizer state and no data-parallel reduction.

Merging folds the update into the base weight, W' = W + scaling · B A, for inference or
export; unmerging subtracts it again (exact up to rounding).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def kaiming_uniform_bound(fan_in: int, a: float = math.sqrt(5)) -> float:
    """The bound of `nn.init.kaiming_uniform_(w, a)` for a weight of `fan_in` inputs:
    gain · sqrt(3 / fan_in), gain = sqrt(2 / (1 + a²)) (He et al. 2015; torch.nn.init)."""
    gain = math.sqrt(2.0 / (1 + a * a))
    return gain * math.sqrt(3.0 / fan_in)


def lora_scaling(rank: int, alpha: float, rslora: bool = False) -> float:
    """alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA."""
    return alpha / (math.sqrt(rank) if rslora else rank)


class LoraLinear(nn.Module):
    """A frozen `base_layer` plus scaling · B A: see the module docstring."""

    def __init__(self, base_layer: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        self.base_layer = base_layer
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.rank, self.alpha, self.rslora = rank, alpha, rslora
        self.scaling = lora_scaling(rank, alpha, rslora)
        weight = _base_weight(base_layer)
        # Adapters live beside the base (on meta while the model is only a structure) and in
        # the compute dtype of a float base; a quantised base computes in its own dtype.
        kw = {"device": weight.device,
              "dtype": weight.dtype if weight.is_floating_point() else torch.float32}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        # Under tensor parallelism with a row-parallel base, the sum over ranks of A_i x_i
        # (finetune/tensor_parallel.py); None otherwise.
        self.reduce_rank_input = None
        for p in base_layer.parameters():
            p.requires_grad_(False)
        if not weight.is_meta:
            self.reset_lora_parameters()

    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's default: A ~ U(-bound, bound) as `kaiming_uniform_(a=√5)`, B = 0."""
        bound = kaiming_uniform_bound(self.in_features)
        with torch.no_grad():
            a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
            a.uniform_(-bound, bound, generator=generator)
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged:
            return result
        u = self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))
        if self.reduce_rank_input is not None:
            u = self.reduce_rank_input(u)
        update = self.lora_B(u)
        return result + (update * self.scaling).to(result.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scaling · B A (out × in), in fp32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def merge(self) -> None:
        """W += scaling · B A; the forward then skips the adapter path."""
        if self.merged:
            return
        weight = _mergeable_weight(self.base_layer)
        with torch.no_grad():
            weight.copy_((weight.float() + self.delta_weight()).to(weight.dtype))
        self.merged = True

    def unmerge(self) -> None:
        """W -= scaling · B A: undoes `merge` (up to rounding in low precision)."""
        if not self.merged:
            return
        weight = _mergeable_weight(self.base_layer)
        with torch.no_grad():
            weight.copy_((weight.float() - self.delta_weight()).to(weight.dtype))
        self.merged = False

    def shard_for_tensor_parallel(self, style: str, group, sp: bool) -> None:
        """Called by parallel/tensor.py once the base is sharded in `style`."""
        from fivefold.finetune.tensor_parallel import shard_adapter

        shard_adapter(self, style, group, sp)

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"
                f"{', rslora' if self.rslora else ''}")


def _base_weight(base_layer: nn.Module) -> torch.Tensor:
    """A tensor telling the base's device and dtype (a float weight, or packed data)."""
    weight = getattr(base_layer, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight
    for t in list(base_layer.parameters()) + list(base_layer.buffers()):
        return t
    raise TypeError(f"{type(base_layer).__name__} holds no tensor to place an adapter beside")


def _mergeable_weight(base_layer: nn.Module) -> torch.Tensor:
    weight = getattr(base_layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"cannot merge into a {type(base_layer).__name__}: dequantise the base "
                        f"first (finetune.inject.merge_and_unload does)")
    return weight
