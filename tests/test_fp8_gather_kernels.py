"""ZeRO-3's FP8 gather on its fused kernels (numerics/fp8_gather.py, Triton kernels in
numerics/fp8_gather_triton.py) against the eager torch path the CPU runs: every rank's
message, the unit's byte buffer and its dequantised buffer byte for byte.

The kernels run in Triton's interpreter, chosen when Triton is imported, so the checks run
in a child process started with TRITON_INTERPRET=1 (tests/common.py `run_interpreted`, as
tests/test_fp8_cast.py does), in fp32 and fp16 (bf16 is broken in the interpreter). The
unit: weights whose pieces the ranks' shard cuts fall inside at odd offsets (3 and 4 ranks,
pieces of uneven length, a rank holding pieces of several weights), a stacked experts
weight (a scale per expert), parameters between them (raw bytes, with a NaN and an inf),
and the segment's padding; the weights' amaxes: their own, 0 (an all-zero weight), NaN and
inf (a weight holding one: every code NaN), and one below the weight's amax (delayed
scaling's history: codes saturate at ±448). Then a whole dp2 ZeRO-3 training run on the
fused kernels, against the eager path.
"""

import pytest
import torch
from common import run_interpreted

CHECK = r"""
import json, sys, types, torch
from fivefold.numerics import fp8_gather
from fivefold.parallel import comm, zero3_fp8
from fivefold.parallel.zero3_fp8 import FP8UnitGather

# the segment: (kind, shape) in order; "w" a weight (slot), "x" a stacked experts weight,
# "raw" other parameters
LAYOUT = [("raw", (19,)), ("w", (37, 53)), ("w", (5, 7)), ("raw", (3,)), ("w", (129, 77)),
          ("x", (3, 11, 13)), ("w", (8, 16)), ("w", (2, 1100)), ("raw", (5,))]

def make(dtype, ranks):
    torch.manual_seed(0)
    parts, slots, at = [], [], 0
    for kind, shape in LAYOUT:
        numel = torch.Size(shape).numel()
        x = torch.randn(numel) * torch.logspace(-5, 2, numel)[torch.randperm(numel)]
        if kind != "raw":
            slots.append((types.SimpleNamespace(shape=shape, start=at, numel=numel),
                          torch.nn.Module(), "w_gate" if kind == "x" else "weight"))
        parts.append(x)
        at += numel
    flat = torch.cat(parts)
    w = [s for s, _, _ in slots]
    flat[w[1].start:w[1].start + w[1].numel] = 0.0                 # amax 0
    flat[w[2].start + 100] = float("nan")                           # amax NaN
    flat[w[3].start + 11 * 13 + 5] = float("inf")                   # expert 1: amax inf
    flat[w[4].start + 3] = -0.0
    flat[7], flat[LAYOUT[0][1][0] + 37 * 53 + 35 + 1] = float("nan"), float("-inf")  # raw
    size = -(-flat.numel() // ranks) * ranks
    flat = torch.cat([flat, torch.zeros(size - flat.numel())]).to(dtype)
    return flat, slots, size

def gather(dtype, ranks, use_fused):
    zero3_fp8.fused = (lambda t: True) if use_fused else (lambda t: False)
    flat, slots, size = make(dtype, ranks)
    seg = types.SimpleNamespace(size=size, start=0)
    layout = types.SimpleNamespace(shards=ranks, segment_shard=lambda shard, seg: shard)
    per = size // ranks
    units = [FP8UnitGather(layout, seg, slots, r, torch.device("cpu"), dtype)
             for r in range(ranks)]
    local = torch.stack([u.local_amax(flat[u.first:u.first + per]) for u in units])
    amax = local.amax(0)  # NaN as the all-reduce(max) of the engine gives it: max of NaN
    amax = torch.where(local.isnan().any(0), float("nan"), amax)
    amax[-1] = amax[-1] / 16  # the last weight: a scale below its amax (delayed)
    sent = []
    comm.all_gather = lambda out, send, group, async_op=False: sent.append(send) or comm.DONE
    pending = []
    for r, u in enumerate(units):
        u.set_amax(amax, local[r])
        full = torch.zeros(size, dtype=dtype)
        pending.append((u, full, u.start(full, flat[u.first:u.first + per],
                                         types.SimpleNamespace(size=ranks))))
    used = [max(at + (hi - lo) * (1 if k >= 0 else u.es) for k, lo, hi, at in u.pieces[r])
            for r, u in enumerate(units)]
    messages = [s[:n].clone() for s, n in zip(sent, used)]
    out = torch.cat(sent)
    u, full, _ = pending[0]
    u.finish(full, out)
    codes = u.bytes.clone()
    weights = []
    for slot, m, name in slots:
        g = m.fp8_experts[name] if len(slot.shape) == 3 else [m.fp8_weight]
        weights.append([t.data.view(torch.uint8).clone() for t in g])
    return {"messages": messages, "codes": codes, "full": full, "weights": weights,
            "flat": flat, "slots": slots, "nan_codes": int((codes == 0x7F).sum())}

def same(a, b):  # every byte, NaN's too
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))

BITS = {torch.float32: torch.int32, torch.float16: torch.int16}

def same_values(ref, got):
    # every element's bits where the reference is a number, NaN where it is NaN: the eager
    # path's NaN payload is not a function of the code (the test says why), so none is asked
    nan = ref.isnan()
    return bool(torch.equal(ref.view(BITS[ref.dtype])[~nan], got.view(BITS[ref.dtype])[~nan])
                and got[nan].isnan().all())

report = {}
for dtype in (torch.float32, torch.float16):
    for ranks in (3, 4):
        ref, got = gather(dtype, ranks, False), gather(dtype, ranks, True)
        full = ref["full"]
        weight = torch.zeros(full.numel(), dtype=torch.bool)  # the codes' positions (the
        for slot, _, _ in ref["slots"]:                        # rest is never written)
            weight[slot.start:slot.start + slot.numel] = True
        last = ref["slots"][-1][0]  # the weight cast with a scale below its amax
        region = ref["codes"][last.start:last.start + last.numel]
        saturated = int(((region & 0x7F) == 0x7E).sum())  # ±448
        report[f"{dtype}/dp{ranks}"] = {
            "messages": [same(a, b) for a, b in zip(ref["messages"], got["messages"])],
            "codes": same(ref["codes"][weight], got["codes"][weight]),
            "full": same_values(full, got["full"]),
            "full_nan": int(full.isnan().sum()),
            "weights": all(same(a, b) for x, y in zip(ref["weights"], got["weights"])
                           for a, b in zip(x, y)),
            # the cases the unit holds, seen in the reference: NaN codes (the NaN and
            # inf weights), zero codes, saturated codes, raw NaN and inf copied
            "nan_codes": ref["nan_codes"], "saturated": saturated,
            "raw_nonfinite": int((~full[[7, 2016]].isfinite()).sum()),
            "zeros": int((full == 0).sum())}

# the fake implementations: shapes and dtypes of the real outputs
flat, slots, size = make(torch.float32, 3)
seg = types.SimpleNamespace(size=size, start=0)
layout = types.SimpleNamespace(shards=3, segment_shard=lambda shard, seg: shard)
for device in ("cpu", "meta"):
    u = FP8UnitGather(layout, seg, slots, 1, torch.device(device), torch.float32)
    (t, blocks), _ = u.tables
    send = fp8_gather.fp8_gather_pack(flat[u.first:u.first + size // 3].to(device), t, blocks,
                                      u.mult, u.message)
    report.setdefault("fake", []).append([tuple(send.shape), str(send.dtype)])
print(json.dumps(report))
"""


