"""Quantised linear layers against a float64 dequantise-then-matmul reference built from
their buffers by the format's definition, and their gradients through the input."""

import pytest
import torch
from torch import nn

from fivefold.numerics.nf4 import NF4_CODES
from fivefold.quant.linear import Int4Linear, Int8Linear, MXFP4Linear, NF4Linear


def unpack64(packed):
    """uint8 (..., m) -> float64 codes (..., 2m), first of a pair in the high nibble."""
    p = packed.long()
    return torch.stack([p // 16, p % 16], dim=-1).flatten(-2).double()


def reference_weight(layer):
    """The weight in float64 from the stored buffers, written from each format's formula."""
    if isinstance(layer, Int8Linear):
        return layer.weight_int8.double() * layer.weight_scale.double().unsqueeze(-1)
    if isinstance(layer, Int4Linear):
        codes = unpack64(layer.qweight).reshape(layer.out_features, -1, layer.group_size)
        zero = 8.0 if layer.qzeros is None else layer.qzeros.double().unsqueeze(-1)
        w = (codes - zero) * layer.scales.double().unsqueeze(-1)
        return w.reshape(layer.out_features, layer.in_features)
    if isinstance(layer, NF4Linear):
        values = torch.tensor(NF4_CODES, dtype=torch.float64)[unpack64(layer.nf4_data).long()]
        absmax = (layer.nf4_scalers.double().reshape(-1, 256)
                  / layer.nf4_factors.double().unsqueeze(-1)).reshape(-1)
        absmax = absmax + layer.nf4_mean.double()
        w = values.reshape(-1, 64) * absmax[: values.numel() // 64].unsqueeze(-1)
        return w.reshape(-1)[: layer.out_features * layer.in_features].reshape(
            layer.out_features, layer.in_features)
    if isinstance(layer, MXFP4Linear):
        codes = unpack64(layer.qweight).long()
        table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
        values = torch.where(codes >= 8, -table[codes % 8], table[codes % 8])
        scale = 2.0 ** (layer.scales_e8m0.double() - 127)
        w = values.reshape(layer.out_features, -1, 32) * scale.unsqueeze(-1)
        return w.reshape(layer.out_features, layer.in_features)
    raise TypeError(layer)


LAYERS = {
    "int8": Int8Linear.from_float,
    "int4": Int4Linear.from_float,
    "int4-sym-g64": lambda lin: Int4Linear.from_float(lin, group_size=64, symmetric=True),
    "nf4": NF4Linear.from_float,
    "mxfp4": MXFP4Linear.from_float,
}
# Relative output error of each format against the float layer on Gaussian weights (a sanity
# bound, loose on purpose: the oracle is the float64 reference, not the float layer).
FORMAT_ERROR = {"int8": 0.01, "int4": 0.1, "int4-sym-g64": 0.12, "nf4": 0.12, "mxfp4": 0.2}


@pytest.mark.parametrize("name", list(LAYERS))
def test_forward_and_input_gradient_match_float64_reference(name):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    layer = LAYERS[name](linear)
    assert list(layer.parameters()) == []          # frozen: buffers only
    w64 = reference_weight(layer)
    x = torch.randn(4, 7, 256, requires_grad=True)
    y = layer(x)
    y64 = x.double() @ w64.T + layer.bias.double()
    # fp32 GEMM over K = 256 against float64: 1e-5 relative to the output's scale
    assert (y.double() - y64).abs().max() <= 1e-5 * y64.abs().max()
    grad = torch.randn_like(y)
    y.backward(grad)
    g64 = grad.double() @ w64
    assert (x.grad.double() - g64).abs().max() <= 1e-5 * g64.abs().max()
    ref = linear(x)
    assert float((y - ref).detach().norm() / ref.detach().norm()) < FORMAT_ERROR[name]


@pytest.mark.parametrize("name", ["int8", "int4", "nf4", "mxfp4"])
def test_bf16_input_computes_in_bf16(name):
    torch.manual_seed(1)
    layer = LAYERS[name](nn.Linear(128, 64, bias=False))
    x = torch.randn(5, 128)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    y64 = x.bfloat16().double() @ reference_weight(layer).T
    # the weight rounds to bf16 (2^-9 relative) and the GEMM accumulates in fp32
    assert (y.double() - y64).abs().max() <= 2e-2 * y64.abs().max()


def test_an_adapter_trains_on_a_frozen_quantised_base():
    torch.manual_seed(2)
    base = NF4Linear.from_float(nn.Linear(128, 64, bias=False))
    down, up = nn.Linear(128, 4, bias=False), nn.Linear(4, 64, bias=False)
    nn.init.normal_(up.weight, std=0.02)
    x = torch.randn(8, 128)
    loss = (base(x) + up(down(x))).square().mean()
    loss.backward()
    assert down.weight.grad is not None and up.weight.grad.abs().sum() > 0
    assert all(not b.requires_grad for b in base.buffers())


def test_state_dict_round_trips_into_an_empty_layer():
    torch.manual_seed(3)
    linear = nn.Linear(256, 32)
    for name, make in LAYERS.items():
        layer = make(linear)
        kwargs = {"group_size": 64, "symmetric": True} if name == "int4-sym-g64" else {}
        empty = type(layer)(256, 32, True, **kwargs)
        empty.load_state_dict(layer.state_dict())
        assert torch.equal(empty.dequantize(), layer.dequantize())


def test_bytes_held():
    linear = nn.Linear(1024, 256, bias=False)
    assert Int8Linear.from_float(linear).quantized_bytes() == 256 * 1024 + 4 * 256
    # codes + fp32 scale + uint8 zero per group of 128
    assert Int4Linear.from_float(linear).quantized_bytes() == 256 * 512 + 5 * 256 * 8
    nf4_bytes = NF4Linear.from_float(linear).quantized_bytes()
    assert nf4_bytes == 256 * 512 + 4096 + 4 * 16 + 4 + 4 * 16   # + the 16-entry code table
    assert MXFP4Linear.from_float(linear).quantized_bytes() == 256 * 512 + 256 * 32
