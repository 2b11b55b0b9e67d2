"""The FP8 items of bench/gpu.py (moved out of bench/gpu_items.py, which holds the shared
context and the other items): casts byte-checked, GEMMs and block stacks per recipe, experts,
the blockwise kernel against float64."""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F
from gpu_items import ROOT, Context, NotRun, median_time

# tensorwise_delayed: tensorwise with delayed scaling (lowp/delayed.py)
RECIPES = ("tensorwise", "rowwise", "blockwise", "tensorwise_delayed", "rowwise_gw_hp")


def fp8_recipe(name: str, modules: list, device: torch.device):
    """The recipe with the kernel the engine would pick here (lowp/convert.py)."""
    from fivefold.lowp.convert import choose_kernel
    from fivefold.lowp.linear import FP8Recipe

    delayed = name == "tensorwise_delayed"
    recipe = FP8Recipe.from_name("tensorwise" if delayed else name,
                                 scaling="delayed" if delayed else "dynamic")
    kernel, line = choose_kernel("auto", recipe, modules, device)
    return dataclasses.replace(recipe, kernel=kernel), line


def fp8_gemms(ctx: Context) -> dict:
    """One linear, forward + backward, bf16 against each FP8 recipe: tokens/s and ratio."""
    tokens = ctx.shape("gemm_tokens")
    return {f"{tokens}x{k}->{n}": _gemm_row(ctx, tokens, k, n)
            for k, n in ctx.shape("gemm_shapes")}


def _gemm_row(ctx: Context, tokens: int, k: int, n: int) -> dict:
    from fivefold.lowp.delayed import DelayedState
    from fivefold.lowp.linear import fp8_linear

    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(tokens, k, device=ctx.device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device=ctx.device, dtype=torch.bfloat16,
                    generator=gen).div_(k ** 0.5).requires_grad_()
    g = torch.randn(tokens, n, device=ctx.device, dtype=torch.bfloat16, generator=gen)

    def step(linear):
        xi = x.detach().requires_grad_()  # a new input each step: no quantisation reuse
        linear(xi).backward(g)

    from fivefold.lowp import fused

    rounds = ctx.shape("rounds")
    row = {"bf16": tokens / median_time(ctx, lambda: step(lambda v: F.linear(v, w)), rounds)}
    kernels, before = {}, {}
    for name in RECIPES:
        recipe, kernels[name] = fp8_recipe(name, [torch.nn.Linear(k, n, device="meta")],
                                           ctx.device)
        for on in (False, True):  # before: the step-by-step casts; after: the fused ones
            fused.FUSED_ON_DEVICE = on
            # delayed: the steady state, a history holding x's, W's and ∂y's amaxes (the
            # step's records fold into `pending`, pushed once per optimizer step)
            history = torch.zeros(3, 16, device=ctx.device)
            history[:, 0] = torch.stack([t.detach().abs().amax().float() for t in (x, w, g)])
            state = (DelayedState(history, [True] * 3, True)
                     if recipe.scaling == "delayed" else None)
            rate = tokens / median_time(
                ctx, lambda r=recipe, s=state: step(lambda v: fp8_linear(v, w, None, r, None, s)),
                rounds)
            (row if on else before)[name] = rate
    return {"tokens_per_s": row, "kernels": kernels,
            "ratio_vs_bf16": {r: row[r] / row["bf16"] for r in RECIPES},
            "step_by_step_ratio_vs_bf16": {r: before[r] / row["bf16"] for r in RECIPES}}


def fp8_cast_bytes(ctx: Context) -> dict:
    """bench/fp8/fp8_cast_check.py: each fused FP8 cast on the GPU, bf16 in, byte-equal to
    numerics.fp8.quantize on the CPU."""
    from fivefold.numerics.fp8_cast import triton_usable

    if ctx.device.type != "cuda" or not triton_usable(ctx.device):
        raise NotRun("the fused FP8 casts run on CUDA with Triton (tests/test_fp8_cast.py "
                     "checks them in Triton's interpreter)")
    sys.path.insert(0, str(ROOT / "bench" / "fp8"))
    import fp8_cast_check

    result = fp8_cast_check.check(ctx.device, ctx.shape("gemm_tokens"),
                                  ctx.shape("gemm_shapes")[0][0])
    return {"equal": result, "passed": all(all(v) for v in result.values())}


