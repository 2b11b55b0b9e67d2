"""Parity bounds for optimizers whose update is not smooth at float32's rounding scale.

Two runs of one job under different layouts differ by the order of their float32 sums
(tests/tolerances.py); AdamW and Adafactor carry that difference into the weights with the
Adam gain (`trained_rtol`). Two optimizers turn it into more, and this module bounds how much
(the reasoning is each function's; the numbers come from the reference run and the maps):

- quantised moments (adamw8bit, adamw4bit): a stored moment is the map point nearest to its
  value over its block's absmax A. Two runs whose values differ by dx (A by as much at most,
  hence 2 dx in all) store different codes only when a rounding midpoint lies between the
  two values: with the midpoints w apart around that code and the value's place among them
  uniform, that happens with probability 2|dx| / (w A), and the stored values then differ
  by w A, so E(stored difference)^2 = 2 w A |dx| per value. With |dx| = e times the block's
  rms (a float32 sum errs alike on small and large results), the moment's relative error r
  has r^2 = 2 e sum_b A_b rms_b sum_{i in b} w_i / ||x||^2 (`flip_weight`, from the
  reference's stored moments; e for v = g^2 is twice the gradient's). A flip survives into
  the next stored moment with probability ~ beta (the lerp keeps beta of the difference):
  r_t^2 = beta r_{t-1}^2 + 2 e_t (...). A moment off by r changes Adam's update m / sqrt(v)
  by (r_m + r_v / 2) of itself to first order, and |update| <= U per value (`update_bound`),
  so a tensor of n values moves by lr U sqrt(n) (r_m + r_v / 2) more in each step that reads
  stored codes (every step after the first: the first uses the values before quantisation);
- Muon's Newton-Schulz iteration X <- aX + b(XX^T)X + c(XX^T)^2 X applies the odd polynomial
  p(s) = as + bs^3 + cs^5 to the singular values; its Frechet derivative is bounded by
  max |p'| over the singular values' range (Noferini 2017, "A formula for the Frechet
  derivative of a generalized matrix function", SIAM J. Matrix Anal. Appl. 38(2): the
  divided differences of p, each a value of p' by the mean value theorem, p' being even).
  Starting from X = U / ||U||_F (singular values in [0, 1], and a relative change e of U a
  change of at most 2e of X), `ns_gain` multiplies the steps' maxima of |p'| over the
  iterates' ranges: 851 for Jordan's coefficients and 5 steps (a^5 = 485 counts only the
  smallest singular values; p' reaches 3.96 at s = 1.2). The step lr 0.2 sqrt(max(A, B)) O
  (match_rms_adamw) then moves the weights by lr 0.2 sqrt(max(A, B)) 2e gain more per step.
  For a change of independent entries (float32 sums in another order), `ns_gain_rms` gives
  the gain at one input: the root mean square of the derivative's factors, not their
  largest (a test passes it per step and matrix shape from the reference's own inputs).

Each step's gradient error is the float32 model's (`grad_rtol` in the first step,
`trained_rtol` after) plus the weights' relative distance so far (a gradient moves as much
relative as the weights under it, to first order); a loss moves by the gradient norm times
the weights' distance over sqrt(N): the differences point every way, and only their
projection on the gradient counts. lambda = 2 over these expected values, as tolerances.py's
item 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tolerances import LAMBDA, grad_rtol, loss_rtol, trained_rtol

from fivefold.numerics.optim_states import block_size, qmap


@dataclass
class Run:
    tokens: int  # per step (global batch)
    depth: int  # GEMMs between the loss and the deepest weight
    width: int  # the longest GEMM's length
    lr: float  # constant
    steps: int
    betas: tuple[float, float] = (0.9, 0.95)


def flip_weight(x: torch.Tensor, bits: int, signed: bool) -> float:
    """sum_b A_b rms_b sum_{i in b} w_i / ||x||^2: the stored moment's blocks (absmax A_b,
    rms rms_b) and the spacing w_i of the map's rounding midpoints around each value's code."""
    table = qmap(bits, signed).double()
    gaps = table[1:] - table[:-1]
    spacing = torch.cat([gaps[:1], (gaps[1:] + gaps[:-1]) / 2, gaps[-1:]])
    blocks = x.reshape(-1, block_size(bits)).double()
    scaled = (blocks / blocks.abs().amax(1, keepdim=True).clamp_min(1e-30)).contiguous()
    codes = (torch.searchsorted(table, scaled) - 1).clamp(0, len(table) - 2)
    lower = table[codes]
    codes = torch.where((scaled - lower) * 2 > table[codes + 1] - lower, codes + 1, codes)
    amax, rms = blocks.abs().amax(1), blocks.norm(dim=1) / math.sqrt(blocks.shape[1])
    return float((amax * rms * spacing[codes].sum(1)).sum() / blocks.square().sum())


def update_bound(steps: int, beta1: float, beta2: float) -> float:
    """max over t <= steps of |m_hat| / sqrt(v_hat) (Cauchy-Schwarz over the moments'
    exponential weights: sum_k w_k^2 / u_k, bias corrections included): 1.001 up to step 3
    at betas 0.9 / 0.95."""
    out, r = 0.0, beta1 ** 2 / beta2
    for t in range(1, steps + 1):
        s = (1 - beta1) ** 2 * (1 - beta2 ** t) / ((1 - beta2) * (1 - beta1 ** t) ** 2)
        out = max(out, math.sqrt(s * (1 - r ** t) / (1 - r)))
    return out


def ns_gain(coefficients: tuple[float, float, float], steps: int) -> float:
    """The product over the steps of max |p'| on [0, the largest iterate so far]."""
    a, b, c = coefficients
    s = torch.linspace(0, 1, 100001, dtype=torch.float64)
    gain = 1.0
    for _ in range(steps):
        grid = torch.linspace(0, float(s.max()), 100001, dtype=torch.float64)
        gain *= float((a + 3 * b * grid ** 2 + 5 * c * grid ** 4).abs().max())
        s = a * s + b * s ** 3 + c * s ** 5
    return gain


