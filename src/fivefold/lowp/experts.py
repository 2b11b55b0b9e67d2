"""Routed experts with FP8 GEMMs.

`GroupedExperts` runs each projection as one grouped matmul over the experts' token groups.
Its FP8 form gives each expert's weight its own scales and each expert's tokens their own
groups, as DeepSeek-V3 runs its experts (arXiv 2412.19437 §3.3). Two paths:

  - rowwise: grouped (numerics/fp8_grouped.py). Each activation and gradient is cast once
    over all routed tokens (a token's row scale does not depend on its expert), the
    stacked weight once as (E·I, H); the weight gradient's operands per (expert, column)
    in one op; each GEMM is one `torch._scaled_grouped_mm` where the device has it, and
    elsewhere the same numbers per expert on torch._scaled_mm (bit-equal to the loop on a
    CPU). The activations are saved in FP8: the weight gradient's xᵀ codes, shared by the
    gate and up projections (they read the same x).
  - tensorwise and blockwise: a loop over the experts with the FP8 linear
    (lowp/linear.py; under delayed scaling each expert's projections with their own amax
    histories, lowp/delayed.py), each expert's weight taken by `unbind` (whose backward is
    one stack; indexing `w[e]` cost a zero-filled copy of the whole stacked weight per
    expert and projection in backward). torch has no grouped blockwise FP8 GEMM, so blockwise GEMMs
    stay per expert; `fp8_grouped_casts` makes its casts once for all tokens instead
    (lowp/experts_blockwise.py; off by default, below says why; docs/fp8.md "FP8 experts").

`impl = "loop"` (GroupedExperts' switch) forces the per-expert loop for every recipe: the
reference the grouped path is tested against. The router and the combine stay in
fp32/bf16 (moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fivefold.lowp import delayed, fused
from fivefold.lowp.experts_blockwise import blockwise_experts_forward
from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.models.moe import GroupedExperts
from fivefold.numerics.formats import E4M3
from fivefold.numerics.fp8_cast import fp8_cast_rows
from fivefold.numerics.fp8_grouped import (
    ALIGN,
    fp8_cast_group_cols,
    fp8_grouped_mm,
    fp8_grouped_wgrad_mm,
)


@dataclass
class GroupedFP8:
    """One operand of the grouped GEMMs: rows cast along K for the forward (or the input
    gradient), and each group's transpose cast along its tokens for the weight gradient."""

    codes: torch.Tensor  # (T, K)
    scale: torch.Tensor  # (T, 1)
    codes_t: torch.Tensor | None  # (K, Tp), groups at starts padded to ALIGN
    scale_t: torch.Tensor | None  # (G, K)


def cast_rows(x: torch.Tensor, recipe: FP8Recipe, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale (M, 1)) of a 2-D x, one scale per row: the fused row cast on a GPU (and
    in a trace), the FP8 linear's quantiser on a CPU (the same bytes)."""
    if fused.fused(x):
        codes, scale, _ = fp8_cast_rows(x, fmt.name, recipe.pow2, False)
        return codes, scale
    q = recipe.quantize_act(x, fmt)
    return q.data, q.scale


def cast_grouped(x: torch.Tensor, sizes: list[int], recipe: FP8Recipe, fmt,
                 transposed: bool = True) -> GroupedFP8:
    """x's rows over all tokens, and (if `transposed`) each group's xᵀ, in two ops."""
    x = x.detach()
    codes, scale = cast_rows(x, recipe, fmt)
    codes_t = scale_t = None
    if transposed:
        codes_t, scale_t = fp8_cast_group_cols(x, sizes, ALIGN, False, fmt.name, recipe.pow2)
    return GroupedFP8(codes, scale, codes_t, scale_t)


