"""Number formats in one place: the constants every low-precision feature reads.

A plain constants module (no functions, no classes beyond a small record): training in
FP8, quantisation (int8/int4, NF4, MX) and the planner's bytes per element all take their
numbers from here, so a format is described once.

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433, table 1):

    E4M3  1 sign, 4 exponent, 3 mantissa bits, bias 7; no infinities, one NaN pattern per
          sign; largest finite 448, smallest normal 2^-6, smallest subnormal 2^-9.
    E5M2  1 sign, 5 exponent, 2 mantissa bits, bias 15; IEEE-like (inf, NaN); largest
          finite 57344, smallest normal 2^-14, smallest subnormal 2^-16.

torch names them `float8_e4m3fn` and `float8_e5m2`. DeepSeek-V3 (arXiv 2412.19437 §3.3)
uses E4M3 for every tensor with fine-grained scaling: 1x128 tiles for activations and
activation gradients, 128x128 blocks for weights (`FP8_BLOCK`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """One floating-point storage format: its torch dtype and the numbers scaling needs."""

    name: str
    dtype: torch.dtype
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float  # largest finite value: the saturation bound of a scaled cast
    min_normal: float

    @property
    def bytes(self) -> int:
        return self.bits // 8


E4M3 = FloatFormat("e4m3", torch.float8_e4m3fn, 8, 4, 3, 448.0, 2.0**-6)
E5M2 = FloatFormat("e5m2", torch.float8_e5m2, 8, 5, 2, 57344.0, 2.0**-14)

FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}

# DeepSeek-V3 §3.3.2: tiles of 1x128 (activations, gradients) and blocks of 128x128
# (weights); the FP32 promotion of the accumulator also happens every 128 elements of K.
FP8_BLOCK = 128

# Below this an amax is treated as zero when turned into a scale (torchao float8_utils.EPS).
SCALE_EPS = 1e-12

# Weight-only formats (numerics/intx.py, nf4.py, mx.py; quant/ builds the layers on them).
# int8: symmetric per output row, codes -127..127 (LLM.int8(), Dettmers et al. 2022).
INT8_MAX = 127
# int4 groupwise along K: unsigned codes 0..15 with a zero point (AWQ/GPTQ), or symmetric
# -8..7 stored as code + 8; 128 columns per group is the deployment default (AWQ §4).
INT4_LEVELS = 15
INT4_SYM_OFFSET = 8
INT4_GROUP = 128
# NF4 (QLoRA, Dettmers et al. 2023 §3): absmax per 64 values, those absmaxes in int8 per 256.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
# MXFP4 (OCP MX v1.0 §5): E2M1 elements (largest 6 = 1.5·2^2) in blocks of 32 sharing an
# E8M0 scale (8-bit biased exponent, bias 127, 0xFF NaN).
MX_BLOCK = 32
E2M1_MAX = 6.0
E2M1_EMAX = 2
E8M0_BIAS = 127