def ns_gain_rms(update: torch.Tensor, coefficients: tuple[float, float, float],
                steps: int) -> float:
    """The root mean square gain of Newton-Schulz at one input, for a change of independent
    entries. The iterates keep the input's singular vectors (p acts on the singular values
    only), so every iteration's derivative (Noferini's formula) scales the same components
    of a change, in that basis: each pair (i < j) of singular directions' symmetric part by
    the divided difference p[s_i, s_j], its antisymmetric part by p[s_i, -s_j] = (p(s_i) +
    p(s_j)) / (s_i + s_j), the diagonal by p'(s_i) = p[s_i, s_i], and a wide matrix's extra
    columns by p(s_i) / s_i = p[s_i, -s_i], at that iterate's singular values (p of the
    last ones). A component's gain is the product of its factors over the iterations; a
    change of independent entries (tests/tolerances.py item 1) spreads evenly over the
    components, so its norm grows by their root mean square (`ns_gain` is their largest,
    bounded loosely). Checked here against float64 Newton-Schulz on random matrices and
    random changes: 20.2 predicted, 19.8 mean and 24.2 largest of 30 measured at 64x64;
    9.3 / 9.3 / 9.6 at 64x128."""
    a, b, c = coefficients
    x = update.double()
    if x.shape[0] > x.shape[1]:
        x = x.T
    rows, cols = x.shape
    s = torch.linalg.svdvals(x / x.norm())
    pair = torch.ones(2, rows, rows, dtype=torch.float64)  # p[s_i, s_j], p[s_i, -s_j]
    extra = torch.ones(rows, dtype=torch.float64)
    for _ in range(steps):
        si = s[:, None]
        for k, sj in enumerate((s[None, :], -s[None, :])):  # the quintic's, no division
            pair[k] *= a + b * (si ** 2 + si * sj + sj ** 2) + c * (
                si ** 4 + si ** 3 * sj + si ** 2 * sj ** 2 + si * sj ** 3 + sj ** 4)
        extra *= a + b * s ** 2 + c * s ** 4
        s = a * s + b * s ** 3 + c * s ** 5
    upper = torch.triu_indices(rows, rows, 1)
    gains = torch.cat([pair[0][upper[0], upper[1]], pair[1][upper[0], upper[1]],
                       torch.diagonal(pair[0]), extra.repeat(cols - rows)])
    return float(gains.square().mean().sqrt())


