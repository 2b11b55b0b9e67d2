"""Trace budgets of one FP8 linear, forward + backward, at 8192 x 4096 -> 4096 (the
8B-shaped block's square projection), on an H100 as the meta trace sees it: the GPU's
branches, each fused cast and each GEMM one custom op with its bytes (fivefold.trace).

The floor each recipe can reach, T = 8192 tokens, K = N = 4096, S_x = S_g = T·K = 32 Mi
elements, S_w = N·K = 16 Mi; bf16 is 2 bytes, FP8 1:

  bf16: three GEMMs, each reads two operands and writes one:
        3 · 2 (TK + NK + TN) bytes = 480 MiB.
  FP8 GEMMs: the same operands in 1 byte, the results in bf16: 320 MiB (+ their scales).
  Casts, with the scales computed from this step's values (byte-equal to the reference)
  and the weight quantised again in backward (not saved in FP8: no new saved bytes):
    a cast pass reads 2 bytes and writes 1 per element per copy written; a separate
    amax pass reads 2 bytes per element.
    tensorwise  x, ∂y: amax + cast writing both copies   3 · 2S = 6S each
                W: (amax + cast) in forward and in backward   2 · 5S_w = 10 S_w
                -> 192 + 192 + 160 = 544 MiB; total 864 MiB = 1.80x bf16
    rowwise     x, ∂y: row cast (its amax within the row) + column cast  6S each
                W: row cast in forward, row cast of Wᵀ in backward  6 S_w
                -> 480 MiB; total 800 MiB = 1.67x, + the column partial amaxes
                (cdiv(T, 32) x K fp32, written and read: 16 MiB) = 1.70x
    blockwise   x, ∂y: one pass writing both copies (tiles lie within a 128x128 tile)
                4S each; W: block cast in forward and of Wᵀ in backward  6 S_w
                -> 352 MiB; total 672 MiB = 1.40x, + the scales = 1.42x
  Kernels: the GEMMs (3), one per cast pass, one per amax pass: tensorwise 3 + 8 = 11,
  rowwise 3 + 6 = 9, blockwise 3 + 4 = 7.

Issue 42 asks ≤ 1.5x for tensorwise and rowwise: out of reach inside the linear while the
amax of x and ∂y is computed there (those two reads alone are 128 MiB = 0.27x on top of the
1.33x of one cast per operand). Two recipes that take their scales elsewhere reach it:
    tensorwise, delayed scaling (lowp/delayed.py): the scale from an amax history, the
                cast records this step's amax in the same pass: x, ∂y one pass writing
                both copies, 4S each; W cast in forward and Wᵀ in backward, 6 S_w
                -> 352 MiB; total 672 MiB = 1.40x (+ 32 KiB of tile amaxes, the history
                rows); kernels 3 + 4 casts + 3 amax folds into the step's record (a few
                KiB each; the history moves once per optimizer step, outside) = 10.
                Its first step (no history yet) is dynamic: tensorwise's 11 + 3 folds,
                1.73x (the x, ∂y copies written together, so 0.07x below dynamic's).
    rowwise_gw_hp (torchao ROWWISE_WITH_GW_HP): x, W, ∂y cast by rows only, 3S, 3S_w,
                3S; Wᵀ tensorwise (power-of-two scale): amax 2S_w + cast 3S_w; the weight
                gradient a bf16 GEMM of ∂yᵀ and the saved bf16 x: 2·(2S) + 2S_w
                -> casts 96 + 48 + 96 + 80 = 320 MiB, GEMMs 112 + 112 + 160
                = 704 MiB = 1.47x (+ row scales); kernels 3 GEMMs + 3 row casts + amax
                + tensorwise cast + the repeat of Wᵀ's one scale per column (16 KiB,
                _scaled_mm takes both operands rowwise) = 9.
The dynamic recipes stay above 1.5x by the argument above (docs/fp8.md).

Before the fused casts (rev c0f2a82): tensorwise 61 kernels, 4.33x; rowwise 99, 4.34x;
blockwise 81, 7.71x.
"""

import dataclasses

import pytest
import torch

from fivefold.lowp.delayed import DelayedState
from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.trace import trace_callable

T, K, N = 8192, 4096, 4096
MIB = 2**20