def test_fused_gather_in_the_interpreter_is_byte_equal_to_the_eager_path():
    """Each rank's message (the bytes its pieces fill), the unit's byte buffer, its
    dequantised buffer and every gathered weight's codes: byte-equal, NaNs included, to
    the eager path, fp32 and fp16, over 3 and 4 ranks. No tolerance: the same float32
    operations (numerics/fp8_gather_triton.py's docstring). The report also shows the
    unit holds the cases it is meant to (NaN, saturated and zero codes, raw NaN and inf)."""
    report = run_interpreted(["-c", CHECK])
    fake = report.pop("fake")
    assert fake[0] == fake[1], fake
    assert len(report) == 4, sorted(report)
    for case, r in report.items():
        assert all(r["messages"]) and len(r["messages"]) == int(case[-1]), (case, r)
        assert r["codes"] and r["full"] and r["weights"], (case, r)
        assert r["nan_codes"] > 129 * 77 and r["saturated"] > 2, (case, r)
        assert r["zeros"] >= 5 * 7, (case, r)
        assert r["raw_nonfinite"] == 2, (case, r)
        # the NaN weight's and the inf expert's every element and the raw NaN: NaN in both.
        # The reference's NaNs from one code carry two payloads (torch 2.13 on x86 gave
        # 0x7FC00000 and 0x7FF00000 in fp32: its CPU loop converts e4m3 one way in its
        # vector body, another in its scalar tail), so no payload is asked of the kernel
        assert r["full_nan"] == 129 * 77 + 11 * 13 + 1, (case, r)


