"""AWQ: activation-aware weight quantisation (Lin et al., MLSys 2024, arXiv 2306.00978).

A few input channels carry much larger activations than the rest, and the weights they
multiply matter most. AWQ protects them without mixed precision: scale input channel j of a
linear by s_j before rounding and divide its input by s_j (folded into the op that produces
the input), so the float function is unchanged and the salient weights use more of the
int4 grid. With s = s_X^α, s_X the per-channel mean |x| over calibration data, α is searched
on a grid over [0, 1] to minimise the output error of the quantised layers (§3.2, eq. 4-5).
No back-propagation, no reconstruction.

Done layer by layer on the float model, as llm-awq (mit-han-lab, `awq/quantize/
auto_scale.py`, `auto_clip.py`) does:

1. Run the decoder layer on its calibration input, recording every linear's input.
2. For each group of linears that share an input, search α ∈ {0, 1/n, ..., (n-1)/n} (n =
   n_grid = 20: 0, 0.05, ..., 0.95, llm-awq's `ratio = ratio * 1 / n_grid`) for the
   smallest mean squared error of the group's module output (the whole attention for
   q/k/v, the whole MLP for gate/up, the linear itself for o and down) with the linears
   fake-quantised; normalise s by sqrt(max·min) as llm-awq does. Plain RTN (s = 1) is
   measured as well and kept when no α beats it, so on the calibration data the chosen
   scale is never worse than RTN. Options: AutoAWQ's duo scaling (`scale_for`) and the
   error measured on the whole decoder layer (`apply_awq(loss="layer")`).
3. Fold: W[:, j] *= s_j, and the producer divides by s: the norm's weight (input_layernorm
   before q/k/v, post_attention_layernorm before gate/up), v_proj's output rows before o_proj
   (under grouped-query attention one scale per v channel, shared by the o_proj inputs of
   the query heads that read it; llm-awq skips this group there), up_proj's output rows
   before down_proj (SwiGLU multiplies up's
   output linearly; a GeLU MLP has no such fold and keeps down_proj unscaled).
4. Optional clipping search (llm-awq's auto_clip, not applied to q and k): per output row
   and group, shrink the range the grid spans by 0%, 5%, ..., 45% and keep the one with the
   smallest error of that group's partial products on 512 calibration tokens. As in
   llm-awq the clip is [-r·max|w|, r·max|w|]; `clip_mode="range"` shrinks both ends of an
   asymmetric grid's [min w, max w] instead (measured worse at int4: docs/quantization.md).
5. The next layer's input is this layer's float output (llm-awq computes it before scaling;
   the fold leaves it unchanged).

The model is then quantised with int4 RTN (quant/convert.py); AWQ only changed the float
weights it rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fivefold.numerics.formats import INT4_LEVELS
from fivefold.numerics.intx import fake_quantize_int4

ALPHA_GRID = 20
CLIP_GRID = 20           # llm-awq: n_grid 20, max_shrink 0.5 -> ratios 1.0, 0.95, ... 0.55
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512        # llm-awq's n_sample_token for the clip search
SCALE_FLOOR = 1e-4       # llm-awq clamps s_X^α at 1e-4
LOSSES = ("module", "layer")   # where a group's output error is measured
CLIP_MODES = ("range", "absmax")  # what the clip search shrinks (see search_clip)


@dataclass
class GroupResult:
    layer: int
    linears: list[str]
    alpha: float
    error_rtn: float     # output MSE at α = 0 (round to nearest)
    error_awq: float     # output MSE at the chosen α


@dataclass
class AWQReport:
    groups: list[GroupResult] = field(default_factory=list)
    clipped: list[str] = field(default_factory=list)

    def error_ratio(self) -> float:
        """Mean over groups of the output error at the chosen scale over RTN's (<= 1)."""
        gain = [g.error_awq / g.error_rtn for g in self.groups if g.error_rtn > 0]
        return sum(gain) / max(len(gain), 1)

    def summary(self) -> str:
        mean = self.error_ratio()
        return (f"AWQ: {len(self.groups)} linear groups scaled, output error {mean:.3f}x "
                f"RTN's on the calibration data (mean), {len(self.clipped)} linears clipped")


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


@torch.no_grad()
def apply_awq(model: nn.Module, tokens: torch.Tensor, group_size: int = 128,
              symmetric: bool = False, clip: bool = True, n_grid: int = ALPHA_GRID,
              log: Callable[[str], None] | None = None, duo: bool = False,
              loss: str = "module", levels: int = INT4_LEVELS, clip_mode: str | None = None
              ) -> AWQReport:
    """Rescale (and clip) the float weights of every decoder layer of a fivefold Llama in
    place for int4 quantisation; `tokens` (n, seq) is the calibration batch.

    `duo` uses AutoAWQ's duo scaling (see `scale_for`). `loss` is where a group's error is
    measured: "module" (llm-awq/AutoAWQ: the attention, the MLP, or the linear itself) or
    "layer" (the whole decoder layer's output, residuals included). `levels` < 15 searches
    with a grid of fewer bits (asymmetric; bench/quant/awq_bits.py). `clip_mode` (see
    `search_clip`) defaults to the range the grid spans: "absmax" for a symmetric grid,
    "range" for an asymmetric one."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
    if clip_mode is None:
        clip_mode = "absmax"

    def quantize(w: torch.Tensor) -> torch.Tensor:
        return fake_quantize_int4(w, group_size, symmetric, levels)

    report = AWQReport()
    hidden, cos, sin = layer_inputs(model, tokens)
    for index, layer in enumerate(model.layers):
        groups = layer_groups(layer)
        names = [n for g in groups for n in g.linears]
        out, inputs = record_inputs(layer, names,
                                    lambda m=layer, h=hidden: m(h, cos, sin))
        for group in groups:
            linears = [layer.get_submodule(n) for n in group.linears]
            inspect = layer.get_submodule(group.inspect)
            x = inputs[group.linears[0]]
            if loss == "layer":
                def run(m=layer, h=hidden):
                    return m(h, cos, sin)
            elif group.inspect == "self_attn":
                def run(m=inspect, h=x):
                    return m(h, cos, sin)
            else:
                def run(m=inspect, h=x):
                    return m(h)
            w_mean = group.tie(weight_mean(linears, group_size)) if duo else None
            alpha, s, error_rtn, error_awq = search_scale(x, linears, run, quantize, n_grid,
                                                          w_mean, group.tie)
            fold_scale(layer.get_submodule(group.prev), linears, s, group.producer_scale(s))
            # The recorded inputs of this group's linears are now x / s for the clip search.
            for n in group.linears:
                inputs[n] = inputs[n] / s.to(inputs[n].dtype)
            report.groups.append(GroupResult(index, group.linears, alpha, error_rtn,
                                             error_awq))
        if clip:
            for name in names:
                if name.endswith(("q_proj", "k_proj")):
                    continue     # llm-awq: q·k error is not what the partial products measure
                lin = layer.get_submodule(name)
                low, high = search_clip(inputs[name], lin.weight, quantize, group_size,
                                        mode=clip_mode)
                apply_clip(lin.weight, low, high, group_size)
                report.clipped.append(f"layers.{index}.{name}")
        if log is not None:
            alphas = ", ".join(f"{g.alpha:.2f}" for g in report.groups[-len(groups):])
            log(f"AWQ layer {index}: alpha {alphas}")
        hidden = out
    return report
