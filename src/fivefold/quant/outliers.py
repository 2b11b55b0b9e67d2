"""Salient input channels, injected: a synthetic stand-in for a pretrained LLM's outliers.

AWQ (arXiv 2306.00978, §3.1) rests on an observation about large pretrained models: a few
input channels of each linear carry activations far larger than the rest (LLM.int8(),
arXiv 2208.07339: magnitudes of 6 and more, in every layer from 6.7B parameters on), and
the weights they multiply matter most. Models trained here on the bundled corpus have only
mild ones (their largest channel is 1.2-7x the median after the norms; docs/quantization.md),
so AWQ has little to protect and closes a small share of round-to-nearest's gap.

`inject_outliers` gives a model such channels without changing its function. In every
decoder layer, for each norm that feeds linears (input_layernorm -> q/k/v,
post_attention_layernorm -> gate/up), a fraction of the hidden channels c is chosen and

    norm.weight[c] *= s        (and norm.bias[c], for LayerNorm)
    W[:, c]        /= s        for every linear the norm feeds.

The norm's output channel c grows by s, the weights reading it shrink by s, so every linear's
output is unchanged up to float rounding (the float model's perplexity moves by ~1e-8
relative), while its input now has a few channels s times larger than the rest, as a
pretrained model's does. Weight-only quantisation then rounds those shrunken columns onto
a grid set by the other columns of their group, so round-to-nearest loses them, and AWQ's
activation-aware scales (which look at mean |x| per channel) can find and restore them.

It is a stand-in, not a pretrained model: real outliers come from training, sit in the
same few channels across layers and show in the residual stream too; here they are placed
at random per layer, and only at the norms' outputs. bench/quant/awq_outliers.py measures AWQ
against round-to-nearest on models so injected.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# norm -> the linears it feeds, in a fivefold Llama decoder layer (quant/awq.py's groups)
FED_BY = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


@torch.no_grad()
def inject_outliers(model: nn.Module, scale: float, fraction: float = 0.01,
                    seed: int = 0) -> dict[str, list[int]]:
    """Make ceil(fraction · hidden) channels of every norm's output `scale` times larger and
    divide the matching input columns of the linears it feeds by `scale` (in place, function
    preserving). Channels are drawn per norm from `seed`. Returns {norm name: channels}."""
    if scale <= 0:
        raise ValueError(f"scale must be positive, not {scale}")
    generator = torch.Generator().manual_seed(seed)
    chosen: dict[str, list[int]] = {}
    for index, layer in enumerate(model.layers):
        for norm_name, linear_names in FED_BY.items():
            norm = layer.get_submodule(norm_name)
            linears = [m for m in (_find(layer, n) for n in linear_names)
                       if isinstance(m, nn.Linear)]
            if not linears:  # a mixture-of-experts MLP: no plain linears to divide
                continue
            hidden = norm.weight.shape[0]
            count = max(1, math.ceil(fraction * hidden))
            channels = torch.randperm(hidden, generator=generator)[:count].sort().values
            norm.weight[channels] *= scale
            if getattr(norm, "bias", None) is not None:
                norm.bias[channels] *= scale
            for linear in linears:
                linear.weight[:, channels] /= scale
            chosen[f"layers.{index}.{norm_name}"] = channels.tolist()
    return chosen


def _find(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None
