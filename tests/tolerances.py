"""Parity tolerances for float32 runs that differ only in the order of their sums.

A layout (dp, tp, pp, cp, ep, ZeRO, compile) computes the same float32 numbers as the
single-process run, summed in another order: its reductions are split differently and its
GEMMs have other shapes, so the kernels block them differently. Another CPU, or another
kernel family of the same CPU (ATEN_CPU_CAPABILITY=avx2/default, other thread counts), does
the same to the single-process run itself. So a tolerance must hold for any order, not for
the one a machine happened to pick; it comes from this error model, not from a measurement.

1. A sum of n float32 terms, in any order: |ŝ − s| ≤ λ·√n·u·Σ|x_i| with u = 2^-24, with
   probability ≥ 1 − 2·exp(−λ²/2) (Higham & Mary, "A new approach to probabilistic rounding
   error analysis", SIAM J. Sci. Comput. 41(5), 2019, Thm 3.1). Every comparison here is of
   many such sums at once: a tensor's norm-wise error (‖a − b‖ / ‖b‖), a gradient norm, a
   loss averaged over tokens. Their independent errors (each of standard deviation about
   √n·u·Σ|x_i|/√3, rounding errors being uniform on ±u) concentrate at their root mean
   square, so λ = 2 (the single-sum bound at 1 − 0.27) bounds the norm-wise error of a
   tensor of ≥ 32 entries with room for its fluctuation (≈ ±25% at 32 entries, 2σ).
   Two runs' errors from the exact sum are independent: their difference is √2 times one.
2. Relative to the sum itself, the bound grows by the cancellation κ = Σ|x_i| / |Σ x_i|.
   The loss is a mean of positive terms (κ = 1). A weight gradient is a sum over the T
   tokens of per-token outer products whose signs are close to random in these small
   models, so |Σ| ~ √T·|x| while Σ|x| ~ T·|x|: κ ≈ √T, and the gradient's relative error
   is λ·T·u. The error the backward carries in from the layers above (GEMMs of length K =
   hidden or ffn size, each κ ≈ √K by the same argument) adds λ·K·u per GEMM, in quadrature
   over the `depth` GEMMs between the loss and the tensor (3 per block: attention output,
   MLP down and up/gate; a pipeline's deepest tensor sits under all of them).
3. AdamW normalises each entry's step to about lr whatever the gradient's size: an entry
   whose gradient is as small as its rounding error takes an arbitrary step in [−lr, lr]
   (Adam's 1/√v amplifies that entry's error to full size), and later gradients are taken
   at the moved weights. Parameters after the steps, and the losses and gradients of steps
   after the first, get ADAM_GAIN × the one-step gradient bound: Adam's update m/√v is
   homogeneous of degree 0 in the gradient, so an entry's step changes by lr times its
   gradient's relative error, the same relative error as the gradient; the entries at the
   rounding level, moved by up to 2·lr, are few (a fraction ~ e of a tensor for a relative
   error e) and add one more such term, hence 2.

What these still catch: a wrong gradient scale (2× or 1/dp) is a relative error of order 1;
a missing micro-batch or rank in a reduction is 1/m or 1/dp; one bf16 rounding in an fp32
path is 2^-9 ≈ 2e-3 per entry; each is ≥ 10× the loosest bound the tests use (1.4e-4 at
256 tokens through 24 GEMMs after AdamW steps).

Set FIVEFOLD_PARITY_LOG to a file path and every check appends its error/bound ratio
there (bench/parallel/parity_kernels.py reads it to report each kernel's worst margin).
"""

from __future__ import annotations

import json
import math
import os

U32 = 2.0**-24  # float32 unit roundoff (IEEE 754 binary32: 24-bit significand)
LAMBDA = 2.0  # item 1: norm-wise comparisons of many independent sums
ADAM_GAIN = 2.0  # item 3: the first-order term plus the entries at the rounding level


def sum_rtol(n: int, cancel: float = 1.0) -> float:
    """Item 1-2: relative error of one float32 sum of n terms in another order."""
    return LAMBDA * math.sqrt(n) * U32 * cancel


def loss_rtol(tokens: int, depth: int, width: int = 64) -> float:
    """A mean loss over `tokens` positive cross-entropy terms (κ = 1), each term carrying
    the forward's rounding, `depth` GEMMs of length `width` (κ ≈ √width each) in quadrature;
    the terms' independent errors average over the tokens (÷√tokens), the mean adds its own
    sum, and two runs differ by √2 of one. The loss moves only to second order with the
    weights (it is stationary in each entry's rounding-sized step), so later steps' losses
    keep this bound."""
    forward = sum_rtol(width, math.sqrt(width)) * math.sqrt(depth / tokens)
    return math.sqrt(2) * math.hypot(sum_rtol(tokens), forward)


def grad_rtol(tokens: int, depth: int, width: int = 64) -> float:
    """Item 2: norm-wise relative error of one weight gradient (or of the gradient norm)
    between two orders: the token sum (κ ≈ √tokens) and `depth` backward GEMMs of length
    `width` (κ ≈ √width) in quadrature, √2 for two runs."""
    token_sum = sum_rtol(tokens, math.sqrt(tokens))
    carried = sum_rtol(width, math.sqrt(width)) * math.sqrt(depth)
    return math.sqrt(2) * math.hypot(token_sum, carried)


def trained_rtol(tokens: int, depth: int, width: int = 64) -> float:
    """Item 3: losses, gradients and parameters after one or more AdamW steps."""
    return ADAM_GAIN * grad_rtol(tokens, depth, width)


def within(err: float, bound: float, label: object = "") -> bool:
    """err ≤ bound, and the ratio logged when FIVEFOLD_PARITY_LOG names a file."""
    path = os.environ.get("FIVEFOLD_PARITY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"label": str(label)[:200], "err": float(err),
                                "bound": float(bound)}) + "\n")
    return err <= bound
