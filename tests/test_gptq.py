"""GPTQ rounding (quant/gptq.py) and AWQ followed by it (apply_awq(rounding="gptq"))."""

from __future__ import annotations

import copy

import pytest
import torch

from fivefold.numerics.intx import fake_quantize_int4, int4_scale_zero
from fivefold.quant.awq import apply_awq
from fivefold.quant.convert import quantize_
from fivefold.quant.gptq import gptq_round, hessian
from tests.test_quant_awq import held_out_setup, salient_model

pytestmark = pytest.mark.usefixtures("one_thread")


def planted_layer(seed: int = 0):
    """A toy linear (32 rows, 256 inputs) whose inputs are correlated and carry one planted
    outlier channel 20x the rest, and two draws of such inputs: calibration and held-out."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 256, generator=gen) * 0.1
    mix = torch.randn(256, 256, generator=gen) * 0.3

    def inputs(n):
        x = torch.randn(n, 256, generator=gen) @ mix + torch.randn(n, 256, generator=gen)
        x[:, 7] *= 20
        return x

    return w, inputs(2048), inputs(1024)


def output_error(x, w, q):
    return float((x @ (q - w).T).pow(2).mean())


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [64, 128])
def test_gptq_lands_on_the_grid_rtn_reproduces_and_beats_rtn_held_out(symmetric, group):
    w, calib, held = planted_layer()
    q = gptq_round(w, hessian(calib), group, symmetric)
    # Round to nearest recomputes each group's grid from q's min and max: every value is
    # reproduced. A changed code would move a value by a whole step (the group's scale);
    # what remains is fp32 rounding of k·scale (k <= 15, a few ulps), bound 1e-5 steps.
    scale = int4_scale_zero(q, group, symmetric)[0].repeat_interleave(group, dim=1)
    assert bool(((fake_quantize_int4(q, group, symmetric) - q).abs() <= 1e-5 * scale).all())
    # On inputs it did not see, the output error is well below round to nearest's (measured
    # 0.37-0.41x here; bound 0.6x).
    rtn = fake_quantize_int4(w, group, symmetric)
    assert output_error(held, w, q) < 0.6 * output_error(held, w, rtn)


def test_gptq_leaves_a_dead_input_channel_at_zero():
    w, calib, _ = planted_layer()
    calib[:, 3] = 0
    q = gptq_round(w, hessian(calib), 128)
    assert bool((q[:, 3] == 0).all())


def test_awq_with_gptq_rounding_is_what_quantize_stores_and_beats_rtn_held_out():
    model, calib, held_out, reference, rtn = held_out_setup()
    awq_rtn = copy.deepcopy(model)
    apply_awq(awq_rtn, calib, group_size=128, rounding="rtn")
    quantize_(awq_rtn, "awq")
    rounded = copy.deepcopy(model)
    report = apply_awq(rounded, calib, group_size=128, rounding="gptq")
    assert len(report.gptq) == 2 * 7 and "rounded by GPTQ" in report.summary()
    stored = copy.deepcopy(rounded)
    quantize_(stored, "awq")
    with torch.no_grad():
        # The int4 checkpoint holds GPTQ's rounding: same logits up to fp32 rounding of the
        # grid values (a few ulps of each weight) through 2 layers.
        out = stored(held_out)
        torch.testing.assert_close(out, rounded(held_out), rtol=0, atol=1e-4)
        errors = {name: float((m(held_out) - reference).pow(2).mean())
                  for name, m in (("rtn", rtn), ("awq", awq_rtn), ("gptq", stored))}
    assert errors["gptq"] < 0.5 * errors["rtn"], errors
    assert errors["gptq"] < errors["awq"], errors


def test_unknown_rounding_is_refused():
    with pytest.raises(ValueError, match="rounding must be"):
        apply_awq(salient_model(), torch.zeros(1, 8, dtype=torch.long), rounding="nearest")
