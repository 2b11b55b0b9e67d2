"""The planner's FP8 dense linears (plan/fp8.py `cast_bytes`, `linear_cast_bytes`): the
bytes of their cast kernels against the trace of the engine's FP8 linear
(lowp/linear.py `fp8_linear`) on the meta device as an H100 runs it (fivefold.trace, the
fused casts of lowp/fused.py), forward alone and forward + backward, per recipe, tensorwise
with dynamic and with delayed scaling (its steady state: every history row filled).

What the trace counts as the casts: every kernel of the linear that is not a GEMM (no
FLOPs): the amax, cast and fold kernels and the scales' small copies.

Error model: the planner counts each cast's codes, transposed copies, scales, the row
cast's column partials and delayed scaling's history reads and tile records exactly; it
leaves out (a) the tensorwise amax partials, at most MAX_PARTIALS = 256 fp32 written by
the amax pass and read by the cast: <= 2 KiB per amax pass (x and W in forward, W and ∂y
in backward; rowwise_gw_hp's Wᵀ in backward), and (b) blockwise's padding of the weight's
block scales to a multiple of 4 columns, none here (every width a multiple of 512). So
0 <= traced - planned <= 2 KiB x the amax passes, and the relative gap is printed by the
assertion when it fails.
"""

import dataclasses

import pytest
import torch

from fivefold.lowp.delayed import DelayedState
from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.numerics.fp8_cast import MAX_PARTIALS
from fivefold.plan.fp8 import linear_cast_bytes
from fivefold.trace import trace_callable

# (tokens, in, out): a k/v projection of Llama-3.1-8B at 4096 tokens; its down projection
SHAPES = {"kv": (4096, 4096, 1024), "down": (2048, 14336, 4096)}
RECIPES = ("tensorwise", "tensorwise_delayed", "rowwise", "rowwise_gw_hp", "blockwise")
# amax passes (forward, forward + backward): each leaves <= 256 fp32 partials out
AMAX_PASSES = {"tensorwise": (2, 4), "rowwise_gw_hp": (0, 1)}


def recipe_of(name):
    """The recipe as the H100 runs it, and delayed scaling's steady state."""
    if name == "tensorwise_delayed":
        state = DelayedState(torch.zeros(3, 16, device="meta"), [True] * 3, record=True)
        return FP8Recipe.from_name("tensorwise", scaling="delayed"), state
    recipe = FP8Recipe.from_name(name)
    if name == "blockwise":  # the H100's blockwise GEMM, as lowp/convert.py picks it there
        recipe = dataclasses.replace(recipe, kernel="scaled_mm")
    return recipe, None


def traced_cast_bytes(shape, name, backward):
    """Bytes read + written by the linear's kernels other than its GEMMs, and the GEMMs'
    count (a fresh x each time: the linear caches an input's cast by identity)."""
    tokens, k, n = shape
    recipe, state = recipe_of(name)
    x = torch.empty(tokens, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(n, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(tokens, n, device="meta", dtype=torch.bfloat16)

    def run():
        y = fp8_linear(x, w, None, recipe, None, state)
        if backward:
            y.backward(g)

    events = [e for e in trace_callable(run, gpu="h100").events if e.kind == "kernel"]
    casts = sum(e.bytes_read + e.bytes_written for e in events if not e.flops)
    return casts, sum(1 for e in events if e.flops)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", RECIPES)
def test_planned_dense_cast_bytes_match_the_trace(shape, name):
    tokens, k, n = SHAPES[shape]
    scaling = "delayed" if name == "tensorwise_delayed" else "dynamic"
    fwd, bwd = linear_cast_bytes(name.removesuffix("_delayed"), tokens, k, n, 2, scaling)
    for i, (planned, backward) in enumerate(((fwd, False), (fwd + bwd, True))):
        got, gemms = traced_cast_bytes(SHAPES[shape], name, backward)
        assert gemms == (3 if backward else 1)
        slack = 2 * 4 * MAX_PARTIALS * AMAX_PASSES.get(name, (0, 0))[i]
        assert 0 <= got - planned <= slack, (name, backward, got, planned,
                                             (got - planned) / got)