# A rule's extra move of one tensor in update t (0-based): (name, weight, t, gradient error,
# the rule's own carried state) -> relative distance added.
Mover = Callable[[str, torch.Tensor, int, float, dict], float]


def quantised_mover(run: Run, bits: int, ref_states: list[dict], quantised) -> Mover:
    """Code flips of adamw8bit/4bit; `ref_states[t]` the reference's stored moments after
    step t + 1 (`optim/NAME/exp_avg`, `.../exp_avg_sq`); `quantised(name)` whether NAME's
    moments are quantised."""
    u = update_bound(run.steps, *run.betas)

    def move(name, weight, t, e_grad, carried):
        if t == 0 or not quantised(name):  # the first update reads no stored code
            return 0.0
        key = name.removeprefix("model/")
        for moment, beta, e in (("exp_avg", run.betas[0], e_grad),
                                ("exp_avg_sq", run.betas[1], 2 * e_grad)):  # v ~ g^2
            c = flip_weight(ref_states[t - 1][f"optim/{key}/{moment}"], bits,
                            moment == "exp_avg")
            carried[moment] = math.sqrt(beta * carried.get(moment, 0.0) ** 2 + 2 * e * c)
        step = run.lr * u * math.sqrt(weight.numel()) * (
            carried["exp_avg"] + carried["exp_avg_sq"] / 2)
        return LAMBDA * step / float(weight.norm())

    return move


def muon_mover(run: Run, is_matrix, coefficients, ns_steps: int,
               gains: list[dict[tuple, float]] | None = None) -> Mover:
    """Newton-Schulz's gain on Muon's matrices (one matrix per logical tensor; an expert's
    is its own); `is_matrix(name)` whether Muon (not its AdamW) updates NAME. `gains[t]`,
    {matrix shape: gain}: update t's gain at the reference's own inputs (`ns_gain_rms`, the
    largest over its matrices of that shape); by default the bound over every input and
    every change (`ns_gain`)."""
    worst = ns_gain(coefficients, ns_steps)

    def move(name, weight, t, e_grad, carried):
        if not is_matrix(name):
            return 0.0
        gain = worst if gains is None else gains[t][tuple(weight.shape)]
        step = run.lr * 0.2 * math.sqrt(max(weight.shape)) * 2 * e_grad * gain
        return LAMBDA * step / float(weight.norm())

    return move


def parity_bounds(run: Run, move: Mover, ref_weights: dict, ref_records: list
                  ) -> tuple[dict[str, float], list[float], list[float]]:
    """(each weight tensor's relative bound after the run, each step's loss bound, each
    step's gradient-norm bound); `ref_records` the reference's (loss, gradient norm)."""
    grad0 = grad_rtol(run.tokens, run.depth, run.width)
    trained = trained_rtol(run.tokens, run.depth, run.width)
    total = sum(w.numel() for w in ref_weights.values())
    dist = dict.fromkeys(ref_weights, 0.0)
    carried = {name: {} for name in ref_weights}
    losses, norms = [], []
    for t, (loss, norm) in enumerate(ref_records):
        away = math.sqrt(sum((dist[n] * float(w.norm())) ** 2 for n, w in ref_weights.items()))
        losses.append(loss_rtol(run.tokens, run.depth, run.width)
                      + LAMBDA * norm * away / math.sqrt(total) / loss)
        e_grad = (grad0 if t == 0 else trained) + max(dist.values())
        norms.append(e_grad)
        for name, w in ref_weights.items():
            dist[name] += move(name, w, t, e_grad, carried[name])
    return {n: trained + d for n, d in dist.items()}, losses, norms
