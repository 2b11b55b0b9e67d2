"""The parity tolerances of tests/tolerances.py hold for a real reordering and still catch
the bugs they exist for. On nano (2 blocks, hidden 32, ffn 64), 16 sequences of 16 tokens:
the gradient of the whole batch and of 4 accumulated micro-batches (another summation order)
each lie within the one-run bound of the float64 gradient and within grad_rtol of each
other; a 2× scale, a missing micro-batch and one bf16 rounding of the gradient do not."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import U32, grad_rtol, loss_rtol

from fivefold.models.init import build_model
from fivefold.models.presets import preset

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, SEQ, MICRO = 16, 16, 4


def gradients(model, tokens, micro: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    total, tokens_all = 0.0, BATCH * SEQ
    for chunk in tokens.chunk(micro):
        loss = model(chunk[:, :-1], chunk[:, 1:]) / tokens_all
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_bounds_hold_for_a_reordering_and_catch_bugs():
    torch.manual_seed(0)
    cfg = preset("nano")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ + 1))
    loss_whole, whole = gradients(model, tokens, 1)
    loss_micro, micro = gradients(model, tokens, MICRO)
    loss_exact, exact = gradients(model.double(), tokens, 1)
    bound = grad_rtol(tokens=BATCH * SEQ, depth=3 * cfg.num_layers)
    assert abs(loss_whole - loss_micro) / loss_exact <= loss_rtol(BATCH * SEQ, 6)
    for name, g in whole.items():
        assert rel(g, micro[name]) <= bound, (name, rel(g, micro[name]), bound)
        for run in (g, micro[name]):  # each run alone: the bound of one, 1/√2 of the pair's
            assert rel(run, exact[name]) <= bound / math.sqrt(2), name
    # What the parity tests exist to catch, every one far outside the bound:
    big = [n for n, g in whole.items() if g.numel() >= 1024]
    for name in big:
        assert rel(2 * whole[name], micro[name]) > 100 * bound  # summed, not averaged
        bf16 = whole[name].bfloat16().float()  # one rounding to 8 significant bits
        assert rel(bf16, micro[name]) > 4 * bound, (name, rel(bf16, micro[name]), bound)
    model.float()
    _, three = gradients(model, tokens[: BATCH * 3 // 4], 3)  # a micro-batch left out
    assert all(rel(three[n], micro[n]) > 100 * bound for n in big)
    assert bound < 2**-9 and U32 == 2.0**-24