def _block_stack(ctx: Context, variant: str):
    """bench/fp8/fp8_speed.py's stack of Llama blocks, built on the device, bf16 or FP8."""
    from fivefold.lowp.convert import convert_to_fp8
    from fivefold.models.llama import Block
    from fivefold.models.presets import preset

    cfg = preset(ctx.shape("stack_preset"))
    torch.manual_seed(0)
    with ctx.device:
        stack = torch.nn.ModuleList(Block(cfg, i) for i in range(ctx.shape("stack_layers")))
    stack = stack.to(torch.bfloat16)
    stack.cfg = cfg
    line = "bf16"
    if variant != "bf16":
        linears = [m for m in stack.modules() if isinstance(m, torch.nn.Linear)]
        recipe, line = fp8_recipe(variant, linears, ctx.device)
        convert_to_fp8(stack, recipe)
    return stack, line


def fp8_block_stack(ctx: Context) -> dict:
    """bf16 and each recipe on a stack of Llama blocks, forward + backward (bench/fp8/fp8_speed.py's
    timing), the variants taking turns so that drift hits them alike."""
    sys.path.insert(0, str(ROOT / "bench" / "fp8"))
    import fp8_speed

    tokens, steps = ctx.shape("stack_tokens"), ctx.shape("stack_steps")
    stacks, lines = {}, {}
    for variant in ("bf16", *RECIPES):
        stacks[variant], lines[variant] = _block_stack(ctx, variant)
    rates: dict[str, list[float]] = {v: [] for v in stacks}
    for _ in range(ctx.shape("stack_rounds")):
        for variant, stack in stacks.items():
            rates[variant].append(fp8_speed.time_steps(stack, tokens, steps, 1, ctx.device))
    median = {v: statistics.median(r) for v, r in rates.items()}
    return {"preset": ctx.shape("stack_preset"), "layers": ctx.shape("stack_layers"),
            "tokens": tokens, "tokens_per_s": median, "kernels": lines,
            "ratio_vs_bf16": {v: median[v] / median["bf16"] for v in RECIPES}}


