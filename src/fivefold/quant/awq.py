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
4. Optional clipping search (llm-awq's auto_clip, not applied to q and k), right after the
   group's scale (scale, then clip): per output row and group, shrink the range the grid
   spans by 0%, 5%, ..., 45% and keep the one with the smallest error of that group's
   partial products on 512 calibration tokens. As in llm-awq the clip is
   [-r·max|w|, r·max|w|]; `clip_mode="range"` shrinks both ends of an asymmetric grid's
   [min w, max w] instead (measured worse at int4: docs/quantization.md).
5. The next layer's input is this layer's float output (llm-awq computes it before scaling;
   the fold leaves it unchanged).

Optionally (`held_out` > 0) the choice of step 2 is made on calibration sequences held
apart from those α is searched on: α = 0, llm-awq's best and duo scaling's best compete,
each folded, clipped and rounded, by the decoder layer's output error (or the logits' KL)
on the held-out sequences. It measured worse than llm-awq's choice on the default model's
validation split (docs/awq-outliers.md), so it is not the default.

The model is then quantised with int4 RTN (quant/convert.py). With `rounding="gptq"` (the
default) each layer's linears are first rounded by GPTQ after their scales and clips
(quant/gptq.py; the AWQ paper's §5 composes the two), onto the grid that round to nearest
then reproduces, so the checkpoint stores GPTQ's rounding. With "rtn" (llm-awq's) AWQ only
changes the float weights that round to nearest rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fivefold.numerics.formats import INT4_LEVELS
from fivefold.numerics.intx import fake_quantize_int4
from fivefold.quant.awq_search import (  # noqa: F401  (re-exported: quant.awq's API)
    ALPHA_GRID,
    CLIP_GRID,
    CLIP_MAX_SHRINK,
    CLIP_MODES,
    CLIP_TOKENS,
    LOSSES,
    SCALE_FLOOR,
    Group,
    alpha_grid,
    apply_clip,
    fold_scale,
    layer_groups,
    layer_inputs,
    record_inputs,
    scale_for,
    search_clip,
    search_scale,
    weight_mean,
)
from fivefold.quant.gptq import gptq_round, hessian

SELECTS = ("layer", "logits")  # what the held-out choice measures
ROUNDINGS = ("rtn", "gptq")    # how the scaled, clipped weights are rounded (quant/gptq.py)
# GPTQ after the scales closed 67-102% of int4 RTN's validation gap on the default model at
# every injection site and uninjected, where rounding to nearest closed 30-93%
# (docs/awq-outliers.md, "AWQ at every injection site"), so it is the default.
ROUNDING = "gptq"
# Share of calibration sequences each group's choice of scale is measured on. 0 (llm-awq's
# choice on all of them) measured better on the default model's validation split than 0.5
# (docs/awq-outliers.md, "AWQ at every injection site"), so it is the default.
HELD_OUT = 0.0


@dataclass
class GroupResult:
    layer: int
    linears: list[str]
    alpha: float
    error_rtn: float     # output MSE at α = 0 (round to nearest), search tokens
    error_awq: float     # output MSE at the chosen α, search tokens
    choice: str = "plain"            # rtn, plain (s = mean|x|^α) or duo
    held_rtn: float | None = None    # decoder-layer output MSE on held-out tokens, α = 0
    held_awq: float | None = None    # the same at the choice (<= held_rtn)


@dataclass
class AWQReport:
    groups: list[GroupResult] = field(default_factory=list)
    clipped: list[str] = field(default_factory=list)
    gptq: list[str] = field(default_factory=list)   # linears rounded by GPTQ
    held_out: int = 0        # calibration sequences the choice was measured on

    def held_out_ratio(self) -> float | None:
        """Mean over groups of the held-out error at the choice over RTN's (<= 1)."""
        gain = [g.held_awq / g.held_rtn for g in self.groups if g.held_rtn]
        return sum(gain) / len(gain) if gain else None

    def error_ratio(self) -> float:
        """Mean over groups of the output error at the chosen scale over RTN's (<= 1)."""
        gain = [g.error_awq / g.error_rtn for g in self.groups if g.error_rtn > 0]
        return sum(gain) / max(len(gain), 1)

    def summary(self) -> str:
        mean = self.error_ratio()
        held = self.held_out_ratio()
        chosen = {c: sum(g.choice == c for g in self.groups) for c in ("rtn", "plain", "duo")}
        return (f"AWQ: {len(self.groups)} linear groups searched ({chosen['plain']} mean|x|^a, "
                f"{chosen['duo']} duo, {chosen['rtn']} unscaled), output error {mean:.3f}x "
                f"RTN's on the search data (mean)"
                + ("" if held is None else f", {held:.3f}x on {self.held_out} held-out "
                   f"sequences") + f", {len(self.clipped)} linears clipped"
                + (f", {len(self.gptq)} rounded by GPTQ" if self.gptq else ""))


