"""NF4 against torchao 0.18's NF4Tensor: bit for bit with torchao's code table, and every
difference explained with the exact QLoRA table."""

import warnings

import pytest
import torch

from fivefold.numerics.intx import unpack_nibbles
from fivefold.numerics.nf4 import (
    NF4_CODES,
    TORCHAO_NF4_CODES,
    dequantize_nf4,
    dequantize_scalers,
    quantize_nf4,
)


def torchao_to_nf4():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nf4_tensor = pytest.importorskip(
            "torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    return nf4_tensor.to_nf4


@pytest.mark.parametrize("shape", [(512, 256), (128, 1024), (64, 64 * 256)])
def test_matches_torchao_bit_for_bit(shape):
    to_nf4 = torchao_to_nf4()
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.02
    w[0, :64] *= 30.0           # one outlier block, as trained weights have
    ref = to_nf4(w, block_size=64, scaler_block_size=256)
    q = quantize_nf4(w, 64, 256, codes=TORCHAO_NF4_CODES)
    assert torch.equal(q.data, ref.quantized_data)
    assert torch.equal(q.scalers, ref.quantized_scalers)
    assert torch.equal(q.factors, ref.quantization_factor)
    assert torch.equal(q.mean, ref.scaler_mean)
    assert torch.equal(dequantize_nf4(q), ref.get_original_weight())


def test_exact_table_differs_from_torchao_only_between_the_two_tables_midpoints():
    """torchao rounds the NF4 quantiles to 4 decimals. With the exact table a code can only
    change where the scaled value lies between a decision boundary (midpoint of neighbouring
    codes) of one table and the same boundary of the other."""
    to_nf4 = torchao_to_nf4()
    torch.manual_seed(1)
    w = torch.randn(1024, 1024)
    ref = to_nf4(w, block_size=64, scaler_block_size=256)
    q = quantize_nf4(w)
    assert torch.equal(q.scalers, ref.quantized_scalers)
    mine, theirs = unpack_nibbles(q.data), unpack_nibbles(ref.quantized_data)
    differ = mine != theirs
    blocks = w.reshape(-1, 64)
    scaled = (blocks / blocks.abs().amax(dim=1, keepdim=True)).reshape(-1)[differ]
    exact, rounded = torch.tensor(NF4_CODES), torch.tensor(TORCHAO_NF4_CODES)
    mid_exact = (exact[1:] + exact[:-1]) / 2
    mid_rounded = (rounded[1:] + rounded[:-1]) / 2
    low, high = torch.minimum(mid_exact, mid_rounded), torch.maximum(mid_exact, mid_rounded)
    between = ((scaled.unsqueeze(-1) >= low) & (scaled.unsqueeze(-1) <= high)).any(dim=-1)
    # about 155 in a million values (144-170 over seeds 0-3): the band between the tables'
    # boundaries holds that share of N(0, 1)/absmax values
    assert 0 < int(differ.sum()) < 3e-4 * w.numel()
    assert bool(between.all())
    # and those codes are neighbours
    assert int((mine[differ].int() - theirs[differ].int()).abs().max()) == 1


def test_double_quantisation_bits_and_scaler_error():
    torch.manual_seed(2)
    w = torch.randn(256, 4096)
    q = quantize_nf4(w)
    # 4 bits + 8/64 + 32/(64*256) (+ one fp32 mean) = 4.127 bits per parameter (QLoRA §3)
    assert q.bits_per_param() == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-4)
    absmax = w.reshape(-1, 64).abs().amax(dim=1)
    stored = dequantize_scalers(q)
    # int8 around the mean with step = 2·max|absmax - mean| / 256 (torchao's factor): error
    # at most half a step, except the block constant at +max, which lands on +128 and is
    # clamped to 127 (a whole step low; bitsandbytes' 127/absmax factor avoids this).
    centred = (absmax - absmax.mean()).reshape(-1, 256)
    step = (2 * centred.abs().amax(dim=1) / 256).unsqueeze(-1)
    error = (stored - absmax).abs().reshape(-1, 256)
    clamped = torch.round(centred / step) == 128
    step = step.expand_as(error)
    assert bool((error[~clamped] <= step[~clamped] / 2 + 1e-6).all())
    assert bool((error[clamped] <= step[clamped] + 1e-6).all())
    assert int(clamped.sum()) >= 1


def test_every_value_takes_its_nearest_code():
    torch.manual_seed(3)
    w = torch.randn(64, 512)
    q = quantize_nf4(w)
    blocks = w.reshape(-1, 64)
    scaled = blocks / blocks.abs().amax(dim=1, keepdim=True)
    codes = unpack_nibbles(q.data).reshape(-1, 64).long()
    table = torch.tensor(NF4_CODES)
    chosen = (scaled - table[codes]).abs()
    best = (scaled.unsqueeze(-1) - table).abs().amin(dim=-1)
    assert torch.equal(chosen, best)


def test_sizes_torchao_refuses_are_padded_with_zeros():
    torch.manual_seed(4)
    w = torch.randn(30, 50)     # 1500 values: neither 64 nor 64·256 divides it
    q = quantize_nf4(w)
    out = dequantize_nf4(q)
    assert out.shape == w.shape
    rel = (out - w).norm() / w.norm()
    assert 0.05 < float(rel) < 0.12      # NF4 on Gaussian weights: about 9% (torchao too)
    # the mean of the block constants is over the 24 real blocks only
    real = torch.cat([w.reshape(-1), w.new_zeros(36)]).reshape(-1, 64).abs().amax(dim=1)
    assert float(q.mean) == pytest.approx(float(real.mean()), rel=1e-6)
    zeros = dequantize_nf4(quantize_nf4(torch.zeros(8, 64)))
    assert torch.equal(zeros, torch.zeros(8, 64))


def test_dequantise_dtype():
    torch.manual_seed(5)
    w = torch.randn(64, 256)
    q = quantize_nf4(w)
    assert torch.equal(dequantize_nf4(q, torch.bfloat16), dequantize_nf4(q).bfloat16())