def fp8_experts(ctx: Context) -> dict:
    """Routed experts, forward + backward: bf16 GroupedExperts (one grouped matmul where the
    device has it, else a loop) against the FP8 experts. Before and after in one run:
    rowwise grouped (torch._scaled_grouped_mm where the device has it, lowp/experts.py)
    against rowwise forced through the per-expert loop (`impl = "loop"`), and blockwise
    per expert with its casts per expert (the default) and once for all tokens
    (`fp8_grouped_casts`; docs/fp8.md, "FP8 experts"); the grouped results checked against
    the loop's."""
    from fivefold.lowp.convert import convert_to_fp8
    from fivefold.models.moe import GroupedExperts
    from fivefold.numerics.fp8_grouped import grouped_support

    experts, hidden, inter, rows = ctx.shape("experts")
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    counts = torch.full((experts,), rows, dtype=torch.long)
    x = torch.randn(experts * rows, hidden, device=ctx.device, dtype=torch.bfloat16,
                    generator=gen)
    g = torch.randn_like(x)
    rates, lines, outputs = {}, {}, {}
    for variant in ("bf16", "rowwise", "rowwise_loop", "blockwise", "blockwise_grouped_casts"):
        module = GroupedExperts(experts, hidden, inter).to(ctx.device, torch.bfloat16)
        for i, w in enumerate((module.w_gate, module.w_up, module.w_down)):  # same each time
            torch.nn.init.normal_(w, std=w.shape[-1] ** -0.5,
                                  generator=torch.Generator(device=ctx.device).manual_seed(i))
        lines[variant] = "bf16 grouped matmul" if module.use_grouped_mm(x) else "bf16 loop"
        if variant != "bf16":
            recipe, lines[variant] = fp8_recipe(variant.split("_")[0], [module], ctx.device)
            convert_to_fp8(module, recipe)
            if variant == "rowwise_loop":
                module.impl, lines[variant] = "loop", lines[variant] + ", per expert"
            elif variant == "rowwise":
                ok, why = grouped_support(ctx.device)
                lines[variant] += f", grouped: {why}"
            elif variant == "blockwise_grouped_casts":
                module.fp8_grouped_casts = True
                lines[variant] += (", casts for all tokens" if module.uses_grouped_fp8()
                                   else ", per expert (widths not whole 128-blocks)")

        def step(m=module):
            m(x.detach().requires_grad_(), counts).backward(g)

        rates[variant] = x.shape[0] / median_time(ctx, step, ctx.shape("rounds"))
        if variant != "bf16":
            outputs[variant] = module(x, counts).detach().float()

    def rel(a, b):
        return ((outputs[a] - outputs[b]).norm() / outputs[b].norm()).item()

    return {"experts": experts, "hidden": hidden, "inter": inter, "rows_per_expert": rows,
            "rows_per_s": rates, "kernels": lines,
            "rowwise_grouped_vs_loop_rel_diff": rel("rowwise", "rowwise_loop"),
            "blockwise_grouped_casts_vs_loop_rel_diff": rel("blockwise_grouped_casts",
                                                            "blockwise"),
            "ratio_vs_bf16": {v: rates[v] / rates["bf16"] for v in rates if v != "bf16"}}


def fp8_kernel_float64(ctx: Context) -> dict:
    """tests/test_fp8_kernel.py's GPU test, counted here: the FP8 linear's three GEMMs on
    cuBLASLt's blockwise kernel against the float64 reference."""
    from fivefold.numerics.fp8_kernel import kernel_support

    ok, why = kernel_support(ctx.device)
    if not ok:
        raise NotRun(why)
    sys.path.insert(0, str(ROOT / "tests"))
    import test_fp8_kernel

    errors = test_fp8_kernel._linear_against_float64("scaled_mm", ctx.device.type)
    tol = test_fp8_kernel.BF16_OUT_TOL
    return {"relative_errors": errors, "tolerance": tol,
            "passed": all(e < tol for e in errors.values()), "kernel": why}


