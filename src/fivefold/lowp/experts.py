"""Routed experts with FP8 GEMMs.

`GroupedExperts` runs each projection as one grouped matmul over the experts' token groups.
Its FP8 form runs the same three projections per expert with the FP8 linear
(lowp/linear.py), so each expert's weight gets its own scales (per tensor, per row or per
128x128 block) and each expert's tokens their own tiles: a grouped FP8 GEMM with per-group
scales, as DeepSeek-V3 runs its experts (arXiv 2412.19437 §3.3), written as a loop (a fused
grouped FP8 kernel is a GPU speed-up that would compute the same numbers). The router and
the combine stay in fp32/bf16 (moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.models.moe import GroupedExperts


class FP8ExpertsMixin:
    """Put before a GroupedExperts class (or subclass, e.g. expert parallelism's) in the
    bases: its expert GEMMs run in FP8 (models get it by a class swap: lowp.convert)."""

    fp8_recipe: FP8Recipe = FP8Recipe()

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        r = self.fp8_recipe
        outs = []
        for e, rows in enumerate(x_sorted.split(counts.tolist())):
            if rows.shape[0] == 0:  # no tokens: nothing to quantise (an empty amax)
                outs.append(rows.new_zeros(0, self.hidden))
                continue
            h = F.silu(fp8_linear(rows, self.w_gate[e], None, r)) * fp8_linear(
                rows, self.w_up[e], None, r)
            outs.append(fp8_linear(h, self.w_down[e], None, r))
        return torch.cat(outs) if outs else x_sorted.new_zeros(0, self.hidden)


class FP8GroupedExperts(FP8ExpertsMixin, GroupedExperts):
    """GroupedExperts with FP8 expert GEMMs."""
