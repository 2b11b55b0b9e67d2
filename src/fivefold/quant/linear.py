"""Frozen weight-only quantised linear layers: packed weights and scales held as buffers.

Each class keeps exactly what its format stores (numerics/intx.py, nf4.py, mx.py) as
buffers, so `state_dict()` is the quantised checkpoint, and has no parameters: nothing here
trains. Gradients flow through the input (`DequantLinear` below), so an adapter such as
LoRA can train on top of a frozen quantised base (QLoRA).

Compute on CPU is dequantise-then-matmul: the weight is expanded to the input's dtype, used
by one GEMM and dropped. Backward dequantises again instead of keeping the expanded weight,
so a layer costs its packed bytes between forward and backward (torchao's `LinearNF4` does
the same).

What a GPU kernel does instead: it never writes the expanded weight to memory. A
weight-only kernel (AWQ's GEMM/GEMV, Marlin for int4, bitsandbytes' gemv_4bit for NF4)
loads the packed codes and the group's scale (and zero) into registers, expands them there
to fp16/bf16 and feeds the tensor cores (or, at batch 1, a fused GEMV), so weight traffic
from HBM falls 4x (int4) or 2x (int8) against bf16; decoding, which is bound by that
traffic, speeds up by close to that ratio. int8 can also run as a true int8×int8 GEMM with
per-token activation scales (LLM.int8(), SmoothQuant). MXFP4 needs no expansion at all on
hardware with block-scaled FP4 tensor cores (NVIDIA Blackwell), which take E2M1 codes and
E8M0 scales directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.numerics import intx, mx, nf4


class DequantLinear(torch.autograd.Function):
    """y = x Wᵀ with W dequantised from `layer` in forward and again in backward; the
    weight gets no gradient (it is frozen), the input does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.layer.dequantize(grad.dtype), None


class QuantLinear(nn.Module):
    """Base: in/out features, an optional bias buffer, and a forward that dequantises."""

    method = ""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (fp32), for code that reads `.weight` (e.g. a tied head
        or an export); computing with it costs a full-size copy."""
        return self.dequantize(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            y = DequantLinear.apply(x, self)
        else:
            y = F.linear(x, self.dequantize(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the buffers; `.to(dtype)` / `.bfloat16()` leave their stored
        dtypes alone (a bf16 scale or code table would change the format), so a quantised
        model cast to bf16 computes in bf16 from exactly the stored values."""
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(fn(buf).device)
        return self

    def quantized_bytes(self) -> int:
        """Bytes of the buffers that hold the weight (bias excluded)."""
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers()
                   if name != "bias")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method}")

    @staticmethod
    def _copy_bias(layer: QuantLinear, linear: nn.Linear) -> None:
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach().float())


class Int8Linear(QuantLinear):
    """int8 per output channel (symmetric): `weight_int8` (out, in) and `weight_scale`
    (out,), fp32."""

    method = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features,
                                                        dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))

    def quantized(self) -> intx.Int8:
        return intx.Int8(data=self.weight_int8, scale=self.weight_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return intx.dequantize_int8(self.quantized(), dtype)

    @classmethod
    @torch.no_grad()
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None)
        q = intx.quantize_int8(linear.weight)
        layer.weight_int8.copy_(q.data)
        layer.weight_scale.copy_(q.scale)
        cls._copy_bias(layer, linear)
        return layer.to(linear.weight.device)


