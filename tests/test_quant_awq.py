"""AWQ's options: duo scaling (AutoAWQ) and the error measured on the whole decoder layer."""

from __future__ import annotations

import copy

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.numerics.intx import fake_quantize_int4
from fivefold.quant.awq import (
    alpha_grid,
    apply_awq,
    apply_clip,
    scale_for,
    search_clip,
    weight_mean,
)
from fivefold.quant.convert import quantize_

CFG = ModelConfig(name="q", vocab_size=256, hidden_size=128, intermediate_size=256,
                  num_layers=2, num_heads=4, num_kv_heads=4, max_seq_len=128, init_std=0.05)

pytestmark = pytest.mark.usefixtures("one_thread")


def salient_model():
    """Three input channels with activations 8-32x the rest (AWQ §3.1)."""
    model = build_model(CFG, seed=1).eval()
    with torch.no_grad():
        model.embed_tokens.weight[:, [3, 50, 77]] *= 8.0
        for layer in model.layers:
            layer.input_layernorm.weight[[3, 50, 77]] *= 4.0
    return model

def held_out_setup():
    """The salient model, 16 calibration and 8 held-out sequences (other seeds), the model's
    held-out output, and its int4 RTN copy."""
    model = salient_model()
    calib = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    held_out = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(held_out)
    rtn = copy.deepcopy(model)
    quantize_(rtn, "int4")
    return model, calib, held_out, reference, rtn


def test_weight_mean_is_taken_after_grouping():
    # Two linears of 2 rows, K = 4, groups of 2: each group is divided by its own max |w|,
    # then the 4 rows are averaged per input channel.
    a, b = torch.nn.Linear(4, 2, bias=False), torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.tensor([[1.0, -2.0, 3.0, 6.0], [4.0, 4.0, -1.0, 0.5]]))
        b.weight.copy_(torch.tensor([[0.0, 8.0, 2.0, -2.0], [1.0, 1.0, 5.0, 10.0]]))
    expected = torch.tensor([
        (0.5 + 1.0 + 0.0 + 1.0) / 4, (1.0 + 1.0 + 1.0 + 1.0) / 4,
        (0.5 + 1.0 + 1.0 + 0.5) / 4, (1.0 + 0.5 + 1.0 + 1.0) / 4])
    torch.testing.assert_close(weight_mean([a, b], 2), expected, rtol=1e-5, atol=1e-6)


def test_duo_scale_formula():
    x_mean = torch.tensor([0.5, 2.0, 8.0, 1.0])
    w_mean = torch.tensor([0.9, 0.3, 0.6, 0.5])
    alpha = 0.35
    s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)
    s = s / (s.max() * s.min()).sqrt()
    torch.testing.assert_close(scale_for(x_mean, w_mean, alpha), s)
    # Without w_mean it is llm-awq's s = mean|x|^alpha, and alpha = 0 gives s = 1 (RTN).
    torch.testing.assert_close(scale_for(x_mean, None, 0.0), torch.ones(4))
    assert float(scale_for(x_mean, w_mean, 0.0)[0]) != 1.0


@pytest.mark.parametrize("options", [{"duo": True}, {"loss": "layer"},
                                     {"duo": True, "loss": "layer"}])
def test_options_never_worse_than_rtn_and_beat_it_held_out(options):
    model, calib, held_out, reference, rtn = held_out_setup()
    awq = copy.deepcopy(model)
    report = apply_awq(awq, calib, group_size=128, clip=False, rounding="rtn", **options)
    # Plain RTN is measured and kept when no scale beats it, so on the calibration data the
    # choice is never worse; some group does pick a scale.
    assert all(g.error_awq <= g.error_rtn for g in report.groups)
    assert any(g.error_awq < g.error_rtn for g in report.groups)
    quantize_(awq, "awq")
    with torch.no_grad():
        rtn_error = float((rtn(held_out) - reference).pow(2).mean())
        awq_error = float((awq(held_out) - reference).pow(2).mean())
    assert awq_error < 0.5 * rtn_error


def test_layer_loss_measures_the_decoder_layer_output():
    # With loss="layer" the reported RTN error of every group is the MSE of the first layer's
    # output with that group's linears rounded, computed here independently.
    model = salient_model()
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    layer = model.layers[0]
    hidden = model.embed_tokens(calib)
    cos, sin = model.rotary(torch.arange(calib.shape[1]), hidden.dtype)
    with torch.no_grad():
        reference = layer(hidden, cos, sin)
        names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        originals = {n: layer.get_submodule(n).weight.clone() for n in names}
        for n in names:
            layer.get_submodule(n).weight.copy_(fake_quantize_int4(originals[n], 128, False))
        expected = float((layer(hidden, cos, sin) - reference).pow(2).mean())
        for n in names:
            layer.get_submodule(n).weight.copy_(originals[n])
    report = apply_awq(copy.deepcopy(model), calib, group_size=128, clip=False, loss="layer",
                       held_out=0)
    assert report.groups[0].linears == names
    assert report.groups[0].error_rtn == pytest.approx(expected, rel=1e-5)


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="loss must be"):
        apply_awq(build_model(CFG, seed=1), torch.zeros(1, 8, dtype=torch.long), loss="logits")