class FP8GroupedLinear(torch.autograd.Function):
    """y_g = x_g W_gᵀ for each group of rows, rowwise FP8 (numerics/fp8_grouped.py)."""

    @staticmethod
    def forward(ctx, x, weight, xq: GroupedFP8, sizes: list[int], recipe: FP8Recipe):
        e, n, k = weight.shape
        w_codes, w_scale = cast_rows(weight.detach().reshape(e * n, k), recipe, E4M3)
        y = fp8_grouped_mm(xq.codes, w_codes.view(e, n, k), xq.scale, w_scale.view(e, n),
                           sizes, x.dtype)
        ctx.save_for_backward(xq.codes_t, xq.scale_t, weight)
        ctx.sizes, ctx.recipe = sizes, recipe
        return y

    @staticmethod
    def backward(ctx, grad):
        x_codes_t, x_scale_t, weight = ctx.saved_tensors
        recipe, sizes = ctx.recipe, ctx.sizes
        e, n, k = weight.shape
        grad = grad.contiguous()
        gq = cast_grouped(grad, sizes, recipe, recipe.grad_format,
                          transposed=ctx.needs_input_grad[1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # Wᵀ of each expert along N: the columns of the stacked (E·N, K) weight per
            # group of N rows, written as (E, K, N) blocks
            wt_codes, wt_scale = fp8_cast_group_cols(weight.detach().reshape(e * n, k),
                                                     [n] * e, 1, True, E4M3.name, recipe.pow2)
            grad_x = fp8_grouped_mm(gq.codes, wt_codes, gq.scale, wt_scale, sizes,
                                    grad.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_grouped_wgrad_mm(gq.codes_t, x_codes_t, gq.scale_t, x_scale_t,
                                          sizes, weight.dtype)
        return grad_x, grad_w, None, None, None


class FP8ExpertsMixin:
    """Put before a GroupedExperts class (or subclass, e.g. expert parallelism's) in the
    bases: its expert GEMMs run in FP8 (models get it by a class swap: lowp.convert)."""

    fp8_recipe: FP8Recipe = FP8Recipe()
    # blockwise: per-expert GEMMs on casts made once for all tokens (lowp/experts_blockwise.py)
    # instead of the loop. Off: fewer kernels (167 against 213 at Mixtral's shape) but more
    # bytes (1.95x bf16's against 1.84x: each projection's output is concatenated), and the
    # trace's roofline predicts it slower (docs/fp8.md, "FP8 experts"); the GPU run times both.
    fp8_grouped_casts: bool = False

    def reset_buffers(self) -> None:
        """Materialising a meta-built model (models/init.py): delayed scaling's histories
        start empty, in float32, one per local expert and projection (lowp/delayed.py)."""
        if getattr(self, delayed.BUFFER, None) is not None:
            delayed.add_expert_history(self, self.fp8_recipe.history_len)

    def uses_grouped_fp8(self) -> bool:
        """Rowwise: grouped GEMMs and casts. Blockwise with `fp8_grouped_casts`: grouped
        casts, per-expert GEMMs, where both widths are whole 128-blocks (a stacked weight's
        blocks must not straddle two experts). Otherwise, and with impl = "loop", the loop."""
        if self.impl == "loop":
            return False
        block = self.fp8_recipe.block
        return self.fp8_recipe.name == "rowwise" or (
            self.fp8_recipe.name == "blockwise" and self.fp8_grouped_casts
            and self.hidden % block == 0 and self.inter % block == 0)

    @torch.compiler.disable
    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Eager under torch.compile: the rows per expert change every step, and graphs
        specialised on them were compiled again step after step (torch 2.13, tensorwise:
        12, 13, 17, 18 graphs after steps 1-4 of a 2-block model, toward dynamo's
        recompile limit, past which a frame runs eagerly anyway)."""
        sizes = [int(c) for c in counts.tolist()]
        if not self.uses_grouped_fp8():
            return self._loop(x_sorted, sizes)
        if self.fp8_recipe.name == "blockwise":
            return blockwise_experts_forward(self, x_sorted, sizes)
        return self._grouped(x_sorted, sizes)

    def _grouped(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        r = self.fp8_recipe
        need_t = torch.is_grad_enabled() and (self.w_gate.requires_grad
                                              or self.w_down.requires_grad)
        xq = cast_grouped(x, sizes, r, E4M3, transposed=need_t)
        h = F.silu(FP8GroupedLinear.apply(x, self.w_gate, xq, sizes, r)) * (
            FP8GroupedLinear.apply(x, self.w_up, xq, sizes, r))
        hq = cast_grouped(h, sizes, r, E4M3, transposed=need_t)
        return FP8GroupedLinear.apply(h, self.w_down, hq, sizes, r)

    def _loop(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        r = self.fp8_recipe
        outs = []
        weights = zip(self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0))
        # ZeRO-3's FP8 all-gather (parallel/zero3_fp8.py): each expert's weights gathered as
        # tensorwise FP8, the codes and scale this loop's casts would make
        gathered = getattr(self, "fp8_experts", None)
        delayed_on = getattr(self, delayed.BUFFER, None) is not None
        for e, (rows, (w_gate, w_up, w_down)) in enumerate(zip(x.split(sizes), weights)):
            if rows.shape[0] == 0:  # no tokens: nothing to quantise (an empty amax), and
                # under delayed scaling nothing recorded (lowp/delayed.py `_push_experts`)
                outs.append(rows.new_zeros(0, self.hidden))
                if gathered and delayed_on:
                    self._fold_gathered(gathered, e)
                continue
            gq, uq, dq = ((gathered["w_gate"][e], gathered["w_up"][e], gathered["w_down"][e])
                          if gathered else (None, None, None))
            # delayed scaling: each expert's projections cast from their own histories
            sg, su, sd = ((delayed.expert_state(self, e, p) for p in range(3)) if delayed_on
                          else (None, None, None))
            h = F.silu(fp8_linear(rows, w_gate, None, r, gq, sg)) * fp8_linear(
                rows, w_up, None, r, uq, su)
            outs.append(fp8_linear(h, w_down, None, r, dq, sd))
        return torch.cat(outs) if outs else x.new_zeros(0, self.hidden)

    def _fold_gathered(self, gathered: dict, e: int) -> None:
        """Delayed scaling with ZeRO-3's FP8 all-gather, expert e without tokens here: the
        amaxes of this rank's pieces of its weights fold into its W records all the same,
        with no flag raised. The step's all_reduce(max) then makes each record its whole
        weight's where any rank met tokens (the flag, lowp/delayed.py `_expert_block`),
        whichever ranks those were; where none did, nothing is pushed, as on one device."""
        for p, name in enumerate(("w_gate", "w_up", "w_down")):
            delayed.record_gathered(delayed.expert_state(self, e, p), gathered[name][e])


class FP8GroupedExperts(FP8ExpertsMixin, GroupedExperts):
    """GroupedExperts with FP8 expert GEMMs."""