# recipe: (kernels, the floor derived above in MiB, the budget in bf16's bytes)
BUDGETS = {"tensorwise": (11, 864, 1.81), "rowwise": (9, 800, 1.71),
           "blockwise": (7, 672, 1.42), "tensorwise_delayed": (10, 672, 1.41),
           "rowwise_gw_hp": (9, 704, 1.47)}
WITHIN_1_5X = ("tensorwise_delayed", "rowwise_gw_hp")  # issue 42's budget, reached


def recipe_of(name: str) -> tuple[FP8Recipe, DelayedState | None]:
    """The recipe as the H100 runs it, and for delayed scaling the steady state: every
    history row holding a record (a trace has no values; lowp/delayed.py `state_of`)."""
    if name == "tensorwise_delayed":
        state = DelayedState(torch.zeros(3, 16, device="meta"), [True] * 3, record=True)
        return FP8Recipe.from_name("tensorwise", scaling="delayed"), state
    recipe = FP8Recipe.from_name(name)
    if name == "blockwise":  # the H100's blockwise GEMM, as lowp/convert.py picks it there
        recipe = dataclasses.replace(recipe, kernel="scaled_mm")
    return recipe, None


def _trace(recipe: FP8Recipe | None, state: DelayedState | None = None):
    x = torch.empty(T, K, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(N, K, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(T, N, device="meta", dtype=torch.bfloat16)
    if recipe is None:
        step = lambda: torch.nn.functional.linear(x, w).backward(g)  # noqa: E731
    else:
        step = lambda: fp8_linear(x, w, None, recipe, None, state).backward(g)  # noqa: E731
    t = trace_callable(step, gpu="h100")
    return t, sum(e.bytes_read + e.bytes_written for e in t.events if e.kind == "kernel")


def test_bf16_linear_is_three_gemms_of_480_mib():
    t, nbytes = _trace(None)
    assert t.kernels == 3 and nbytes == 3 * 2 * (T * K + N * K + T * N) == 480 * MIB


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_fp8_linear_trace_within_its_budget(name):
    """Each recipe's kernel count and bytes against its budget (module docstring): fails if
    a cast falls back to the step-by-step path (tens of kernels) or a copy creeps in; the
    bytes never fall below the derived floor (a fake op that under-reports would)."""
    recipe, state = recipe_of(name)
    kernels, floor_mib, budget = BUDGETS[name]
    _, bf16 = _trace(None)
    t, nbytes = _trace(recipe, state)
    assert t.kernels <= kernels, (name, t.kernels, dict(t.ops))
    assert floor_mib * MIB <= nbytes <= budget * bf16, (name, nbytes / bf16)
    assert t.syncs == 0
    gemms = [e for e in t.events if e.kind == "kernel" and e.flops]
    fp8_gemms = 2 if recipe.hp_wgrad else 3  # rowwise_gw_hp: the weight gradient in bf16
    assert len(gemms) == 3 and [e.dtype for e in gemms].count("fp8") == fp8_gemms
    assert sum(e.flops for e in gemms) == 3 * 2 * T * K * N
    if name == "blockwise":
        assert nbytes <= 2 * bf16  # issue 42's budget for blockwise
    if name in WITHIN_1_5X:
        assert nbytes <= 1.5 * bf16  # issue 42's budget for tensorwise and rowwise


def test_delayed_first_step_is_dynamic_plus_the_records():
    """No history yet: each cast takes its own amax (one amax pass each over x, W and ∂y,
    as dynamic tensorwise) and records it; the steady state is the same ops without those
    three passes (W's backward copy takes the amax the forward folded into the step's
    record)."""
    recipe, state = recipe_of("tensorwise_delayed")
    state.filled[:] = [False] * 3
    first, first_bytes = _trace(recipe, state)
    steady, steady_bytes = _trace(*recipe_of("tensorwise_delayed"))
    amax = [e for e in first.events if e.kind == "kernel" and "amax_partials" in e.name]
    assert len(amax) == 3 and first.kernels == steady.kernels + 3
    passes = (2 * T * K + N * K) * 2  # x and ∂y, and W, read once in bf16
    assert passes <= sum(e.bytes_read for e in amax) < passes + 4096
    # the casts then read <= 256 partial amaxes instead of the 16-step history
    assert 0 <= first_bytes - steady_bytes - sum(e.bytes_read + e.bytes_written
                                                 for e in amax) < 3 * 256 * 4
