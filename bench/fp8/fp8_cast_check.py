"""The fused FP8 casts on a GPU against the reference on the CPU, byte for byte.

    python3 bench/fp8/fp8_cast_check.py [--tokens 8192 --k 4096]   # needs CUDA and Triton

Each fused cast (numerics/fp8_cast.py) runs on the GPU on a bf16 operand whose columns
span six decades; numerics.fp8.quantize runs on the same values on the CPU; every FP8 code
and float32 scale must be equal (tests/test_fp8_cast.py checks the same in Triton's
interpreter in fp32 and fp16; bf16 and the GPU's own arithmetic are checked only here).
bench/gpu.py runs it as its `fp8_cast_bytes` item.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _equal(got: torch.Tensor, ref: torch.Tensor) -> bool:
    got = got.cpu()
    if got.dtype.itemsize == 1:
        return bool(torch.equal(got.contiguous().view(torch.uint8),
                                ref.contiguous().view(torch.uint8)))
    return bool(torch.equal(got, ref))


def check(device: torch.device, tokens: int, k: int) -> dict:
    """{cast: [codes equal, scales equal, ...]} for each fused cast, bf16 input."""
    from fivefold.numerics import fp8_cast as C
    from fivefold.numerics.formats import FP8_FORMATS
    from fivefold.numerics.fp8 import dequantize, quantize, quantize_with_amax

    gen = torch.Generator().manual_seed(0)
    x_cpu = (torch.randn(tokens, k, generator=gen) * torch.logspace(-3, 3, k)).to(torch.bfloat16)
    x = x_cpu.to(device)
    out = {}
    for fmt in ("e4m3", "e5m2"):
        F = FP8_FORMATS[fmt]
        c, ct, s = C.fp8_cast_tensorwise(x, C.fp8_amax_partials(x), fmt, True, True)
        q = quantize(x_cpu, F, "tensorwise")
        out[f"tensorwise/{fmt}"] = [_equal(c, q.data), _equal(ct, q.data.t()), _equal(s, q.scale)]
        c, s, part = C.fp8_cast_rows(x, fmt, True, True)
        ct, st = C.fp8_cast_cols(x, part, fmt, True)
        q, qt = quantize(x_cpu, F, "rowwise", True), quantize(x_cpu.t(), F, "rowwise", True)
        out[f"rowwise/{fmt}"] = [_equal(c, q.data), _equal(s, q.scale), _equal(ct, qt.data),
                                 _equal(st, qt.scale)]
        for requant in ((False, True) if fmt == "e4m3" else (False,)):
            c, s, ct, st = C.fp8_cast_tiles(x, fmt, requant)
            q = quantize(x_cpu, F, "tiles")
            qt = quantize((dequantize(q) if requant else x_cpu).t(), F, "tiles")
            out[f"tiles requant={requant}/{fmt}"] = [_equal(c, q.data), _equal(s, q.scale),
                                                     _equal(ct, qt.data), _equal(st, qt.scale)]
        # delayed scaling: a history below x's amax (saturating codes), the push; and
        # rowwise_gw_hp's power-of-two tensorwise cast
        hist = torch.tensor([x_cpu.float().abs().max().item() / 8, 0.0, 1e-3])
        c, ct, s, amax = C.fp8_cast_delayed(x, hist.to(device), fmt, True, True)
        q = quantize_with_amax(x_cpu, hist.max(), F)
        h = hist.to(device)
        C.fp8_history_push(h, amax)
        pushed = torch.cat([x_cpu.float().abs().max().reshape(1), hist[:-1]])
        pending = hist[:1].to(device)  # the step's record: max with this cast's tile amaxes
        C.fp8_amax_fold(pending, amax)
        folded = torch.maximum(hist[:1], x_cpu.float().abs().max().reshape(1))
        out[f"delayed/{fmt}"] = [_equal(c, q.data), _equal(ct, q.data.t()), _equal(s, q.scale),
                                 _equal(h, pushed), _equal(pending, folded)]
        c, ct, s = C.fp8_cast_tensorwise(x, C.fp8_amax_partials(x), fmt, True, True, True)
        q = quantize(x_cpu, F, "tensorwise", True)
        out[f"tensorwise pow2/{fmt}"] = [_equal(c, q.data), _equal(ct, q.data.t()),
                                         _equal(s, q.scale)]
    c, s = C.fp8_cast_blocks(x.t(), "e4m3")
    q = quantize(x_cpu.t(), FP8_FORMATS["e4m3"], "blocks")
    out["blocks of xᵀ/e4m3"] = [_equal(c, q.data), _equal(s, q.scale)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_cast_check.py needs a CUDA device (the interpreter's check is "
              "tests/test_fp8_cast.py)", file=sys.stderr)
        return 2
    result = check(torch.device("cuda"), args.tokens, args.k)
    print(json.dumps(result, indent=1))
    return 0 if all(all(v) for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
