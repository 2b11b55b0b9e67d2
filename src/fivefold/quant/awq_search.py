"""AWQ's search primitives (quant/awq.py puts them together): the linear groups of a
decoder layer and their folds, the per-group scale search, the fold itself and llm-awq's
weight-clipping search. Sources are named where each is defined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

ALPHA_GRID = 20
CLIP_GRID = 20           # llm-awq: n_grid 20, max_shrink 0.5 -> ratios 1.0, 0.95, ... 0.55
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512        # llm-awq's n_sample_token for the clip search
SCALE_FLOOR = 1e-4       # llm-awq clamps s_X^α at 1e-4
LOSSES = ("module", "layer")   # where a group's output error is measured
CLIP_MODES = ("range", "absmax")  # what the clip search shrinks (see search_clip)


@dataclass
class Group:
    """Linears sharing an input, the op whose output feeds them, and the module whose output
    error is measured."""

    prev: str
    linears: list[str]
    inspect: str
    repeat: int = 1      # grouped-query attention: query heads reading one kv head
    head_dim: int = 0

    def tie(self, x_mean: torch.Tensor) -> torch.Tensor:
        """Under grouped-query attention, o_proj's input channel (head h, dim d) is v_proj's
        output channel (kv head h // repeat, d): one scale per v channel, the mean over the
        query heads that read it (of mean |x|, and of duo scaling's weight means)."""
        if self.repeat == 1:
            return x_mean
        heads = x_mean.reshape(-1, self.repeat, self.head_dim)
        return heads.mean(1, keepdim=True).expand_as(heads).reshape(-1)

    def producer_scale(self, s: torch.Tensor) -> torch.Tensor:
        """The scale of the producer's output channels (v_proj's under grouped-query
        attention, where o_proj's input repeats each of them `repeat` times)."""
        if self.repeat == 1:
            return s
        return s.reshape(-1, self.repeat, self.head_dim)[:, 0].reshape(-1)


def layer_groups(layer: nn.Module) -> list[Group]:
    """AWQ's four groups for a Llama decoder layer (fewer where a fold is not exact)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [Group("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj"], "self_attn")]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(Group("self_attn.v_proj", ["self_attn.o_proj"], "self_attn.o_proj"))
    elif attn.o_proj.in_features == getattr(attn, "num_heads", 0) * getattr(attn, "head_dim", 0):
        # Grouped-query attention: llm-awq and AutoAWQ skip v -> o when the shapes differ,
        # but the fold is exact with one scale per v channel, shared by the query heads that
        # read it (Group.tie); AWQ then closes 50-55% of int3 RTN's gap instead of 43-48% on
        # injected outliers (docs/quantization.md).
        repeat = attn.num_heads // attn.num_kv_heads
        groups.append(Group("self_attn.v_proj", ["self_attn.o_proj"], "self_attn.o_proj",
                            repeat, attn.head_dim))
    if not hasattr(mlp, "up_proj"):      # a mixture of experts: its experts stay float
        return groups
    if getattr(mlp, "swiglu", False):
        groups.append(Group("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"],
                            "mlp"))
        groups.append(Group("mlp.up_proj", ["mlp.down_proj"], "mlp.down_proj"))
    else:
        groups.append(Group("post_attention_layernorm", ["mlp.up_proj"], "mlp"))
    return groups


def record_inputs(layer: nn.Module, names: list[str], run: Callable[[], torch.Tensor]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the layer once, keeping the input of every named linear."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [layer.get_submodule(n).register_forward_hook(
        lambda _m, args, _out, n=n: seen.__setitem__(n, args[0].detach()))
        for n in names]
    try:
        out = run()
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def _output_error(reference: torch.Tensor, run: Callable[[], torch.Tensor]) -> float:
    return float((run() - reference).float().pow(2).mean())


@torch.no_grad()
def weight_mean(linears: list[nn.Linear], group_size: int) -> torch.Tensor:
    """Per input channel mean of |w| / max|w| of its quantisation group, over the output rows
    of all the group's linears (AutoAWQ `_search_best_scale`: the weights are concatenated,
    viewed as groups of `group_size`, normalised by each group's max, then averaged)."""
    weight = torch.cat([lin.weight.detach().float() for lin in linears], dim=0)
    groups = weight.abs().reshape(-1, group_size)
    groups = groups / (groups.amax(dim=1, keepdim=True) + 1e-6)
    return groups.reshape(weight.shape).mean(0)


def alpha_grid(n_grid: int) -> list[float]:
    """The exponents tried: i / n_grid for i < n_grid, as llm-awq (`auto_scale.py`,
    `_search_module_scale`) and AutoAWQ (`_search_best_scale`) iterate them; α = 1 itself is
    not tried."""
    return [i / n_grid for i in range(n_grid)]


def scale_for(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float
              ) -> torch.Tensor:
    """s = mean|x|^α (llm-awq), or with `w_mean` AutoAWQ's duo scaling
    s = mean|x|^α / (mean|w|^(1-α) + 1e-4) (AutoAWQ `_compute_best_scale`); both clamped
    at 1e-4 and normalised by sqrt(max·min)."""
    if w_mean is None:
        s = x_mean.pow(alpha).clamp(min=SCALE_FLOOR)
    else:
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=SCALE_FLOOR)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(x: torch.Tensor, linears: list[nn.Linear], run: Callable[[], torch.Tensor],
                 quantize: Callable[[torch.Tensor], torch.Tensor], n_grid: int = ALPHA_GRID,
                 w_mean: torch.Tensor | None = None,
                 tie: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> tuple[float, torch.Tensor, float, float]:
    """(α, s, error of plain RTN, error at α) for one group; weights are left as they were.
    With `w_mean` (duo scaling) α = 0 is not RTN, so RTN's error is measured on its own and
    kept as the choice (s = 1) when no α beats it."""
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    if tie is not None:
        x_mean = tie(x_mean)
    reference = run()
    originals = [lin.weight.detach().clone() for lin in linears]
    try:
        for lin, w in zip(linears, originals):
            lin.weight.copy_(quantize(w.float()).to(w.dtype))
        error_rtn = _output_error(reference, run)
        best = (error_rtn, 0.0, torch.ones_like(x_mean))
        for alpha in alpha_grid(n_grid):
            s = scale_for(x_mean, w_mean, alpha)
            for lin, w in zip(linears, originals):
                lin.weight.copy_((quantize(w.float() * s) / s).to(w.dtype))
            error = _output_error(reference, run)
            if error < best[0]:
                best = (error, alpha, s)
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.copy_(w)
    return best[1], best[2], error_rtn, best[0]


@torch.no_grad()
def fold_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor,
               s_prev: torch.Tensor | None = None) -> None:
    """W[:, j] *= s_j for each linear; the producer's output channel j /= s_j (s_prev where
    its channels are fewer: grouped-query attention's v_proj)."""
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.dtype))
    s = (s if s_prev is None else s_prev).to(prev.weight.dtype)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.unsqueeze(-1))
    else:                                   # RMSNorm / LayerNorm: a per-channel weight
        prev.weight.div_(s)
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(s)