def _gather_units(ctx: Context, dtype: torch.dtype):
    """One Llama layer's ZeRO-3 unit gathered in FP8 (parallel/zero3_fp8.py): its 7 linears'
    weights and its two norms (raw) in the segment, every rank's FP8UnitGather with the
    weights' all-reduced scales, and the segment's values."""
    import types

    from fivefold.parallel.zero3_fp8 import FP8UnitGather

    hidden, inter, kv, ranks = ctx.shape("gather_unit")
    shapes = [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (hidden,), (inter, hidden), (inter, hidden), (hidden, inter)]
    slots, at = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        if len(shape) == 2:
            slots.append((types.SimpleNamespace(shape=shape, start=at, numel=numel),
                          torch.nn.Module(), "weight"))
        at += numel
    size = -(-at // ranks) * ranks
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    flat = (torch.randn(size, device=ctx.device, generator=gen) / hidden ** 0.5).to(dtype)
    seg = types.SimpleNamespace(size=size, start=0)
    layout = types.SimpleNamespace(shards=ranks, segment_shard=lambda shard, seg: shard)
    per = size // ranks
    units = [FP8UnitGather(layout, seg, slots, r, ctx.device, dtype) for r in range(ranks)]
    shards = [flat[r * per:(r + 1) * per] for r in range(ranks)]
    local = torch.stack([u.local_amax(s) for u, s in zip(units, shards)])
    for r, u in enumerate(units):
        u.set_amax(local.amax(0), local[r])
    return units, shards, slots, flat


def fp8_gather_unpack(ctx: Context) -> dict:
    """ZeRO-3's FP8 gather of one Llama-3-8B layer over 8 ranks: the pack (rank 0's shard
    cast into its message) and the unpack (the gathered messages into the unit's FP8 bytes
    and bf16 buffer), eager torch ops (before) against one fused kernel each
    (numerics/fp8_gather.py, after): times, and the fused bytes equal the eager ones (the
    messages' filled bytes, the codes, the dequantised buffer). On a device without Triton
    the ops run their torch implementation (said in `kernel`)."""
    from fivefold.numerics import fp8_gather
    from fivefold.numerics.kernel_support import triton_usable

    units, shards, slots, flat = _gather_units(ctx, torch.bfloat16)
    unit, rounds = units[0], ctx.shape("rounds")
    (pack, pack_blocks), (unpack, unpack_blocks) = unit.tables
    sends = [fp8_gather.pack_eager(s, u.pack_rows, u.mult, u.message)
             for u, s in zip(units, shards)]
    fused_sends = [fp8_gather.fp8_gather_pack(s, *u.tables[0], u.mult, u.message)
                   for u, s in zip(units, shards)]
    filled = [max(at + (hi - lo) * (1 if k >= 0 else u.es) for k, lo, hi, at in u.pieces[r])
              for r, u in enumerate(units)]
    out = torch.cat(sends)
    buffers = {}
    for name in ("eager", "fused"):
        codes = torch.zeros(flat.numel(), dtype=torch.uint8, device=ctx.device)
        buffers[name] = (codes, torch.zeros_like(flat))
    fp8_gather.unpack_eager(out, unit.unpack_rows, unit.scales, *buffers["eager"])
    fp8_gather.fp8_gather_unpack(out, unpack, unpack_blocks, unit.scales, *buffers["fused"])
    weight = torch.zeros(flat.numel(), dtype=torch.bool, device=ctx.device)
    for slot, _, _ in slots:
        weight[slot.start:slot.start + slot.numel] = True
    (c0, f0), (c1, f1) = buffers["eager"], buffers["fused"]
    equal = {"messages": all(bool(torch.equal(a[:n], b[:n]))
                             for a, b, n in zip(sends, fused_sends, filled)),
             "codes": bool(torch.equal(c0[weight], c1[weight])),
             "full": bool(torch.equal(f0.view(torch.int16), f1.view(torch.int16)))}
    times = {
        "pack_eager": median_time(ctx, lambda: fp8_gather.pack_eager(
            shards[0], unit.pack_rows, unit.mult, unit.message), rounds),
        "pack_fused": median_time(ctx, lambda: fp8_gather.fp8_gather_pack(
            shards[0], pack, pack_blocks, unit.mult, unit.message), rounds),
        "unpack_eager": median_time(ctx, lambda: fp8_gather.unpack_eager(
            out, unit.unpack_rows, unit.scales, *buffers["eager"]), rounds),
        "unpack_fused": median_time(ctx, lambda: fp8_gather.fp8_gather_unpack(
            out, unpack, unpack_blocks, unit.scales, *buffers["fused"]), rounds)}
    elements = int(weight.sum())
    return {"ranks": len(units), "weight_elements": elements, "seconds": times,
            "speedup": {"pack": times["pack_eager"] / times["pack_fused"],
                        "unpack": times["unpack_eager"] / times["unpack_fused"]},
            # the planner's bytes (plan/fp8.py gather_bytes' terms) at the fused times
            "fused_hbm_tbps": {"pack": elements / len(units) * 3 / times["pack_fused"] / 1e12,
                               "unpack": elements * 4 / times["unpack_fused"] / 1e12},
            "kernel": ("Triton" if triton_usable(ctx.device)
                       else "torch ops (no Triton on this device)"),
            "equal": equal, "passed": all(equal.values())}
