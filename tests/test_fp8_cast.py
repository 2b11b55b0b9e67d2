"""The fused FP8 casts (numerics/fp8_cast.py, Triton kernels in numerics/fp8_triton.py) in
Triton's interpreter: every code and scale byte-equal to the reference quantiser, for fp32
and fp16 inputs (bf16 is broken in the interpreter), and the FP8 linear on them equal to
the step-by-step path bit for bit. The fake implementations' shapes and strides equal the
real outputs'. The interpreter is chosen when Triton is imported, so the checks run in a
child process started with TRITON_INTERPRET=1."""


import pytest
import torch
from common import run_interpreted

CHECK = r"""
import json, sys, torch
from fivefold.numerics import fp8_cast as C
from fivefold.numerics.fp8 import quantize, dequantize
from fivefold.numerics.formats import E4M3, E5M2, FP8_FORMATS

def same(got, ref):
    if got.dtype.itemsize != 1:  # scales: every float32 bit, NaN where the reference's is
        return bool(torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0)))
    g, r = got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)
    nan = ref.float().isnan()  # a NaN's sign bit is not specified (lowp/quantize.py)
    return bool(torch.equal(g[~nan], r[~nan]) and got.float()[nan].isnan().all())

def cases(dtype):
    torch.manual_seed(0)
    # 130 x 136: partial 128-tiles both ways; columns over six decades (FP8 subnormals)
    x = torch.randn(130, 136) * torch.logspace(-4, 2, 136)
    x[5] = 0.0                      # an all-zero row: amax 0, the EPS multiplier
    x[7, 3], x[9, 130] = float("nan"), float("inf")  # non-finite groups quantise to NaN
    out = {"random": x.to(dtype)}
    for fmt in (E4M3, E5M2):        # every midpoint of the format at multiplier 1: ties
        v = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
        v = v[v.isfinite() & (v >= 0)].unique()
        mid = (v[1:] + v[:-1]) / 2
        t = torch.cat([v, mid, -mid])
        t = torch.cat([t, t.new_zeros(-t.numel() % 16)]).view(16, -1)
        out["ties_" + fmt.name] = t.to(dtype)
    return out

report = {}
for dtype in (torch.float32, torch.float16) if sys.argv[1] == "casts" else ():
    for name, x in cases(dtype).items():
        fmts = [name[5:]] if name.startswith("ties") else ["e4m3", "e5m2"]
        for fmt in fmts:
            F, key = FP8_FORMATS[fmt], f"{dtype}/{name}/{fmt}"
            c, ct, s = C.fp8_cast_tensorwise(x, C.fp8_amax_partials(x), fmt, True, True)
            q = quantize(x, F, "tensorwise")
            r = {"tensorwise": [same(c, q.data), same(ct, q.data.t()), same(s, q.scale)]}
            for pow2 in (False, True):
                c, s, part = C.fp8_cast_rows(x, fmt, pow2, True)
                ct, st = C.fp8_cast_cols(x, part, fmt, pow2)
                q, qt = quantize(x, F, "rowwise", pow2), quantize(x.t(), F, "rowwise", pow2)
                r[f"rows/cols pow2={pow2}"] = [same(c, q.data), same(s, q.scale),
                                               same(ct, qt.data), same(st, qt.scale)]
            for requant in ([False, True] if fmt == "e4m3" else [False]):
                c, s, ct, st = C.fp8_cast_tiles(x, fmt, requant)
                q = quantize(x, F, "tiles")
                qt = quantize((dequantize(q) if requant else x).t(), F, "tiles")
                r[f"tiles requant={requant}"] = [same(c, q.data), same(s, q.scale),
                                                 same(ct, qt.data), same(st, qt.scale),
                                                 s.stride() == (1, s.shape[0])]
            for view in (x, x.t()):
                c, s = C.fp8_cast_blocks(view, fmt)
                q = quantize(view, F, "blocks")
                r.setdefault("blocks", []).extend([same(c, q.data), same(s, q.scale)])
            report[key] = r

# delayed scaling's cast (a scale from a history, saturating, recording tile amaxes), its
# history push, its amax fold, and the tensorwise cast with a power-of-two scale
# (rowwise_gw_hp's Wᵀ)
from fivefold.numerics.fp8 import quantize_with_amax
for dtype in (torch.float32, torch.float16) if sys.argv[1] == "delayed" else ():
    x = cases(dtype)["random"]
    own = x.float().abs().nan_to_num(nan=float("inf"))
    finite = own[own.isfinite()].max()
    for fmt in ("e4m3", "e5m2"):
        F, r = FP8_FORMATS[fmt], {}
        # a history below x's amax (codes saturate), one above, one all zero (EPS)
        for label, hist in (("below", torch.tensor([finite / 8, 0.0, finite / 4, 1e-3])),
                            ("above", torch.tensor([finite * 3, finite])),
                            ("zero", torch.zeros(3))):
            c, ct, s, amax = C.fp8_cast_delayed(x, hist, fmt, True, True)
            q = quantize_with_amax(x, hist.max(), F)
            h = hist.clone()
            C.fp8_history_push(h, amax)
            folded = [hist[:1].clone(), torch.full((1,), float(own.max()) * 2)]
            for pending in folded:  # below x's amax, above it
                C.fp8_amax_fold(pending, amax)
            r[label] = [same(c, q.data), same(ct, q.data.t()), same(s, q.scale),
                        bool(amax.max() == own.max()),
                        bool(torch.equal(h, torch.cat([own.max().reshape(1), hist[:-1]]))),
                        bool(folded[0] == torch.maximum(hist[0], own.max())),
                        bool(folded[1] == own.max() * 2)]
        c, ct, s = C.fp8_cast_tensorwise(x, C.fp8_amax_partials(x), fmt, True, True, True)
        q = quantize(x, F, "tensorwise", True)
        r["tensorwise pow2"] = [same(c, q.data), same(ct, q.data.t()), same(s, q.scale)]
        report[f"{dtype}/{fmt}"] = r

if sys.argv[1] in ("casts", "delayed"):
    print(json.dumps(report))
    sys.exit(0)

# the fake implementations: shapes, dtypes and strides of the real outputs
x = torch.randn(130, 136)
m = x.to("meta")
calls = {"tensorwise": lambda t, p: C.fp8_cast_tensorwise(t, p, "e5m2", True, True),
         "rows": lambda t, p: C.fp8_cast_rows(t, "e4m3", True, True),
         "cols": lambda t, p: C.fp8_cast_cols(t, C.fp8_cast_rows(t, "e4m3", True, True)[2],
                                              "e4m3", True),
         "tiles": lambda t, p: C.fp8_cast_tiles(t, "e4m3", True),
         "blocks": lambda t, p: C.fp8_cast_blocks(t.t(), "e4m3")}
parts = {x: C.fp8_amax_partials(x), m: C.fp8_amax_partials(m)}
fakes = {"partials": parts[x].shape == parts[m].shape}
for name, call in calls.items():
    real, fake = call(x, parts[x]), call(m, parts[m])
    fakes[name] = all(a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                      for a, b in zip(real, fake))
report["fakes"] = fakes

# the FP8 linear on the fused casts against its step-by-step path, every recipe
import dataclasses
from fivefold.lowp import fused, linear
from fivefold.lowp.linear import FP8Recipe, fp8_linear

def run(recipe, use_fused):
    fused.fused = (lambda t: True) if use_fused else (lambda t: False)
    linear._LAST[0] = None
    torch.manual_seed(1)
    x = (torch.randn(2, 40, 136) * torch.logspace(-2, 1, 136)).requires_grad_()
    w = (torch.randn(144, 136) / 16).requires_grad_()
    b = torch.randn(144).requires_grad_()
    g = torch.randn(2, 40, 144)
    y = fp8_linear(x, w, b, recipe)
    y.backward(g)
    return [y.detach(), x.grad, w.grad, b.grad]

linears = {}
for name, grad_format in (("tensorwise", "e5m2"), ("rowwise", "e4m3"), ("blockwise", "e4m3"),
                          ("rowwise", "e5m2")):
    recipe = FP8Recipe.from_name(name, grad_format)
    ref, got = run(recipe, False), run(recipe, True)
    linears[f"{name}/{grad_format}"] = [bool(torch.equal(a, b)) for a, b in zip(ref, got)]
# delayed tensorwise over three steps (the first dynamic, then from the history) and
# rowwise_gw_hp: outputs, gradients and the histories equal on both paths
from fivefold.lowp.delayed import add_history, end_step
from fivefold.lowp.linear import FP8Linear

def run_module(recipe, use_fused):
    fused.fused = (lambda t: True) if use_fused else (lambda t: False)
    linear._LAST[0] = None
    torch.manual_seed(1)
    m = FP8Linear(136, 144)
    m.fp8_recipe = recipe
    if recipe.scaling == "delayed":
        add_history(m, 4)
    out = []
    for step in range(3):
        x = (torch.randn(40, 136) * torch.logspace(-2, 1, 136) * (1 + step)).requires_grad_()
        m.zero_grad()
        y = m(x)
        y.backward(torch.randn(40, 144))
        end_step([m])
        out += [y.detach(), x.grad, m.weight.grad.clone(), m.bias.grad.clone()]
    return out + [getattr(m, "fp8_amax_history", torch.zeros(1))]

for name, recipe in (("tensorwise delayed", FP8Recipe.from_name("tensorwise", scaling="delayed",
                                                                 history_len=4)),
                     ("rowwise_gw_hp", FP8Recipe.from_name("rowwise_gw_hp"))):
    ref, got = run_module(recipe, False), run_module(recipe, True)
    linears[name] = [bool(torch.equal(a, b)) for a, b in zip(ref, got)]
report["linear"] = linears
print(json.dumps(report))
"""