def test_fused_ops_without_triton_run_the_eager_path():
    """A device without Triton (here the CPU, no interpreter) runs the ops' torch
    implementation: the eager path's rows read back from the kernels' table."""
    from fivefold.numerics import fp8_gather

    torch.manual_seed(0)
    local = torch.randn(300, dtype=torch.bfloat16)
    rows = [(0, 0, 7, -1), (7, 14, 200, 0), (207, 214, 93, 1)]  # raw, then two weights
    mult = torch.tensor([3.0, 700.0])
    t, blocks = fp8_gather.table(rows, 2, 2, torch.device("cpu"))
    assert blocks == 3 and t[0].tolist() == [0, 0, 0, 7, -1]  # raw offset in elements
    assert fp8_gather._rows(t, 2, 2) == rows
    ref = fp8_gather.pack_eager(local, rows, mult, 310)
    assert torch.equal(fp8_gather.fp8_gather_pack(local, t, blocks, mult, 310), ref)
    assert (ref[214 + 93:] == 0).all() and (ref.view(torch.float8_e4m3fn)[214:307].float()
                                            .abs() == 448).any()  # saturated: mult 700
    codes, full = torch.zeros(300, dtype=torch.uint8), torch.zeros(300, dtype=torch.bfloat16)
    urows = [(0, 0, 7, -1), (14, 7, 200, 0), (214, 207, 93, 1)]
    codes2, full2 = codes.clone(), full.clone()
    fp8_gather.unpack_eager(ref, urows, 1 / mult, codes, full)
    ut, ublocks = fp8_gather.table(urows, 2, 1, torch.device("cpu"))
    fp8_gather.fp8_gather_unpack(ref, ut, ublocks, 1 / mult, codes2, full2)
    assert torch.equal(codes, codes2) and torch.equal(full.view(torch.int16),
                                                      full2.view(torch.int16))
    assert torch.equal(full[:7], local[:7])  # the raw piece back as it was


@pytest.mark.parametrize("offset", [3])
def test_a_raw_piece_off_its_dtype_is_refused(offset):
    from fivefold.numerics import fp8_gather

    with pytest.raises(ValueError, match="not aligned"):
        fp8_gather.table([(0, offset, 4, -1)], 2, 2, torch.device("cpu"))


def test_kernels_compile_for_an_h100_without_one():
    """Both kernels compiled by Triton for CUDA compute capability 9.0 (to PTX and cubin: no
    GPU needed), bf16 in and out, as a GPU run compiles them: the interpreter does not check
    the types a compilation does. The PTX rounds float32 to bf16 to nearest even (the eager
    `.to(torch.bfloat16)`'s rounding), multiplies without flushing subnormals and fuses no
    multiply into an add (the eager path rounds each product)."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fivefold.numerics import fp8_gather_triton as kernels
    from fivefold.numerics.formats import E4M3

    target = GPUTarget("cuda", 90, 32)
    pack = ASTSource(fn=kernels.gather_pack_kernel, signature={
        "local_ptr": "*bf16", "table_ptr": "*i64", "P": "i32", "mult_ptr": "*fp32",
        "send_ptr": "*u8", "send_typed_ptr": "*bf16", "FMAX": "constexpr",
        "MBITS": "constexpr", "BIAS": "constexpr", "PB": "constexpr", "BLOCK": "constexpr"},
        constexprs={"FMAX": E4M3.max, "MBITS": 3, "BIAS": 7, "PB": 16, "BLOCK": 1024})
    unpack = ASTSource(fn=kernels.gather_unpack_kernel, signature={
        "out_ptr": "*u8", "out_typed_ptr": "*bf16", "table_ptr": "*i64", "P": "i32",
        "scale_ptr": "*fp32", "codes_ptr": "*u8", "full_ptr": "*bf16", "PB": "constexpr",
        "BLOCK": "constexpr"}, constexprs={"PB": 16, "BLOCK": 1024})
    ptx = {}
    for name, source in (("pack", pack), ("unpack", unpack)):
        try:
            compiled = triton.compile(source, target=target)
        except RuntimeError as e:  # no CUDA backend or ptxas in this Triton installation
            pytest.skip(f"Triton cannot compile for CUDA here: {str(e).splitlines()[0]}")
        assert compiled.asm.get("cubin"), name
        ptx[name] = compiled.asm["ptx"]
    for name, text in ptx.items():
        ops = set(re.findall(r"\b(?:mul|fma|cvt)\.[\w.]+", text))
        assert "mul.f32" in ops and not any(o.startswith("fma") or ".ftz" in o for o in ops), (
            name, ops)
    assert "cvt.rn.bf16.f32" in ptx["unpack"], ptx["unpack"][-2000:]


# An end-to-end run of the fused gather: dp2 ZeRO-3 with parallel.fp8_allgather, 2 steps,
# once on the eager ops (the CPU's path) and once with the fused kernels forced (the
# module's `fused`, replaced in the ranks as the check above does), in Triton's
# interpreter. The interpreter takes fp32 and fp16, not bf16, so train.precision = fp8 runs
# here with fp32 parameters (the trainer's dtype of fp8, replaced in the ranks): the FP8
# GEMMs are the same, the gathered weights' raw and dequantised values fp32.
RUN = r"""
import json, pathlib, sys, torch
sys.path.insert(0, TESTS)
from common import small_config
from harness import run_ranks
from fivefold.numerics import fp8_gather
from fivefold.parallel import zero3_fp8
from fivefold.parallel.mesh import ParallelDims
from fivefold.train import trainer as trainer_module