@torch.no_grad()
def search_clip(x: torch.Tensor, weight: torch.Tensor,
                quantize: Callable[[torch.Tensor], torch.Tensor], group_size: int,
                n_grid: int = CLIP_GRID, max_shrink: float = CLIP_MAX_SHRINK,
                tokens: int = CLIP_TOKENS, mode: str = "range"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (output row, group), the clip range [low, high] that minimises the error of the
    group's partial products x_g · w_g over `tokens` calibration tokens (llm-awq
    auto_clip_layer), trying the shrink ratios r = 1, 0.95, ..., 0.55. The partial products
    of all rows are one batched matmul per group.

    mode "absmax" is llm-awq's: [-r·max|w|, r·max|w|], what a symmetric grid spans. "range"
    shrinks what an asymmetric grid spans, [min w, max w], to [r·min w, r·max w]: llm-awq's
    clip applied to an asymmetric grid shortens only the end that holds max|w| (a group in
    [-0.6, 1] shrinks by at most 28%, not 45%, and its zero point never moves). GPTQ's
    range search shrinks both ends alike (`Quantizer.find_params(mse=True)`: xmin·p, xmax·p;
    arXiv 2210.17323)."""
    if mode not in CLIP_MODES:
        raise ValueError(f"clip mode must be one of {CLIP_MODES}, not {mode!r}")
    x = x.reshape(-1, x.shape[-1]).float()
    x = x[torch.linspace(0, x.shape[0] - 1, min(tokens, x.shape[0])).long()]
    x = x.reshape(x.shape[0], -1, group_size).transpose(0, 1)       # groups, t, g
    w = weight.float().reshape(weight.shape[0], -1, group_size)      # out, groups, g
    reference = torch.bmm(x, w.permute(1, 2, 0))                     # groups, t, out
    if mode == "absmax":
        top = w.abs().amax(dim=-1, keepdim=True)                     # out, groups, 1
        bottom = -top
    else:
        top = w.amax(dim=-1, keepdim=True).clamp(min=0)
        bottom = w.amin(dim=-1, keepdim=True).clamp(max=0)
    best_error = torch.full(top.shape[:2], float("inf"))
    best_low, best_high = bottom.squeeze(-1).clone(), top.squeeze(-1).clone()
    for step in range(int(max_shrink * n_grid)):
        low, high = bottom * (1 - step / n_grid), top * (1 - step / n_grid)
        clipped = torch.maximum(torch.minimum(w, high), low)
        q = quantize(clipped.reshape(weight.shape)).reshape(w.shape)
        out = torch.bmm(x, q.permute(1, 2, 0))
        error = (out - reference).pow(2).mean(dim=1).transpose(0, 1)   # out, groups
        better = error < best_error
        best_error[better] = error[better]
        best_low[better] = low.squeeze(-1)[better]
        best_high[better] = high.squeeze(-1)[better]
    return best_low, best_high


@torch.no_grad()
def apply_clip(weight: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
               group_size: int) -> None:
    groups = weight.view(weight.shape[0], -1, group_size)
    low = low.to(weight.dtype).unsqueeze(-1)
    high = high.to(weight.dtype).unsqueeze(-1)
    groups.copy_(torch.maximum(torch.minimum(groups, high), low))


def layer_inputs(model: nn.Module, tokens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first decoder layer's input for `tokens`, and the rotary cos/sin."""
    hidden = model.embed_tokens(tokens)
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    cos, sin = model.rotary(positions, hidden.dtype)
    return hidden, cos, sin