def test_alpha_grid_is_llm_awqs():
    """llm-awq and AutoAWQ try ratio = i / n_grid for i in range(n_grid): 0 (RTN) to 0.95."""
    grid = alpha_grid(20)
    assert len(grid) == 20 and grid[0] == 0.0 and grid[-1] == 0.95
    assert all(abs(b - a - 0.05) < 1e-12 for a, b in zip(grid, grid[1:]))


@pytest.mark.parametrize("options", [{}, {"duo": True}])
def test_grouped_query_attention_folds_v_into_o_exactly(options):
    # Under GQA (4 query heads, 2 kv heads) o_proj's input repeats each v channel for the two
    # query heads that read it: AWQ scales it with one scale per v channel and folds it into
    # v_proj's rows. Without clipping the float function is unchanged up to the rounding of
    # w·s and w/s (~6e-8 relative each, a few per path; measured ~2e-7 of the largest
    # logit), bound 1e-5. Duo scaling ties its weight means the same way.
    cfg = ModelConfig(name="g", vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128,
                      init_std=0.05)
    model = build_model(cfg, seed=1).eval()
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(4))
    scaled = copy.deepcopy(model)
    report = apply_awq(scaled, calib, group_size=128, clip=False, held_out=0, rounding="rtn",
                       **options)
    o_groups = [g for g in report.groups if g.linears == ["self_attn.o_proj"]]
    assert len(o_groups) == 2 and all(g.alpha > 0 for g in o_groups)  # a scale was folded
    with torch.no_grad():
        o_in = scaled.layers[0].self_attn.o_proj.weight / model.layers[0].self_attn.o_proj.weight
        heads = o_in[0].reshape(2, 2, 32)              # (kv head, query head in it, dim)
        assert torch.allclose(heads[:, 0], heads[:, 1])  # one scale per v channel
        assert not torch.allclose(heads[0, 0], torch.ones(32))
        reference, out = model(calib), scaled(calib)
    assert float((out - reference).abs().max() / reference.abs().max()) < 1e-5


def _partial_error(x, w, q, group):
    """Per (output row, group) mean squared error of the partial products x_g · w_g."""
    xg = x.reshape(x.shape[0], -1, group).transpose(0, 1)              # groups, t, g
    wg, qg = w.reshape(w.shape[0], -1, group), q.reshape(q.shape[0], -1, group)
    diff = torch.bmm(xg, (qg - wg).permute(1, 2, 0))                   # groups, t, out
    return diff.pow(2).mean(1).transpose(0, 1)                         # out, groups


@pytest.mark.parametrize("symmetric", [False, True])
def test_clip_search_cuts_the_error_of_a_planted_outlier_and_never_raises_it(symmetric):
    # A toy linear (16 rows, 2 groups of 128, weights ~N(0, 0.1)): row 0 of group 0 gets one
    # weight of 0.4, 4 standard deviations and ~1.5x the largest of the rest, which stretches
    # the int4 grid over its group. The search sees every token (tokens = all 256), so per
    # (row, group) its calibration error is the minimum over the ratios tried, r = 1 (no
    # clip) included.
    gen = torch.Generator().manual_seed(0)
    group = 128
    w = torch.randn(16, 256, generator=gen) * 0.1
    w[0, 5] = 0.4
    x = torch.randn(256, 256, generator=gen)

    def quantize(t):
        return fake_quantize_int4(t, group, symmetric)

    low, high = search_clip(x, w, quantize, group, tokens=256,
                            mode="absmax" if symmetric else "range")
    clipped = w.clone()
    apply_clip(clipped, low, high, group)
    plain = _partial_error(x, w, quantize(w), group)
    after = _partial_error(x, w, quantize(clipped), group)
    # Never above no clipping, up to float32 summation order (bmm of 128 products, ~1e-6).
    assert bool((after <= plain * (1 + 1e-5) + 1e-12).all()), (after - plain).max()
    # The planted group is clipped (its range shrinks) and its error falls clearly.
    assert float(high[0, 0]) < float(w[0, :group].max())
    assert float(after[0, 0]) < 0.9 * float(plain[0, 0]), (after[0, 0], plain[0, 0])
    # The whole layer's output error falls too.
    total = (x @ (quantize(clipped) - w).T).pow(2).mean()
    assert float(total) < float((x @ (quantize(w) - w).T).pow(2).mean())