OPS = {"pack": "fp8_gather_pack", "unpack": "fp8_gather_unpack", "pack_eager": "pack_eager",
       "unpack_eager": "unpack_eager"}

def train(rank, world, tmp, forced, extra):
    trainer_module.DTYPES = {**trainer_module.DTYPES, "fp8": torch.float32}
    if forced:
        zero3_fp8.fused = lambda t: True
    calls = dict.fromkeys(OPS, 0)  # the fused ops and the eager ones (also their fallback)
    def counted(name, fn):
        def op(*args):
            calls[name] += 1
            return fn(*args)
        return op
    for name, attr in OPS.items():
        setattr(fp8_gather, attr, counted(name, getattr(fp8_gather, attr)))
    cfg = small_config(pathlib.Path(tmp), "--train.precision", "fp8", "--train.fp8_recipe",
                       "tensorwise", "--train.gbs", "4", "--parallel.mbs", "2",
                       "--train.lr", "1e-3", "--parallel.dp", "2", "--parallel.zero", "3",
                       "--parallel.fp8_allgather", "true", "--parallel.grad_sync", "step",
                       *extra)
    trainer = trainer_module.Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    gatherers = [p.gatherer for p in getattr(trainer.optimizer, "parts", [trainer.optimizer])]
    first = [g.shard.clone() for g in gatherers]
    runs = [trainer.train_step() for _ in range(2)]
    last = [g.shard.clone() for g in gatherers]
    trainer.close()
    return {"runs": [(r["loss"], r["grad_norm"]) for r in runs], "calls": calls,
            "dtype": str(last[0].dtype), "fp8_units": sum(len(g.fp8) for g in gatherers),
            "moved": all(not torch.equal(a, b) for a, b in zip(first, last)),
            "weights": [w.view(torch.int32).tolist() for w in last]}

MOE = ["--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "16", "--train.fp8_scaling", "delayed",
       "--train.fp8_history_len", "4"]
report = {}
for case, extra in (("dense", []), ("moe-delayed", MOE)):
    report[case] = [run_ranks(train, 2, f"{sys.argv[1]}/{case}-{forced}", forced, extra)
                    for forced in (False, True)]
print(json.dumps(report))
"""


def test_a_dp2_zero3_run_on_the_fused_gather_in_the_interpreter_equals_the_eager_one(
        tmp_path):
    """dp2 ZeRO-3 with parallel.fp8_allgather, 2 steps, the fused kernels forced (Triton's
    interpreter, fp32 parameters) against the eager path: losses, gradient norms and every
    rank's shard of the weights after the steps bit-equal (tolerance 0: the kernels write
    the eager ops' bytes, the check above). A dense model, dynamic scaling; and every layer
    MoE with delayed scaling (a scale per expert's weight, from its history on step 2).
    The fused run launched the kernels (one pack and one unpack per FP8 unit's gather, no
    eager op, not even the ops' fallback), the eager one none."""
    import pathlib

    script = RUN.replace("TESTS", repr(str(pathlib.Path(__file__).parent)), 1)
    report = run_interpreted(["-c", script, str(tmp_path)])
    assert report.keys() == {"dense", "moe-delayed"}
    for case, (eager, fused) in report.items():
        for a, b in zip(eager, fused, strict=True):
            assert a["dtype"] == "torch.float32" and a["fp8_units"] > 0, case
            assert b["runs"] == a["runs"], case
            assert b["weights"] == a["weights"] and a["moved"], case
            assert a["calls"]["pack"] == a["calls"]["unpack"] == 0, (case, a["calls"])
            gathers = a["calls"]["pack_eager"]
            assert gathers > 0 and a["calls"]["unpack_eager"] == gathers, (case, a["calls"])
            assert b["calls"] == {"pack": gathers, "unpack": gathers, "pack_eager": 0,
                                  "unpack_eager": 0}, (case, b["calls"])
