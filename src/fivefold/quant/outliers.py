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


SITES = ("norms", "v_o", "up_down")   # where a function-preserving fold exists


@torch.no_grad()
def inject_outliers(model: nn.Module, scale: float, fraction: float = 0.01,
                    seed: int = 0, site: str = "norms") -> dict[str, list[int]]:
    """Make ceil(fraction · width) channels of a producer's output `scale` times larger and
    divide the matching input columns of the linears it feeds by `scale` (in place, function
    preserving). Channels are drawn per producer from `seed`. Returns {producer: channels}.

    site "norms": input_layernorm -> q/k/v and post_attention_layernorm -> gate/up (the
    hidden channels). "v_o": v_proj's output rows -> o_proj's input columns (under
    grouped-query attention, the columns of every query head that reads the kv head).
    "up_down": up_proj's output rows -> down_proj's input columns (SwiGLU only: silu(gate)
    multiplies up's output, so a scale on it passes through; a GeLU MLP has no such fold)."""
    if scale <= 0:
        raise ValueError(f"scale must be positive, not {scale}")
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, not {site!r}")
    generator = torch.Generator().manual_seed(seed)
    chosen: dict[str, list[int]] = {}
    for index, layer in enumerate(model.layers):
        if site == "norms":
            for norm_name, linear_names in FED_BY.items():
                norm = layer.get_submodule(norm_name)
                linears = [m for m in (_find(layer, n) for n in linear_names)
                           if isinstance(m, nn.Linear)]
                if not linears:  # a mixture-of-experts MLP: no plain linears to divide
                    continue
                channels = _draw(norm.weight.shape[0], fraction, generator)
                _grow(norm, channels, scale)
                for linear in linears:
                    linear.weight[:, channels] /= scale
                chosen[f"layers.{index}.{norm_name}"] = channels.tolist()
        elif site == "v_o":
            attn = layer.self_attn
            channels = _draw(attn.v_proj.out_features, fraction, generator)
            _grow(attn.v_proj, channels, scale)
            attn.o_proj.weight[:, o_columns(attn, channels)] /= scale
            chosen[f"layers.{index}.self_attn.v_proj"] = channels.tolist()
        else:
            mlp = layer.mlp
            if not getattr(mlp, "swiglu", False) or not isinstance(
                    getattr(mlp, "up_proj", None), nn.Linear):
                raise ValueError("site up_down needs a SwiGLU MLP (gate * up feeding down)")
            channels = _draw(mlp.up_proj.out_features, fraction, generator)
            _grow(mlp.up_proj, channels, scale)
            mlp.down_proj.weight[:, channels] /= scale
            chosen[f"layers.{index}.mlp.up_proj"] = channels.tolist()
    return chosen


def o_columns(attn: nn.Module, channels: torch.Tensor) -> torch.Tensor:
    """o_proj's input columns fed by v_proj's output channels: under grouped-query attention
    query head h reads kv head h // repeat (quant/awq.py's Group.tie has the same layout)."""
    if attn.v_proj.out_features == attn.o_proj.in_features:
        return channels
    repeat, head_dim = attn.num_heads // attn.num_kv_heads, attn.head_dim
    kv, dim = channels // head_dim, channels % head_dim
    heads = kv.unsqueeze(1) * repeat + torch.arange(repeat)            # (channels, repeat)
    return (heads * head_dim + dim.unsqueeze(1)).reshape(-1)


def _draw(width: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    count = max(1, math.ceil(fraction * width))
    return torch.randperm(width, generator=generator)[:count].sort().values


def _grow(producer: nn.Module, channels: torch.Tensor, scale: float) -> None:
    """Output channels `channels` of a norm (its weight) or a linear (its rows) times scale."""
    producer.weight[channels] *= scale
    if getattr(producer, "bias", None) is not None:
        producer.bias[channels] *= scale


def _find(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None
