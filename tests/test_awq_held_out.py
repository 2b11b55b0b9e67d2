"""AWQ's held-out choice (quant/awq.py): the calibration sequences are split, α is searched on
one part and each group's scale is chosen, among α = 0 (RTN) and the scale families' best,
by an error measured on the other part."""

from __future__ import annotations

import copy

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.numerics.intx import fake_quantize_int4
from fivefold.quant.awq import apply_awq, split_calibration
from fivefold.quant.convert import quantize_

CFG = ModelConfig(name="h", vocab_size=256, hidden_size=128, intermediate_size=256,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128, init_std=0.05)
QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]

pytestmark = pytest.mark.usefixtures("one_thread")


def planted_model():
    """Three input channels with activations 8-32x the rest, where AWQ has something to
    protect (AWQ §3.1), under grouped-query attention (4 query heads, 2 kv heads)."""
    model = build_model(CFG, seed=1).eval()
    with torch.no_grad():
        model.embed_tokens.weight[:, [3, 50, 77]] *= 8.0
        for layer in model.layers:
            layer.input_layernorm.weight[[3, 50, 77]] *= 4.0
    return model


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(seed))


def test_split_holds_out_evenly_spread_sequences():
    batch = torch.arange(8).unsqueeze(1).expand(8, 3)
    search, held = split_calibration(batch, 0.5)
    assert held[:, 0].tolist() == [1, 3, 5, 7] and search[:, 0].tolist() == [0, 2, 4, 6]
    search, held = split_calibration(batch, 0.25)
    assert held[:, 0].tolist() == [3, 7] and len(search) == 6
    search, held = split_calibration(batch, 0.0)
    assert held is None and search is batch
    with pytest.raises(ValueError, match="cannot be split"):
        split_calibration(batch[:1], 0.5)
    with pytest.raises(ValueError, match=r"held_out must be in \[0, 1\)"):
        split_calibration(batch, 1.0)


@pytest.mark.parametrize("select", ["layer", "logits"])
def test_choice_never_raises_the_held_out_error_over_rtn(select):
    # Every group's choice is measured against alpha = 0 (RTN) on the held-out sequences, so
    # it can only lower that error; on planted outliers some group does pick a scale.
    model = planted_model()
    report = apply_awq(copy.deepcopy(model), tokens(16, 1), group_size=128, held_out=0.5,
                       select=select)
    assert report.held_out == 8
    assert all(g.held_awq <= g.held_rtn for g in report.groups)
    assert any(g.choice != "rtn" and g.held_awq < g.held_rtn for g in report.groups)
    assert {g.choice for g in report.groups} <= {"rtn", "plain", "duo"}
    assert all(g.alpha == 0.0 for g in report.groups if g.choice == "rtn")


def _first_group_rtn_error(model, held: torch.Tensor, select: str) -> float:
    """Layer 0 with q/k/v rounded (nothing else): its output MSE against float, or the KL of
    the model's next-token distributions, computed from the model's own forward."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name in QKV:
            lin = rounded.layers[0].get_submodule(name)
            lin.weight.copy_(fake_quantize_int4(lin.weight, 128))
        if select == "logits":
            ref = torch.log_softmax(model(held), -1)
            out = torch.log_softmax(rounded(held), -1)
            return float((ref.exp() * (ref - out)).sum(-1).mean())
        hidden = model.embed_tokens(held)
        cos, sin = model.rotary(torch.arange(held.shape[1]), hidden.dtype)
        reference = model.layers[0](hidden, cos, sin)
        return float((rounded.layers[0](hidden, cos, sin) - reference).pow(2).mean())


@pytest.mark.parametrize("select", ["layer", "logits"])
def test_held_out_error_is_measured_on_the_held_out_sequences(select):
    # The RTN error the first group's choice is measured against, recomputed independently
    # on the odd sequences (held out at 0.5). Float32 sums over 8 x 32 tokens: rel 1e-4.
    model = planted_model()
    calib = tokens(16, 2)
    report = apply_awq(copy.deepcopy(model), calib, group_size=128, clip=False, held_out=0.5,
                       select=select)
    assert report.groups[0].linears == QKV
    expected = _first_group_rtn_error(model, calib[1::2], select)
    assert report.groups[0].held_rtn == pytest.approx(expected, rel=1e-4)


def test_held_out_choice_beats_rtn_on_unseen_tokens():
    model = planted_model()
    unseen = tokens(8, 3)
    with torch.no_grad():
        reference = model(unseen)
    rtn = copy.deepcopy(model)
    quantize_(rtn, "int4")
    awq = copy.deepcopy(model)
    apply_awq(awq, tokens(16, 4), group_size=128, held_out=0.5)
    quantize_(awq, "awq")
    with torch.no_grad():
        rtn_error = float((rtn(unseen) - reference).pow(2).mean())
        awq_error = float((awq(unseen) - reference).pow(2).mean())
    assert awq_error < 0.5 * rtn_error


def test_unknown_select_is_refused():
    with pytest.raises(ValueError, match="select must be"):
        apply_awq(build_model(CFG, seed=1), tokens(4, 5), held_out=0.5, select="loss")
