"""Error-compensating rounding (GPTQ) onto the int4 grid that round-to-nearest would use.

GPTQ (Frantar et al., ICLR 2023, arXiv 2210.17323, Algorithm 1; reference code
IST-DASLab/gptq `gptq.py` `fasterquant`) rounds a linear's weight one input column at a
time and moves each column's rounding error onto the columns not yet rounded, weighted by
the inverse Hessian of the layer's squared output error, H = 2 X^T X / n (X: the linear's
calibration inputs, n rows):

    for column i:  q_i = quant(w_i);  e = (w_i - q_i) / [H^-1]_ii
                   w_j -= e · [H^-1]_ij   for j > i

with H^-1 taken as the upper Cholesky factor of (H + λI)^-1 (λ = 1% of mean diag H, the
reference's `percdamp`), in blocks of 128 columns (the lazy batch update of §4, "Step 2").
Channels that never see a nonzero input (diag H = 0) get H_ii = 1 and weight 0, as there.
With groups (the reference's `groupsize`), a group's scale and zero point are computed from
its columns' current values when the pass reaches the group's first column.

AWQ composes with it (arXiv 2306.00978, §5 "AWQ is orthogonal to GPTQ", Table 6): the AWQ
scales and clip are folded into the float weights first, then GPTQ rounds them, using the
inputs the scaled linears see (x / s).

One change to the reference, so that the result is an ordinary float weight that
`fivefold quantize` stores exactly: round to nearest recomputes each group's scale and zero
from the group's min and max, so in every (row, group) the element that held the minimum
when the group's grid was set is given code 0 and the one that held the maximum code
2^b - 1 (a symmetric grid: the largest |w| gets code ±7). The group then spans its grid's
ends exactly and round to nearest reproduces every code (`tests/test_gptq.py`); GPTQ
compensates these two forced roundings like any other.
"""

from __future__ import annotations

import torch

from fivefold.numerics.formats import INT4_LEVELS, INT4_SYM_OFFSET
from fivefold.numerics.intx import int4_scale_zero

DAMP = 0.01          # the reference's percdamp: λ = 1% of the mean of diag H
BLOCK = 128          # columns per lazy batch update (rounded to whole groups)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X^T X / n over the rows of x (..., in_features), float64."""
    x = x.reshape(-1, x.shape[-1]).double()
    return 2 * x.T @ x / x.shape[0]


def _grid(w: torch.Tensor, group_size: int, symmetric: bool, levels: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, zero, low code position, high code position) per row of one group w (rows,
    group_size): the grid round to nearest computes from these values, and the column
    holding each row's min and max (symmetric: max |w|, both)."""
    scale, zero = int4_scale_zero(w, group_size, symmetric, levels)
    scale = scale[:, 0]
    if symmetric:
        top = w.abs().argmax(dim=1)
        return scale, torch.zeros_like(scale), top, top
    return scale, zero[:, 0], w.argmin(dim=1), w.argmax(dim=1)


@torch.no_grad()
def gptq_round(weight: torch.Tensor, h: torch.Tensor, group_size: int,
               symmetric: bool = False, levels: int = INT4_LEVELS, damp: float = DAMP,
               block: int = BLOCK) -> torch.Tensor:
    """The weight (out, in) rounded by GPTQ onto per-(row, group) int4 grids, returned as
    float values on those grids (same dtype); `h` is `hessian` of the linear's inputs."""
    if symmetric and levels != INT4_LEVELS:
        raise ValueError("fewer levels than int4's are emulated asymmetrically only")
    w = weight.detach().double().clone()
    columns = w.shape[1]
    if columns % group_size:
        raise ValueError(f"group size {group_size} does not divide {columns} columns")
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(columns, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    block = group_size * max(1, block // group_size)    # no group straddles two blocks
    q = torch.zeros_like(w)
    scale = zero = low = high = None
    for start in range(0, columns, block):
        end = min(start + block, columns)
        errors = torch.zeros(w.shape[0], end - start, dtype=w.dtype)
        for i in range(start, end):
            if i % group_size == 0:
                scale, zero, low, high = _grid(w[:, i:i + group_size].float(), group_size,
                                               symmetric, levels)
                scale, zero = scale.double(), zero.double()
                low, high = low + i, high + i
            column = w[:, i]
            code = torch.round(column / scale) + zero
            if symmetric:
                # -8 stays unused, as in round to nearest: |code| > 7 would widen the grid
                code = code.clamp(1 - INT4_SYM_OFFSET, INT4_SYM_OFFSET - 1)
                code = torch.where(high == i, torch.sign(column) * (INT4_SYM_OFFSET - 1), code)
            else:
                code = code.clamp(0, levels)
                code = torch.where(low == i, torch.zeros_like(code), code)
                code = torch.where(high == i, torch.full_like(code, levels), code)
            q[:, i] = (code - zero) * scale
            error = (column - q[:, i]) / hinv[i, i]
            w[:, i:end] -= error.unsqueeze(1) * hinv[i, i:end].unsqueeze(0)
            errors[:, i - start] = error
        w[:, end:] -= errors @ hinv[start:end, end:]
    return q.to(weight.dtype)