def split_calibration(tokens: torch.Tensor, held_out: float
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(search sequences, held-out sequences): sequence i is held out when
    floor((i + 1)·f) > floor(i·f), so the held-out ones are spread evenly (f = 0.5: the odd
    ones). f = 0 holds none out (None)."""
    if not 0 <= held_out < 1:
        raise ValueError(f"held_out must be in [0, 1), not {held_out}")
    if held_out == 0:
        return tokens, None
    index = torch.arange(tokens.shape[0], dtype=torch.float64)
    mask = torch.floor((index + 1) * held_out) > torch.floor(index * held_out)
    if mask.all() or not mask.any():
        raise ValueError(f"{tokens.shape[0]} calibration sequences cannot be split {held_out:g} "
                         f"held out; give at least {math.ceil(1 / min(held_out, 1 - held_out))}")
    return tokens[~mask], tokens[mask]


@torch.no_grad()
def _quantized_error(layer: nn.Module, names: list[str], quantize,
                     error: Callable[[], float]) -> float:
    """error() with the named linears rounded (their weights restored after)."""
    linears = [layer.get_submodule(n) for n in names]
    originals = [lin.weight.detach().clone() for lin in linears]
    try:
        for lin, w in zip(linears, originals):
            lin.weight.copy_(quantize(w.float()).to(w.dtype))
        return error()
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.copy_(w)


@torch.no_grad()
def _logits_kl(model: nn.Module, index: int, h: torch.Tensor, final: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, chunk: int = 8) -> float:
    """Mean over tokens of KL(float model || model) of the next-token distributions, h being
    layer `index`'s output and `final` the float model's last hidden state (layers after
    `index` run in float; `chunk` sequences at a time bound the logits' memory)."""
    total = 0.0
    for start in range(0, h.shape[0], chunk):
        x = h[start:start + chunk]
        for later in model.layers[index + 1:]:
            x = later(x, cos, sin)
        logp = torch.log_softmax(model.logits(x).float(), -1)
        ref = torch.log_softmax(model.logits(final[start:start + chunk]).float(), -1)
        total += float((ref.exp() * (ref - logp)).sum())
    return total / (h.shape[0] * h.shape[1])


@torch.no_grad()
def _fold_and_clip(layer: nn.Module, group: Group, inputs: dict[str, torch.Tensor],
                   s: torch.Tensor, quantize, group_size: int, clip_mode: str | None
                   ) -> list[str]:
    """Fold s into the group (W[:, j] *= s_j, the producer's channel j /= s_j), then search
    and apply the clip of its linears on their inputs x / s (scale, then clip, as llm-awq's
    `run_awq` orders them; q and k are not clipped: llm-awq's auto_clip skips them, the q·k
    error being not what the partial products measure). Returns the clipped names."""
    linears = [layer.get_submodule(n) for n in group.linears]
    fold_scale(layer.get_submodule(group.prev), linears, s, group.producer_scale(s))
    if clip_mode is None:
        return []
    clipped = [n for n in group.linears if not n.endswith(("q_proj", "k_proj"))]
    for n in clipped:
        lin = layer.get_submodule(n)
        low, high = search_clip(inputs[n] / s.to(inputs[n].dtype), lin.weight, quantize,
                                group_size, mode=clip_mode)
        apply_clip(lin.weight, low, high, group_size)
    return clipped


@torch.no_grad()
def apply_awq(model: nn.Module, tokens: torch.Tensor, group_size: int = 128,
              symmetric: bool = False, clip: bool = True, n_grid: int = ALPHA_GRID,
              log: Callable[[str], None] | None = None, duo: bool | None = None,
              loss: str = "module", levels: int = INT4_LEVELS, clip_mode: str | None = None,
              held_out: float = HELD_OUT, select: str = "layer",
              rounding: str = ROUNDING) -> AWQReport:
    """Rescale (and clip) the float weights of every decoder layer of a fivefold Llama in
    place for int4 quantisation; `tokens` (n, seq) is the calibration batch.

    `held_out` (default 0, llm-awq's choice: the best α on all the sequences) > 0 is the
    share of calibration sequences kept apart from the search (`split_calibration`): each
    scale family's α is searched on the others, and the group's scale is chosen among
    α = 0 (RTN) and each family's best by an error on the held-out sequences (`select`:
    "layer", the decoder layer's output MSE, or "logits", the KL of the model's next-token
    distributions from the float model's), with the group's linears clipped and rounded and
    the layer's earlier groups as chosen. `duo`: None tries both llm-awq's s = mean|x|^α
    and AutoAWQ's duo scaling (see `scale_for`; only llm-awq's when held_out = 0), True or
    False one of them.
    `loss` is where the α search measures a group's error: "module" (llm-awq/AutoAWQ: the
    attention, the MLP, or the linear itself) or "layer" (the whole decoder layer's output,
    residuals included). `levels` < 15 searches with a grid of fewer bits (asymmetric;
    bench/quant/awq_bits.py). `clip_mode` (see `search_clip`) defaults to "absmax".
    `rounding` "gptq" (default) rounds each layer's linears by GPTQ after its scales and
    clips (quant/gptq.py, on the inputs the scaled linears see), leaving weights that round
    to nearest reproduces exactly; "rtn" (llm-awq's) leaves the rounding to `fivefold
    quantize`. The held-out choice compares its candidates rounded to nearest."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, not {rounding!r}")
    search_tokens, check_tokens = split_calibration(tokens, held_out)
    families = [False, True] if duo is None and check_tokens is not None else [bool(duo)]
    clip_mode = clip_mode or "absmax"

    def quantize(w: torch.Tensor) -> torch.Tensor:
        return fake_quantize_int4(w, group_size, symmetric, levels)

    if select not in SELECTS:
        raise ValueError(f"select must be one of {SELECTS}, not {select!r}")
    report = AWQReport(held_out=0 if check_tokens is None else int(check_tokens.shape[0]))
    hidden, cos, sin = layer_inputs(model, search_tokens)
    held = final = None
    if check_tokens is not None:
        held = layer_inputs(model, check_tokens)[0]
        if select == "logits":
            final = held
            for layer in model.layers:
                final = layer(final, cos, sin)

    def measure(index: int, out: torch.Tensor, reference: torch.Tensor) -> float:
        if select == "logits":
            return _logits_kl(model, index, out, final, cos, sin)
        return float((out - reference).float().pow(2).mean())
    for index, layer in enumerate(model.layers):
        groups = layer_groups(layer)
        names = [n for g in groups for n in g.linears]
        out, inputs = record_inputs(layer, names,
                                    lambda m=layer, h=hidden: m(h, cos, sin))
        reference = None if held is None else layer(held, cos, sin)
        done: list[str] = []        # this layer's linears already chosen (measured rounded)
        for group in groups:
            linears = [layer.get_submodule(n) for n in group.linears]
            prev = layer.get_submodule(group.prev)
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
            candidates = []
            for family in families:
                w_mean = group.tie(weight_mean(linears, group_size)) if family else None
                alpha, s, error_rtn, error = search_scale(x, linears, run, quantize, n_grid,
                                                          w_mean, group.tie)
                candidates.append(("duo" if family else "plain", alpha, s, error))
            choice, held_errors = candidates[0], None

            def commit(candidate, group=group, layer=layer, inputs=inputs):
                return _fold_and_clip(layer, group, inputs, candidate[2], quantize,
                                      group_size, clip_mode if clip else None)

            if reference is not None:
                candidates.insert(0, ("rtn", 0.0, torch.ones_like(candidates[0][2]), error_rtn))
                touched = [*linears, prev]
                held_errors = []
                for candidate in candidates:
                    saved = [(m.weight.clone(), None if getattr(m, "bias", None) is None
                              else m.bias.clone()) for m in touched]
                    commit(candidate)
                    held_errors.append(_quantized_error(
                        layer, done + group.linears, quantize,
                        lambda m=layer, h=held, r=reference, i=index:
                            measure(i, m(h, cos, sin), r)))
                    for m, (w, b) in zip(touched, saved):
                        m.weight.copy_(w)
                        if b is not None:
                            m.bias.copy_(b)
                choice = candidates[min(range(len(candidates)), key=held_errors.__getitem__)]
            clipped = commit(choice)
            report.clipped += [f"layers.{index}.{n}" for n in clipped]
            for n in group.linears:     # their inputs are now x / s
                inputs[n] = inputs[n] / choice[2].to(inputs[n].dtype)
            done += group.linears
            report.groups.append(GroupResult(
                index, group.linears, choice[1], error_rtn, choice[3], choice[0],
                None if held_errors is None else held_errors[0],
                None if held_errors is None else min(held_errors)))
        if rounding == "gptq":
            for n in names:
                lin = layer.get_submodule(n)
                lin.weight.copy_(gptq_round(lin.weight, hessian(inputs[n]), group_size,
                                            symmetric, levels))
            report.gptq += [f"layers.{index}.{n}" for n in names]
        if log is not None:
            log(f"AWQ layer {index}: " + ", ".join(
                f"{g.choice} {g.alpha:.2f}" for g in report.groups[-len(groups):]))
        hidden, held = out, reference
    return report