class Int4Linear(QuantLinear):
    """int4 groupwise along the input dimension: `qweight` (out, in/2) two codes per byte,
    `scales` (out, in/group_size) fp32, `qzeros` (out, in/group_size) uint8 when
    asymmetric (absent when symmetric: the zero point is 8)."""

    method = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group_size: int = intx.DEFAULT_GROUP_SIZE, symmetric: bool = False):
        super().__init__(in_features, out_features, bias)
        intx.check_group_size(in_features, group_size)
        self.group_size = group_size
        self.symmetric = symmetric
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2,
                                                    dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups))
        self.register_buffer("qzeros", None if symmetric else
                             torch.zeros(out_features, groups, dtype=torch.uint8))

    def quantized(self) -> intx.Int4:
        return intx.Int4(data=self.qweight, scale=self.scales, zero=self.qzeros,
                         group_size=self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return intx.dequantize_int4(self.quantized(), dtype)

    def load_quantized(self, q: intx.Int4) -> Int4Linear:
        self.qweight.copy_(q.data)
        self.scales.copy_(q.scale)
        if q.zero is not None:
            self.qzeros.copy_(q.zero)
        return self

    @classmethod
    @torch.no_grad()
    def from_float(cls, linear: nn.Linear, group_size: int = intx.DEFAULT_GROUP_SIZE,
                   symmetric: bool = False) -> Int4Linear:
        """Round to nearest (AWQ scales and clips the float weight first: quant/awq.py)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group_size, symmetric)
        layer.load_quantized(intx.quantize_int4(linear.weight, group_size, symmetric))
        cls._copy_bias(layer, linear)
        return layer.to(linear.weight.device)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", group_size={self.group_size}, "
                f"symmetric={self.symmetric}")


class NF4Linear(QuantLinear):
    """QLoRA's NF4 with double-quantised block absmax (numerics/nf4.py): `nf4_data` packed
    codes, `nf4_scalers` int8, `nf4_factors` fp32 per scaler block, `nf4_mean`,
    `nf4_codes` (the 16 values)."""

    method = "nf4"

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block_size: int = nf4.NF4_BLOCK_SIZE,
                 scaler_block_size: int = nf4.NF4_SCALER_BLOCK_SIZE):
        super().__init__(in_features, out_features, bias)
        self.block_size = block_size
        self.scaler_block_size = scaler_block_size
        n_blocks = -(-in_features * out_features // block_size)
        n_scaler_blocks = -(-n_blocks // scaler_block_size)
        self.register_buffer("nf4_data", torch.zeros(n_blocks * block_size // 2,
                                                     dtype=torch.uint8))
        self.register_buffer("nf4_scalers", torch.zeros(n_scaler_blocks * scaler_block_size,
                                                        dtype=torch.int8))
        self.register_buffer("nf4_factors", torch.ones(n_scaler_blocks))
        self.register_buffer("nf4_mean", torch.zeros(()))
        self.register_buffer("nf4_codes", torch.tensor(nf4.NF4_CODES))

    def quantized(self) -> nf4.NF4:
        return nf4.NF4(data=self.nf4_data, scalers=self.nf4_scalers, factors=self.nf4_factors,
                       mean=self.nf4_mean, codes=self.nf4_codes,
                       shape=(self.out_features, self.in_features), block_size=self.block_size,
                       scaler_block_size=self.scaler_block_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return nf4.dequantize_nf4(self.quantized(), dtype)

    @classmethod
    @torch.no_grad()
    def from_float(cls, linear: nn.Linear, block_size: int = nf4.NF4_BLOCK_SIZE,
                   scaler_block_size: int = nf4.NF4_SCALER_BLOCK_SIZE) -> NF4Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    block_size, scaler_block_size)
        q = nf4.quantize_nf4(linear.weight, block_size, scaler_block_size)
        for name, value in (("nf4_data", q.data), ("nf4_scalers", q.scalers),
                            ("nf4_factors", q.factors), ("nf4_mean", q.mean),
                            ("nf4_codes", q.codes)):
            getattr(layer, name).copy_(value)
        cls._copy_bias(layer, linear)
        return layer.to(linear.weight.device)


class MXFP4Linear(QuantLinear):
    """OCP MXFP4 (numerics/mx.py): `qweight` (out, in/2) E2M1 codes two per byte and
    `scales_e8m0` (out, in/32) biased power-of-two exponents, blocks along the input
    dimension. Emulated: dequantised to the input's dtype before the matmul."""

    method = "mxfp4"

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block_size: int = mx.MX_BLOCK_SIZE):
        super().__init__(in_features, out_features, bias)
        mx.check_block_size(in_features, block_size)
        self.block_size = block_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2,
                                                    dtype=torch.uint8))
        self.register_buffer("scales_e8m0", torch.full(
            (out_features, in_features // block_size), mx.E8M0_BIAS, dtype=torch.uint8))

    def quantized(self) -> mx.MXFP4:
        return mx.MXFP4(data=self.qweight, scale=self.scales_e8m0, block_size=self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return mx.dequantize_mxfp4(self.quantized(), dtype)

    @classmethod
    @torch.no_grad()
    def from_float(cls, linear: nn.Linear, block_size: int = mx.MX_BLOCK_SIZE
                   ) -> MXFP4Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    block_size)
        q = mx.quantize_mxfp4(linear.weight, block_size)
        layer.qweight.copy_(q.data)
        layer.scales_e8m0.copy_(q.scale)
        cls._copy_bias(layer, linear)
        return layer.to(linear.weight.device)