def _interpreted(part: str) -> dict:
    return run_interpreted(["-c", CHECK, part])


def test_fused_casts_in_the_interpreter_are_byte_equal_to_the_reference():
    """Codes and scales of every fused cast byte-equal to numerics.fp8.quantize: fp32 and
    fp16 inputs, E4M3 and E5M2, partial tiles both ways, an all-zero row, a NaN and an inf
    (their groups NaN), values over six decades (FP8 subnormals), every midpoint between
    two FP8 values (round half to even), blocks of a transposed view. No tolerance: the
    same operations on the same float32 values (numerics/fp8_triton.py's docstring)."""
    report = _interpreted("casts")
    assert len(report) == 2 * 4, sorted(report)  # dtypes x (random x 2 formats, 2 ties)
    bad = {f"{case}: {op}": flags for case, ops in report.items()
           for op, flags in ops.items() if not all(flags)}
    assert not bad, bad


def test_delayed_cast_and_history_push_in_the_interpreter():
    """fp8_cast_delayed's codes, transposed codes and scale byte-equal to
    numerics.fp8.quantize_with_amax given the history (below x's amax: saturated codes;
    above; all zero), its tile amaxes' maximum x's (NaN as inf), the push putting it first;
    and the power-of-two tensorwise cast equal to quantize(..., pow2=True)."""
    report = _interpreted("delayed")
    assert len(report) == 2 * 2, sorted(report)  # dtypes x formats
    bad = {f"{case}: {op}": flags for case, ops in report.items()
           for op, flags in ops.items() if not all(flags)}
    assert not bad, bad


@pytest.mark.slow
def test_fp8_linear_on_the_fused_casts_in_the_interpreter():
    """The fakes' shapes, dtypes and strides equal the real outputs'; the FP8 linear's
    output and three gradients on the fused casts bit-equal to its step-by-step path, for
    each recipe (and e5m2 gradients on the row and column kernels), delayed tensorwise over
    three steps with its histories, and rowwise_gw_hp."""
    report = _interpreted("linear")
    linear, fakes = report["linear"], report["fakes"]
    assert all(fakes.values()) and len(fakes) == 6, fakes
    assert len(linear) == 6 and all(all(v) for v in linear.values()), linear


def test_fused_path_is_the_gpus_and_not_the_cpus():
    """The CPU keeps the step-by-step path; a GPU (and meta, a trace of one) takes the fused
    casts."""
    from fivefold.lowp import fused

    assert not fused.fused(torch.empty(1))
    assert fused.fused(torch.empty(1, device="meta"))
