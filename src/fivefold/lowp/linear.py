"""The FP8 linear layer: y = x Wᵀ + b with all three GEMMs in FP8 and fp32 accumulation.

    forward   y      = x · Wᵀ        x in E4M3, W in E4M3
    dgrad     ∂x     = ∂y · W        ∂y in the gradient format, W in E4M3
    wgrad     ∂W     = ∂yᵀ · x       ∂y in the gradient format, x in E4M3

Each GEMM is `numerics.fp8.fp8_mm(a, b)` = a · bᵀ with both operands quantised along the
reduction dimension K; so each operand is quantised for each GEMM along that GEMM's K:

    recipe       activations, ∂y           weights         gradient format   scales
    tensorwise   one scale per tensor      per tensor      E5M2 (torchao)    float32
    rowwise      per row along K           per row along K E4M3 (torchao)    powers of 2
    blockwise    1x128 tiles along K       128x128 blocks  E4M3 (DeepSeek)   float32

(torchao float8 `Float8LinearRecipeName.TENSORWISE/ROWWISE`; DeepSeek-V3, arXiv 2412.19437
§3.3, figure 7: tiles of 1x128 for the forward's activations and ∂y's dgrad, 128x1 — that
is 1x128 along the token dimension — for the wgrad operands.)

Memory: the input is saved for backward in FP8 (1 byte per element and its scales) rather
than in the compute dtype, as DeepSeek-V3 caches it. The wgrad needs x quantised along the
tokens instead of along K:
  - tensorwise reuses the forward's FP8 tensor as it is (its transpose has the same scale);
  - rowwise quantises the original input a second time in the forward, along the tokens
    (one scale per channel), and saves that copy instead of the forward's: the same bytes,
    and the wgrad operand torchao's Float8Linear builds from its saved high-precision
    input, so all three gradients are bit-equal to torchao's. (Re-quantising the
    dequantised forward copy, as this did before, loses the channels' small values that
    fell into e4m3's subnormals under their row's scale: with channels over six decades
    46% of the weight-gradient elements differed from torchao's; tests/test_fp8_linear.py.)
  - blockwise dequantises the saved 1x128-tile copy and quantises its transpose again
    (DeepSeek-V3 §3.3.4 names this re-quantisation as the cost of today's hardware).
The weight is a parameter, held anyway; it is quantised again in backward rather than
saved a second time (nor are its multipliers: that would be new saved bytes per micro-batch,
beside the planner's count in plan/fp8.py, to save one amax pass over the weight).

Passes over the operands (lowp/quantize.py quantises in three: amax, scale, cast, each byte
equal to numerics.fp8.quantize's): tensorwise casts ∂y once, and its wgrad operand ∂yᵀ is
that FP8 tensor transposed (one scale for both, as for x); the blockwise re-quantisation
dequantises without a full-size scale tensor. That is the CPU's path; on a GPU (and in a
trace of one) each operand is cast by one or two fused kernels instead, which also write
the transposed copy the backward needs (lowp/fused.py, numerics/fp8_cast.py), byte for byte
the same FP8 tensors.

Kernels: tensorwise and rowwise call `torch._scaled_mm` (cuBLASLt on CUDA, torch's CPU
kernel on CPU) through a custom op that torch.compile keeps as it is (numerics/fp8_ops.py).
Blockwise takes `FP8Recipe.kernel`: "scaled_mm" (cuBLASLt's blockwise mode,
numerics/fp8_kernel.py: CUDA, compute capability 9.x, weights in whole 128-blocks) or
"emulated" (128-wide K slices in fp32, any device; the reference). lowp/convert.py picks it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.lowp import delayed, fused
from fivefold.lowp.quantize import dequantize, quantize
from fivefold.numerics.formats import E4M3, FP8_BLOCK, FP8_FORMATS, FloatFormat
from fivefold.numerics.fp8 import FP8Tensor, fp8_mm
from fivefold.numerics.kernel_support import compiling

RECIPES = ("blockwise", "rowwise", "rowwise_gw_hp", "tensorwise")
_GRANULARITY = {  # recipe -> (activations and gradients, weights)
    "tensorwise": ("tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise"),
    "rowwise_gw_hp": ("rowwise", "rowwise"),
    "blockwise": ("tiles", "blocks"),
}
_DEFAULT_GRAD_FORMAT = {"tensorwise": "e5m2", "rowwise": "e4m3", "rowwise_gw_hp": "e4m3",
                        "blockwise": "e4m3"}


@dataclass(frozen=True)
class FP8Recipe:
    """How the three GEMMs of a linear layer are scaled and in which formats."""

    name: str = "blockwise"
    grad_format: FloatFormat = E4M3
    pow2: bool = False
    block: int = FP8_BLOCK
    kernel: str = "emulated"  # blockwise only: "emulated" or "scaled_mm" (numerics/fp8.py)
    scaling: str = "dynamic"  # tensorwise only: "delayed" scales from an amax history
    history_len: int = delayed.DEFAULT_HISTORY_LEN  # (lowp/delayed.py)

    @staticmethod
    def from_name(name: str, grad_format: str = "auto", scaling: str = "dynamic",
                  history_len: int = delayed.DEFAULT_HISTORY_LEN) -> FP8Recipe:
        """The recipe's defaults; `grad_format` 'auto' takes the recipe's own (see above)."""
        if name not in RECIPES:
            raise ValueError(f"unknown FP8 recipe '{name}'; one of {', '.join(RECIPES)}")
        fmt = _DEFAULT_GRAD_FORMAT[name] if grad_format == "auto" else grad_format
        if fmt not in FP8_FORMATS:
            raise ValueError(f"unknown FP8 gradient format '{grad_format}'; e4m3 or e5m2")
        if scaling not in delayed.SCALINGS or (scaling == "delayed" and name != "tensorwise"):
            raise ValueError(f"FP8 scaling '{scaling}' with recipe '{name}': delayed scaling "
                             f"is for the tensorwise recipe; dynamic for every recipe")
        if history_len < 1:
            raise ValueError(f"an amax history of {history_len} steps; at least 1")
        return FP8Recipe(name, FP8_FORMATS[fmt], pow2=name.startswith("rowwise"),
                         scaling=scaling, history_len=history_len)

    @property
    def hp_wgrad(self) -> bool:
        """rowwise_gw_hp: the weight gradient in high precision, from the saved input."""
        return self.name == "rowwise_gw_hp"

    @property
    def act_granularity(self) -> str:
        return _GRANULARITY[self.name][0]

    @property
    def weight_granularity(self) -> str:
        return _GRANULARITY[self.name][1]

    def quantize_act(self, x: torch.Tensor, fmt: FloatFormat = E4M3) -> FP8Tensor:
        return quantize(x, fmt, self.act_granularity, self.pow2, self.block)

    def quantize_weight(self, w: torch.Tensor) -> FP8Tensor:
        return quantize(w, E4M3, self.weight_granularity, self.pow2, self.block)


class FP8LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b; saves the FP8 input (data and scales), not the high-precision one."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: FP8Recipe, wq: FP8Tensor | None = None,
                state: delayed.DelayedState | None = None):
        # wq: the weight already quantised (ZeRO-3's FP8 all-gather, tensorwise);
        # state: the module's amax histories (delayed scaling, lowp/delayed.py)
        xq, saved = _quantized_input(x, recipe, state)
        if wq is None:
            wq = (delayed.weight(weight, state) if state is not None else
                  fused.weight(weight, recipe) if fused.fused(weight) else
                  recipe.quantize_weight(weight))
            ctx.wq = None
        else:
            ctx.wq = wq  # its data is a view of ZeRO-3's gathered bytes, gathered again
            if state is not None:  # delayed: this rank's piece's amax, W's record
                delayed.record_gathered(state, wq)
        y = fp8_mm(xq, wq, out_dtype=x.dtype, kernel=recipe.kernel)
        if bias is not None:
            y = y + bias
        if recipe.hp_wgrad:  # the input as it came: the weight gradient's operand
            ctx.save_for_backward(x, x.new_empty(0), weight)
        else:
            ctx.save_for_backward(saved.data, saved.scale, weight)
        ctx.recipe, ctx.has_bias, ctx.x_shape = recipe, bias is not None, x.shape
        ctx.state = state
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_data, x_scale, weight = ctx.saved_tensors
        recipe: FP8Recipe = ctx.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.state is not None or recipe.hp_wgrad:
            return _backward(ctx, g2, x_data, x_scale, weight, grad)
        if fused.fused(g2):
            return _fused_backward(ctx, g2, x_data, x_scale, weight, grad)
        gq = None
        if ctx.needs_input_grad[0]:
            gq = recipe.quantize_act(g2, recipe.grad_format)
            wt = (recipe.quantize_weight(weight.t()) if ctx.wq is None  # along N, dgrad's K
                  else ctx.wq.t())
            grad_x = fp8_mm(gq, wt, out_dtype=grad.dtype,
                            kernel=recipe.kernel).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            saved = FP8Tensor(x_data, x_scale, recipe.act_granularity, E4M3, recipe.block)
            xt = _wgrad_input(saved, recipe)  # x along the tokens, the wgrad's K
            if recipe.act_granularity == "tensorwise":  # one scale: ∂yᵀ's cast is ∂y's, moved
                gt = (gq if gq is not None else recipe.quantize_act(g2, recipe.grad_format)).t()
            else:
                gt = recipe.quantize_act(g2.t(), recipe.grad_format)
            grad_w = fp8_mm(gt, xt, out_dtype=weight.dtype, kernel=recipe.kernel)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(grad.dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _backward(ctx, g2, x_data, x_scale, weight, grad):
    """The backward of delayed tensorwise (lowp/delayed.py) and of rowwise_gw_hp, on
    either path: ∂y cast once (with its transposed copy for delayed), Wᵀ cast again, the
    weight gradient in FP8 from the saved xᵀ (delayed) or in high precision from the saved
    input (rowwise_gw_hp: torch.mm(∂yᵀ, x), as torchao's recipe computes it)."""
    recipe: FP8Recipe = ctx.recipe
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x = grad_w = grad_b = None
    if ctx.state is not None:
        gq, gt = delayed.grad_pair(g2, ctx.state, recipe.grad_format)
        wt = (None if not need_x else ctx.wq.t() if ctx.wq is not None  # gathered in FP8
              else delayed.weight(weight, ctx.state, transposed=True))
    else:
        gq = (fused.grad_pair(g2, recipe, True, False)[0] if fused.fused(g2)
              else recipe.quantize_act(g2, recipe.grad_format)) if need_x else None
        wt = fused.weight_t_tensorwise(weight) if need_x else None
    if need_x:
        grad_x = fp8_mm(gq, wt, out_dtype=grad.dtype, kernel=recipe.kernel).view(ctx.x_shape)
    if need_w:
        if recipe.hp_wgrad:
            grad_w = torch.mm(g2.t(), x_data.reshape(-1, x_data.shape[-1])).to(weight.dtype)
        else:
            xt = FP8Tensor(x_data, x_scale, "tensorwise", E4M3)
            grad_w = fp8_mm(gt, xt if fused.fused(g2) else xt.t(), out_dtype=weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2.sum(0).to(grad.dtype)
    return grad_x, grad_w, grad_b, None, None, None


def _fused_backward(ctx, g2, x_data, x_scale, weight, grad):
    """The backward on the fused casts: ∂y and ∂yᵀ in one or two kernels, the saved xᵀ as
    it is, Wᵀ quantised in one or two (lowp/fused.py)."""
    recipe: FP8Recipe = ctx.recipe
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gq, gt = fused.grad_pair(g2, recipe, need_x, need_w)
    grad_x = grad_w = grad_b = None
    if need_x:
        wt = fused.weight(weight, recipe, transposed=True) if ctx.wq is None else ctx.wq.t()
        grad_x = fp8_mm(gq, wt, out_dtype=grad.dtype, kernel=recipe.kernel).view(ctx.x_shape)
    if need_w:
        xt = FP8Tensor(x_data, x_scale, recipe.act_granularity, E4M3, recipe.block)
        grad_w = fp8_mm(gt, xt, out_dtype=weight.dtype, kernel=recipe.kernel)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2.sum(0).to(grad.dtype)
    return grad_x, grad_w, grad_b, None, None, None


def _wgrad_input(saved: FP8Tensor, recipe: FP8Recipe) -> FP8Tensor:
    """The wgrad's x operand, (K, tokens) quantised along the tokens, from the saved copy."""
    if recipe.name == "tensorwise":
        return saved.t()
    if recipe.name == "rowwise":  # saved already transposed and quantised from the original
        return saved
    return recipe.quantize_act(dequantize(saved).t())  # blockwise: DeepSeek's re-quantisation


# The last input quantised: q, k and v (gate and up) read the same tensor, and quantising
# it once lets them save one FP8 copy between them, as a bf16 linear's saved input is one
# storage shared by all three (a fused QKV projection gets this for free). The entry lives
# as long as that input does (a weak reference whose death clears it): the FP8 copy must
# be held here, since saved-tensor hooks (the peak tracker's) may keep only a detached view.
_LAST: list = [None]


def _forget(ref: weakref.ref) -> None:
    if _LAST[0] is not None and _LAST[0][0] is ref:
        _LAST[0] = None


def _cached_pair(x: torch.Tensor, recipe: FP8Recipe) -> tuple[FP8Tensor, FP8Tensor] | None:
    """The cast of x that the last FP8 linear to read this x (unchanged) made, if any.
    While torch.compile traces, x's version counter is symbolic (comparing it breaks the
    graph at every linear): an entry made there has none and counts only there, for a
    tensor of the graph being traced, which no block modifies in place between the
    projections that read it."""
    last = _LAST[0]
    if last is not None:
        ref, version, last_recipe, pair = last
        if ref() is x and last_recipe == recipe and (
                compiling() if version is None else version == x._version):
            return pair
    return None


def _quantized_input(x: torch.Tensor, recipe: FP8Recipe, state=None
                     ) -> tuple[FP8Tensor, FP8Tensor]:
    """(the forward's operand, the copy to save for backward): the same tensor except for
    rowwise, which saves x quantised along the tokens (see the module docstring). Under
    delayed scaling the first linear to read x casts it with its own input history and
    records there; the others reading the same x share that cast."""
    pair = _cached_pair(x, recipe)
    if pair is not None:
        return pair
    x2 = x.reshape(-1, x.shape[-1])
    if state is not None:
        xq, saved = delayed.input_pair(x2, state)
    elif fused.fused(x2):  # saved: the weight gradient's operand as it is (lowp/fused.py)
        xq, saved = fused.input_pair(x2, recipe)
    else:
        xq = recipe.quantize_act(x2)
        saved = recipe.quantize_act(x2.t()) if recipe.name == "rowwise" else xq
    # (rowwise_gw_hp saves x itself, not `saved`: FP8LinearFunction.forward)
    _LAST[0] = (weakref.ref(x, _forget), None if compiling() else x._version, recipe,
                (xq, saved))
    return xq, saved


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               recipe: FP8Recipe, wq: FP8Tensor | None = None,
               state: delayed.DelayedState | None = None) -> torch.Tensor:
    """F.linear with FP8 GEMMs (`wq`: the weight already quantised, if it is; `state`: the
    amax histories of delayed scaling, lowp/delayed.py)."""
    if (state is None) != (recipe.scaling == "dynamic"):
        raise ValueError(f"FP8 {recipe.scaling} scaling needs "
                         f"{'an amax history' if state is None else 'no amax history'}")
    if state is not None and state.record:  # which rows this call records (lowp/delayed.py)
        delayed.note_forward(state, own_input=_cached_pair(x, recipe) is None)
    return FP8LinearFunction.apply(x, weight, bias, recipe, wq, state)


class FP8LinearFn:
    """A callable (x, weight, bias) -> y with FP8 GEMMs, for modules that take a pluggable
    GEMM (the tensor-parallel linears' `linear_fn`)."""

    def __init__(self, recipe: FP8Recipe, module: nn.Module | None = None):
        self.recipe = recipe
        self.module = module  # delayed scaling: the module whose amax histories it uses

    def __call__(self, x, weight, bias=None):
        state = delayed.state_of(self.module) if self.module is not None else None
        return fp8_linear(x, weight, bias, self.recipe, None, state)

    def __repr__(self) -> str:
        return f"FP8LinearFn({self.recipe.name})"


class FP8LinearMixin:
    """Put before an nn.Linear class (or subclass) in the bases: its forward runs in FP8.
    Models get it by a class swap (lowp.convert), so parameters, their names, any tags a
    parallel transformation keeps on them, and checkpoints do not change."""

    fp8_recipe: FP8Recipe = FP8Recipe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_recipe,
                          getattr(self, "fp8_weight", None), delayed.state_of(self))

    def reset_buffers(self) -> None:
        """Materialising a meta-built model (models/init.py): an amax history starts empty,
        in float32 (the model's `.to(dtype)` cast it with the parameters)."""
        if getattr(self, delayed.BUFFER, None) is not None:
            delayed.add_history(self, self.fp8_recipe.history_len)

    def extra_repr(self) -> str:
        scaling = ", delayed" if self.fp8_recipe.scaling == "delayed" else ""
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.name}{scaling}"


class FP8ShardMixin:
    """Put before a tensor-parallel linear's class (its GEMM is `linear_fn`) under delayed
    scaling: the module keeps the amax histories of its shard's operands, and materialising
    a meta-built model (models/init.py) starts them empty."""

    def reset_buffers(self) -> None:
        if getattr(self, delayed.BUFFER, None) is not None:
            delayed.add_history(self, self.linear_fn.recipe.history_len)


class FP8Linear(FP8LinearMixin, nn.Linear):
    """nn.Linear with FP8 GEMMs."""
