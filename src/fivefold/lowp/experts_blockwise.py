"""Blockwise FP8 experts: per-expert GEMMs on casts made once for all routed tokens.

torch has no grouped blockwise FP8 GEMM, so each expert's three GEMMs stay separate calls
(cuBLASLt's blockwise kernel on an sm90 GPU, the 128-wide K-slice emulation elsewhere:
`FP8Recipe.kernel`). What is grouped is every cast around them, each one op for all
experts:

    x, h, ∂y   1x128 tiles along K over all tokens, and each expert's transpose in tiles
               along its own tokens (numerics/fp8_grouped_tiles.py), x's re-quantised
               from its row codes as the FP8 linear's saved input is (DeepSeek-V3 §3.3.4)
    W          128x128 blocks of the stacked (E·N, K) weight: with N a multiple of 128 no
               block straddles two experts, so these are each expert's own blocks

and each expert's operands are views of those (rows of the row codes; its own contiguous
block of the transposed codes; its rows of the weight blocks). The transposed weight of the
input gradient is cast per expert (a stacked cast would leave each expert's Wᵀ a strided
slice, which the kernel would copy). The numbers are the per-expert FP8 linear's
(lowp/linear.py): on a CPU bit for bit (tests/test_fp8_experts_blockwise.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.lowp import fused
from fivefold.lowp.linear import FP8Recipe
from fivefold.numerics.formats import E4M3
from fivefold.numerics.fp8 import FP8Tensor, fp8_mm
from fivefold.numerics.fp8_cast import fp8_cast_blocks
from fivefold.numerics.fp8_grouped_tiles import fp8_cast_group_tiles, group_t, tile_starts


@dataclass
class GroupedTiles:
    codes: torch.Tensor
    scale: torch.Tensor
    codes_t: torch.Tensor
    scale_t: torch.Tensor
    sizes: list[int]
    fmt: object
    block: int

    def rows(self, g: int) -> FP8Tensor:
        """Expert g's rows in tiles along K."""
        start = sum(self.sizes[:g])
        rows = slice(start, start + self.sizes[g])
        return FP8Tensor(self.codes[rows], self.scale[rows], "tiles", self.fmt, self.block)

    def cols(self, g: int) -> FP8Tensor:
        """Expert g's transpose in tiles along its own tokens."""
        return cols_of(self.codes_t, self.scale_t, self.sizes, g, self.fmt, self.block)


def cols_of(codes_t, scale_t, sizes, g, fmt, block) -> FP8Tensor:
    k, size = scale_t.shape[0], sizes[g]
    ts = tile_starts(sizes)[0][g]
    return FP8Tensor(group_t(codes_t, k, sum(sizes[:g]), size),
                     scale_t[:, ts:ts + -(-size // block)], "tiles", fmt, block)


def cast_tiles(x: torch.Tensor, sizes: list[int], fmt, requant: bool,
               block: int) -> GroupedTiles:
    codes, scale, codes_t, scale_t = fp8_cast_group_tiles(x.detach(), sizes, fmt.name, requant)
    return GroupedTiles(codes, scale, codes_t, scale_t, sizes, fmt, block)


def _weight_blocks(weight: torch.Tensor, recipe: FP8Recipe) -> FP8Tensor:
    """The stacked weight (E, N, K) as (E·N, K) in 128x128 blocks, one op."""
    e, n, k = weight.shape
    w2 = weight.detach().reshape(e * n, k)
    if fused.fused(w2):
        codes, scale = fp8_cast_blocks(w2, E4M3.name)
        return FP8Tensor(codes, scale, "blocks", E4M3, recipe.block)
    return recipe.quantize_weight(w2)


def _expert_rows(q: FP8Tensor, g: int, n: int) -> FP8Tensor:
    b = n // q.block
    return FP8Tensor(q.data[g * n:(g + 1) * n], q.scale[g * b:(g + 1) * b], q.granularity,
                     q.fmt, q.block)


def _weight_t(w: torch.Tensor, recipe: FP8Recipe) -> FP8Tensor:
    """One expert's Wᵀ in 128x128 blocks (the input gradient's operand)."""
    w = w.detach()
    return fused.weight(w, recipe, transposed=True) if fused.fused(w) else (
        recipe.quantize_weight(w.t()))


class FP8BlockwiseExpertsLinear(torch.autograd.Function):
    """y_g = x_g W_gᵀ per expert g, blockwise FP8, on the grouped casts."""

    @staticmethod
    def forward(ctx, x, weight, xq: GroupedTiles, recipe: FP8Recipe):
        e, n, _ = weight.shape
        wq = _weight_blocks(weight, recipe)
        outs = [fp8_mm(xq.rows(g), _expert_rows(wq, g, n), out_dtype=x.dtype,
                       kernel=recipe.kernel) if size else x.new_zeros(0, n)
                for g, size in enumerate(xq.sizes)]
        ctx.save_for_backward(xq.codes_t, xq.scale_t, weight)
        ctx.sizes, ctx.recipe = xq.sizes, recipe
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        codes_t, scale_t, weight = ctx.saved_tensors
        recipe, sizes = ctx.recipe, ctx.sizes
        gq = cast_tiles(grad.contiguous(), sizes, recipe.grad_format, False, recipe.block)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        parts, grads_w = [], []
        for g, (size, w) in enumerate(zip(sizes, weight.unbind(0))):
            if not size:
                parts.append(grad.new_zeros(0, weight.shape[2]))
                grads_w.append(torch.zeros_like(w))
                continue
            if need_x:
                parts.append(fp8_mm(gq.rows(g), _weight_t(w, recipe), out_dtype=grad.dtype,
                                    kernel=recipe.kernel))
            if need_w:
                xt = cols_of(codes_t, scale_t, sizes, g, E4M3, recipe.block)
                grads_w.append(fp8_mm(gq.cols(g), xt, out_dtype=weight.dtype,
                                      kernel=recipe.kernel))
        grad_x = torch.cat(parts) if need_x else None
        grad_w = torch.stack(grads_w) if need_w else None
        return grad_x, grad_w, None, None


def blockwise_experts_forward(module, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The SwiGLU experts on the grouped blockwise casts (x's cast shared by gate and up)."""
    import torch.nn.functional as F

    r = module.fp8_recipe
    xq = cast_tiles(x, sizes, E4M3, True, r.block)
    h = F.silu(FP8BlockwiseExpertsLinear.apply(x, module.w_gate, xq, r)) * (
        FP8BlockwiseExpertsLinear.apply(x, module.w_up, xq, r))
    hq = cast_tiles(h, sizes, E4M3, True, r.block)
    return FP8BlockwiseExpertsLinear.apply(h, module.w_down, hq, r)
