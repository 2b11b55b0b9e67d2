"""MXFP4 (OCP MX v1.0, E2M1 with E8M0 block scales) against torchao 0.18's to_mx, and the
rounding rules it must follow."""

import warnings

import pytest
import torch

from fivefold.numerics.intx import unpack_nibbles
from fivefold.numerics.mx import dequantize_mxfp4, e2m1_round, e2m1_value, quantize_mxfp4


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, 100.0, -0.75, -0.1, 0.3])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -0.0, 0.5]
    assert e2m1_value(e2m1_round(x)).tolist() == expected


def test_scale_is_floor_log2_amax_minus_two():
    w = torch.zeros(2, 64)
    w[0, :32] = torch.linspace(-5.0, 5.0, 32)     # amax 5: floor(log2 5) = 2 -> X = 2^0
    w[0, 32:] = 0.3                              # floor(log2 0.3) = -2 -> X = 2^-4
    q = quantize_mxfp4(w)
    assert (q.scale.int() - 127).tolist() == [[0, -4], [-127, -127]]
    assert torch.equal(dequantize_mxfp4(q)[1], torch.zeros(64))   # all-zero blocks
    assert q.nbytes() * 8 / w.numel() == 4.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torchao_to_mx_bit_for_bit(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-3, 3, 64).unsqueeze(1)
    w[3, :32] = 0.0
    w[4, :9] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 4.0])  # ties
    w = w.to(dtype)
    scale, data = mx_tensor.to_mx(w, torch.float4_e2m1fn_x2, 32)
    q = quantize_mxfp4(w)
    assert torch.equal(q.scale, scale.view(torch.uint8))
    # torchao packs the first value in the low nibble, fivefold in the high one: compare codes
    theirs = kernels.unpack_uint4(data.view(torch.uint8)).reshape(64, 256)
    assert torch.equal(unpack_nibbles(q.data), theirs)


def test_block_must_divide_k():
    with pytest.raises(ValueError, match="MX block size 32 must be even and divide"):
        quantize_mxfp4(torch.randn(4, 48))
