"""int8 per channel and int4 groupwise: codes, bounds and packing against the formulas
written out in float64."""

import pytest
import torch

from fivefold.numerics.intx import (
    dequantize_int4,
    dequantize_int8,
    fake_quantize_int4,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)


def weights(rows=48, cols=256, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(rows, cols) * 0.05
    w[:, 7] *= 20.0            # an outlier input channel, as in trained LLMs
    w[3] = 0.0                 # an all-zero row must not divide by zero
    return w


def test_nibble_order_and_round_trip():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x12, 0xF0]]      # first value, high nibble
    many = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(many)), many)


def test_int8_per_channel_against_float64_formula():
    w = weights()
    q = quantize_int8(w)
    w64 = w.double()
    scale = w64.abs().amax(dim=1) / 127
    expected = torch.round(w64 / scale.clamp_min(1e-12).unsqueeze(-1)).clamp(-127, 127)
    expected[3] = 0
    assert torch.equal(q.data.long(), expected.long())
    assert torch.allclose(q.scale[torch.arange(48) != 3].double(), scale[torch.arange(48) != 3],
                          rtol=1e-6, atol=0)
    error = (dequantize_int8(q) - w).abs()
    assert bool((error <= q.scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all())
    assert int(q.data.abs().amax(dim=1)[0]) == 127        # each row's absmax hits ±127
    assert torch.equal(dequantize_int8(q)[3], torch.zeros(256))
    assert q.nbytes() == 48 * 256 + 4 * 48


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_against_float64_formula(symmetric, group_size):
    w = weights()
    q = quantize_int4(w, group_size=group_size, symmetric=symmetric)
    groups = w.double().reshape(48, -1, group_size)
    if symmetric:
        scale = (groups.abs().amax(-1) / 7).clamp_min(1e-5 / 7)
        codes = torch.round(groups / scale.unsqueeze(-1)).clamp(-8, 7)
        deq = codes * scale.unsqueeze(-1)
        assert q.zero is None
    else:
        high, low = groups.amax(-1), groups.amin(-1)
        scale = (high - low).clamp_min(1e-5) / 15
        zero = torch.round(-low / scale).clamp(0, 15)
        codes = (torch.round(groups / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, 15)
        deq = (codes - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
        assert torch.equal(q.zero.long(), zero.long())
    assert q.scale.shape == (48, 256 // group_size)
    assert torch.allclose(q.scale.double(), scale, rtol=1e-6, atol=0)
    assert q.data.shape == (48, 128) and q.data.dtype == torch.uint8
    out = dequantize_int4(q).double()
    assert torch.allclose(out, deq.reshape(48, 256), rtol=0, atol=1e-6)
    # every value is within one step of its group's grid; inside the grid, half a step
    step = scale.unsqueeze(-1).expand_as(groups).reshape(48, 256)
    assert bool(((out - w.double()).abs() <= step * (1 + 1e-5)).all())
    assert torch.equal(fake_quantize_int4(w, group_size, symmetric), dequantize_int4(q))


def test_int4_asymmetric_is_tighter_than_symmetric_on_shifted_weights():
    w = weights() + 0.03       # a group whose values are not centred on 0
    asym = (dequantize_int4(quantize_int4(w)) - w).norm()
    sym = (dequantize_int4(quantize_int4(w, symmetric=True)) - w).norm()
    assert asym < sym


def test_group_size_must_divide_k():
    with pytest.raises(ValueError, match="group size 100 must be even and divide"):
        quantize_int4(torch.randn(4, 256), group_size=100)


def test_fewer_levels_emulate_fewer_bits():
    """levels = 2^b - 1: each group of the result takes at most 2^b values, spanning the
    group's range; 15 is int4 itself; symmetric fewer-level grids are refused."""
    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(fake_quantize_int4(w, 128, levels=15), fake_quantize_int4(w, 128))
    three = fake_quantize_int4(w, 128, levels=7).reshape(6, 2, 128)
    assert max(len(torch.unique(g)) for g in three.reshape(12, 128)) <= 8
    groups = w.reshape(6, 2, 128)
    step = (groups.amax(-1) - groups.amin(-1)) / 7
    assert ((three - groups).abs().amax(-1) <= step / 2 + 1e-6).all()
    with pytest.raises(ValueError):
        fake_quantize_int4(w, 128, symmetric=True, levels=7)
