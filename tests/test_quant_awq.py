"""AWQ's options: duo scaling (AutoAWQ) and the error measured on the whole decoder layer."""

from __future__ import annotations

import copy

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.numerics.intx import fake_quantize_int4
from fivefold.quant.awq import alpha_grid, apply_awq, scale_for, weight_mean
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
    model = salient_model()
    calib = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    held_out = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(held_out)
    rtn = copy.deepcopy(model)
    quantize_(rtn, "int4")
    awq = copy.deepcopy(model)
    report = apply_awq(awq, calib, group_size=128, clip=False, **options)
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
    report = apply_awq(copy.deepcopy(model), calib, group_size=128, clip=False, loss="layer")
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
    report = apply_awq(scaled, calib, group_size=128, clip=False, **options)
    o_groups = [g for g in report.groups if g.linears == ["self_attn.o_proj"]]
    assert len(o_groups) == 2 and all(g.alpha > 0 for g in o_groups)  # a scale was folded
    with torch.no_grad():
        o_in = scaled.layers[0].self_attn.o_proj.weight / model.layers[0].self_attn.o_proj.weight
        heads = o_in[0].reshape(2, 2, 32)              # (kv head, query head in it, dim)
        assert torch.allclose(heads[:, 0], heads[:, 1])  # one scale per v channel
        assert not torch.allclose(heads[0, 0], torch.ones(32))
        reference, out = model(calib), scaled(calib)
    assert float((out - reference).abs().max() / reference.abs().max()) < 1e-5
