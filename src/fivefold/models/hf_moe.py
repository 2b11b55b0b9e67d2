"""Mixture-of-experts tensors between Hugging Face checkpoints and fivefold's stacked experts.

fivefold keeps one logical tensor per projection and layer, experts stacked on dim 0:
`layers.i.mlp.experts.w_gate [E, I, H]`, `w_up [E, I, H]`, `w_down [E, H, I]`, and the router
as `layers.i.mlp.router.weight [E, H]`. Checkpoints name them differently:

    Mixtral (as transformers 5 writes them): layers.i.block_sparse_moe.gate.weight,
        layers.i.block_sparse_moe.experts.j.{w1 (gate), w3 (up), w2 (down)}.weight
    Qwen2-MoE / Qwen3-MoE / OLMoE: layers.i.mlp.gate.weight,
        layers.i.mlp.experts.j.{gate_proj, up_proj, down_proj}.weight
    dots.llm1 (Dots1): as Qwen, with the shared experts as layers.i.mlp.shared_experts.* and
        the router's aux-loss-free bias as layers.i.mlp.gate.e_score_correction_bias (our
        buffer layers.i.mlp.router.expert_bias; DeepSeek-V3's name for it)
    transformers 5's in-memory fused layout, read too: layers.i.mlp.experts.gate_up_proj
        [E, 2I, H] (gate rows first, then up) and layers.i.mlp.experts.down_proj [E, H, I]

Import collects a layer's E per-expert tensors and emits the stack once all are there (a
layer's experts at a time, never the whole checkpoint); export writes per-expert keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from fivefold.config import ConfigError

_PER_EXPERT = re.compile(
    r"^layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_BIAS = re.compile(r"^layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
_SHARED_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.shared_experts\.(.*)$")
EXPERT_BIAS = "router.expert_bias"  # our buffer's name inside a MoE layer
_OURS = {"w1": "w_gate", "gate_proj": "w_gate", "w3": "w_up", "up_proj": "w_up",
         "w2": "w_down", "down_proj": "w_down"}
_MIXTRAL = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
_QWEN = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def stack_experts(tensors: Iterator[tuple[str, torch.Tensor]], num_experts: int,
                  source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename routers, stack per-expert tensors, split fused ones; pass the rest through."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        if m := _ROUTER.match(name):
            yield f"layers.{m.group(1)}.mlp.router.weight", tensor
        elif m := _BIAS.match(name):
            yield f"layers.{m.group(1)}.mlp.{EXPERT_BIAS}", tensor
        elif m := _SHARED_EXPERTS.match(name):
            yield f"layers.{m.group(1)}.mlp.shared_expert.{m.group(2)}", tensor
        elif m := _PER_EXPERT.match(name):
            layer, expert, proj = int(m.group(1)), int(m.group(2)), _OURS[m.group(3)]
            if expert >= num_experts:
                raise ConfigError(f"{source}: tensor of expert {expert} but config.json has "
                                  f"{num_experts} experts; the weights do not fit the config")
            key = f"layers.{layer}.mlp.experts.{proj}"
            slot = pending.setdefault(key, {})
            if expert in slot:
                raise ConfigError(f"{source}: expert {expert} of '{key}' is stored twice")
            slot[expert] = tensor
            if len(slot) == num_experts:
                yield key, torch.stack([slot[j] for j in range(num_experts)])
                del pending[key]
        elif m := _FUSED.match(name):
            base = f"layers.{m.group(1)}.mlp.experts"
            if m.group(2) == "down_proj":
                yield f"{base}.w_down", tensor
            else:
                gate, up = tensor.chunk(2, dim=1)
                yield f"{base}.w_gate", gate.contiguous()
                yield f"{base}.w_up", up.contiguous()
        else:
            yield name, tensor
    if pending:
        key, got = next(iter(pending.items()))
        missing = sorted(set(range(num_experts)) - set(got))
        raise ConfigError(f"{source}: '{key}' lacks experts {missing[:4]}; the checkpoint is "
                          f"incomplete")


def unstack_experts(name: str, tensor: torch.Tensor, arch: str
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our (name, tensor) -> the checkpoint's (name, tensor) pairs, without the `model.`."""
    mixtral = arch == "MixtralForCausalLM"
    block = "block_sparse_moe" if mixtral else "mlp"
    m = re.match(r"^layers\.(\d+)\.mlp\.(experts\.(w_gate|w_up|w_down)|router\.weight)$", name)
    if m is None and arch == "Dots1ForCausalLM" and ".mlp.shared_expert." in name:
        yield name.replace(".mlp.shared_expert.", ".mlp.shared_experts."), tensor
    elif m is None and name.endswith(f".mlp.{EXPERT_BIAS}"):  # only families with a place
        yield name.replace(f".mlp.{EXPERT_BIAS}", ".mlp.gate.e_score_correction_bias"), tensor
    elif m is None:
        yield name, tensor
    elif m.group(3) is None:
        yield f"layers.{m.group(1)}.{block}.gate.weight", tensor
    else:
        proj = (_MIXTRAL if mixtral else _QWEN)[m.group(3)]
        for j in range(tensor.shape[0]):
            yield f"layers.{m.group(1)}.{block}.experts.{j}.{proj}.weight", tensor[j]
