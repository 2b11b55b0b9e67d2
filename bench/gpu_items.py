"""The items of bench/gpu.py: each a function of the run context that returns its numbers
(a dict) or raises NotRun with the one-line reason it cannot run here. Shapes come from
`ctx.shape(...)`: the GPU's (Llama-3-8B) or the dry run's tiny ones, same code path."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


class NotRun(Exception):
    """An item that cannot run on this device: its message is the reason, one line."""


@dataclasses.dataclass
class Context:
    device: torch.device
    dry: bool
    tmp: Path
    results: dict
    shapes: dict

    def shape(self, key: str):
        return self.shapes[key]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def median_time(ctx: Context, fn, rounds: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        ctx.sync()
        start = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- training steps (Trainer, as `fivefold train` runs them) --------------------------------

@contextlib.contextmanager
def world_of_one(ctx: Context, name: str):
    """A process group of one rank: NCCL on CUDA, gloo on CPU (file:// rendezvous), with one
    all-reduce that must give back its input. At world size 1 the trainer's own groups move
    nothing; this proves the backend starts and reduces on this machine."""
    import torch.distributed as dist

    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{ctx.tmp / ('pg-' + name)}",
                            rank=0, world_size=1)
    try:
        probe = torch.full((4,), 3.0, device=ctx.device)
        dist.all_reduce(probe)
        if probe.tolist() != [3.0] * 4:
            raise RuntimeError(f"{backend} all_reduce at world size 1 returned {probe.tolist()}")
        yield backend
    finally:
        dist.destroy_process_group()


def load_config(ctx: Context, name: str, overrides: list[str]):
    from fivefold import config
    from fivefold.train.bench import BENCH_DEFAULTS

    return config.load(None, [*BENCH_DEFAULTS, "--train.device", ctx.device.type,
                              "--checkpoint.dir", str(ctx.tmp / name / "ckpt"),
                              "--log.dir", str(ctx.tmp / name / "log"), *overrides])


def train_steps(ctx: Context, name: str, overrides: list[str]) -> dict:
    """Warm-up and timed bf16 training steps in a world of one; tokens/s, MFU, the plan."""
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.bench import FivefoldRunner, planned, summarize

    steps, warmup = ctx.shape("train_steps")
    cfg = load_config(ctx, name, ["--train.steps", str(steps + warmup), "--train.precision",
                                  "bf16", *overrides])
    with world_of_one(ctx, name) as backend:
        runner = FivefoldRunner(cfg, ParallelDims.from_config(cfg.parallel))
        try:  # the trainer's watchdog thread and hooks go before the process group does
            for _ in range(warmup):
                runner.step()
            records = [runner.step() for _ in range(steps)]
            trainer = runner.trainer
            tokens = cfg.train.gbs * cfg.train.seq_len
            out = summarize(records, tokens, 1, trainer.throughput.flops_per_token,
                            trainer.throughput.peak)
            plan = planned(trainer, ctx.device)
            model = trainer.model_cfg
        finally:
            runner.trainer.close()
    planned_tps = plan.get("tokens_per_s")
    return {"backend": backend, "model": model.name, "parameters": model.num_params(),
            "num_layers": model.num_layers, "tokens_per_step": tokens,
            "tokens_per_s": out["tokens_per_s"], "step_time_s": out["step_time_s"]["median"],
            "losses": [r.loss for r in records], "mfu": out["mfu"],
            "flops_per_token": trainer.throughput.flops_per_token,
            "peak_flops": trainer.throughput.peak, "planned_tokens_per_s": planned_tps,
            "planned_mfu": (planned_tps * trainer.throughput.flops_per_token
                            / trainer.throughput.peak) if planned_tps and
            trainer.throughput.peak else None, "planned_note": plan.get("note")}


def train_default(ctx: Context) -> dict:
    return train_steps(ctx, "default", ctx.shape("default_overrides"))


def train_8b_blocks(ctx: Context) -> dict:
    return train_steps(ctx, "blocks", ctx.shape("blocks_overrides"))


def mfu_vs_plan(ctx: Context) -> dict:
    run = ctx.results.get("train_8b_blocks", {})
    if run.get("status") != "ok":
        raise NotRun("needs the train_8b_blocks item, which did not run: "
                     + str(run.get("reason", "not reached")))
    if run["mfu"] is None or run["planned_mfu"] is None:
        raise NotRun(run.get("planned_note") or f"no catalogued bf16 peak for {ctx.device}")
    return {"model": run["model"], "num_layers": run["num_layers"], "mfu": run["mfu"],
            "planned_mfu": run["planned_mfu"], "measured_over_planned":
            run["mfu"] / run["planned_mfu"]}


# ---- FP8 ----------------------------------------------------------------------------------

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
            state = (DelayedState(torch.zeros(3, 16, device=ctx.device), [False] * 3, True)
                     if recipe.scaling == "delayed" else None)  # its first step dynamic
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


# ---- context parallelism's ring kernel ------------------------------------------------------

# bf16 output of two different attention algorithms: each rounds its output once (2^-8) and
# differs in the order of its fp32 softmax sums; 1e-2 relative in norm leaves room for a few
# bf16 roundings of intermediates, far below what a wrong mask or scale gives (O(1)).
CP_TOL = 1e-2


def cp_ring_vs_sdpa(ctx: Context) -> dict:
    sys.path.insert(0, str(ROOT / "bench" / "parallel"))
    import cp_kernel

    seq, heads, kv_heads, head_dim = ctx.shape("cp")
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    q, grad = (torch.randn(1, heads, seq, head_dim, generator=gen, device=ctx.device,
                           dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=gen, device=ctx.device,
                        dtype=torch.bfloat16) for _ in range(2))
    scale = head_dim ** -0.5
    rounds = ctx.shape("rounds")
    t_sdpa, (ref_out, ref_grads) = cp_kernel.timed(
        lambda: cp_kernel.run_sdpa(q, k, v, grad, scale), ctx.device, rounds)
    t_ring, (out, grads) = cp_kernel.timed(
        lambda: cp_kernel.run_kernel("portable", q, k, v, grad, scale), ctx.device, rounds)
    errors = {"out": cp_kernel.rel(out, ref_out)} | {
        name: cp_kernel.rel(a, b) for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads)}
    return {"shape": {"seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim},
            "portable_s": t_ring, "sdpa_s": t_sdpa, "portable_over_sdpa": t_ring / t_sdpa,
            "relative_errors": errors, "tolerance": CP_TOL,
            "within_bf16": max(errors.values()) < CP_TOL}


def free(ctx: Context) -> None:
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


# ---- memory: measured peak against the planner, item by item --------------------------------

def measured_vs_planned(ctx: Context, cfg) -> dict:
    """Two training steps; the second under the peak tracker (parallel/peak.py: bytes of
    the distinct storages held, by planner item) and, on CUDA, the allocator's peak."""
    from fivefold.parallel.peak import PeakTracker
    from fivefold.train.loop import planned_peak_bytes
    from fivefold.train.trainer import Trainer

    with Trainer(cfg, quiet=True) as trainer:
        trainer.train_step()  # Adam's moments exist from here on, as in any later step
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        with PeakTracker(trainer.peak_sources()) as tracker:
            trainer.train_step()
        cuda_peak = (int(torch.cuda.max_memory_allocated(ctx.device))
                     if ctx.device.type == "cuda" else None)
        plan = planned_peak_bytes(trainer)
        kernel = trainer.model.fp8_line or None  # under fp8: where its GEMMs ran
    return {"fp8_kernel": kernel, "cuda_max_allocated_bytes": cuda_peak,
            "tracked_peak_bytes": tracker.peak,
            "tracked_items": tracker.items_at_peak, "planned_peak_bytes": sum(plan.values()),
            "planned_items": plan,
            "cuda_over_planned": cuda_peak / sum(plan.values()) if cuda_peak else None}


MEMORY_LAYOUTS = {"full_recompute": ["--train.recompute", "full"],
                  "selective": ["--train.recompute", "selective"],
                  "fp8": ["--train.precision", "fp8"]}


def peak_memory_vs_plan(ctx: Context) -> dict:
    out, failed = {}, {}
    for name, layout in MEMORY_LAYOUTS.items():
        precision = [] if "fp8" in layout else ["--train.precision", "bf16"]
        try:
            cfg = load_config(ctx, f"mem-{name}", ["--train.steps", "2", *precision,
                                                   *ctx.shape("blocks_overrides"), *layout])
            out[name] = measured_vs_planned(ctx, cfg)
        except Exception as e:  # noqa: BLE001  one layout's failure leaves the others
            failed[name] = one_line(e)
        free(ctx)
    if not out:
        raise NotRun("every layout failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    return {"layouts": out, "failed": failed}


# ---- serving ------------------------------------------------------------------------------

def serve_vs_transformers(ctx: Context) -> dict:
    """Greedy decoding of the same requests by the Engine and by transformers' generate:
    output tokens/s of each and how many requests' tokens agree."""
    import transformers

    from fivefold.models.hf import save_hf
    from fivefold.models.init import build_model
    from fivefold.models.presets import preset
    from fivefold.serve.engine import Engine
    from fivefold.serve.sampling_params import SamplingParams

    name, requests, prompt_len, output_len, dtype = ctx.shape("serve")
    cfg = preset(name).replace(max_seq_len=max(preset(name).max_seq_len, 512))
    model = build_model(cfg, seed=0).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        prompts = [torch.randint(1, cfg.vocab_size, (prompt_len + 7 * i,)).tolist()
                   for i in range(requests)]
    save_hf(model, cfg, ctx.tmp / "serve-hf")
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(ctx.tmp / "serve-hf", dtype=dtype)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        hf = transformers.AutoModelForCausalLM.from_pretrained(ctx.tmp / "serve-hf",
                                                               torch_dtype=dtype)
    hf = hf.to(ctx.device).eval()
    hf.generation_config.eos_token_id = None
    model = model.to(ctx.device, dtype)

    def fivefold_run():
        engine = Engine(model, max_num_seqs=requests, max_model_len=512,
                        num_blocks=requests * 512 // 16 + 8)
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        final = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o.token_ids
        return [list(final[i]) for i in ids]

    def hf_run():
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=ctx.device)
        mask = (torch.arange(width, device=ctx.device)[None] >= torch.tensor(
            [width - len(p) for p in prompts], device=ctx.device)[:, None]).long()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                              do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    times, outputs = {}, {}
    for label, fn in (("fivefold", fivefold_run), ("transformers", hf_run)):
        outputs[label] = fn()  # warm-up, and the outputs compared
        times[label] = median_time(ctx, fn, ctx.shape("rounds"), warmup=0)
    tokens = requests * output_len
    same = sum(a == b for a, b in zip(outputs["fivefold"], outputs["transformers"]))
    return {"model": name, "dtype": str(dtype), "requests": requests,
            "prompt_tokens": [len(p) for p in prompts], "output_tokens": output_len,
            "tokens_per_s": {k: tokens / t for k, t in times.items()},
            "ratio": times["transformers"] / times["fivefold"],
            "identical_outputs": same, "transformers": transformers.__version__}


# ---- QLoRA ---------------------------------------------------------------------------------

def qlora_step(ctx: Context) -> dict:
    """A QLoRA step (NF4 base from a saved Hugging Face directory), peak memory vs the plan."""
    from fivefold import config
    from fivefold.models.hf import save_hf
    from fivefold.models.init import build_model

    shape_args, seq_len = ctx.shape("qlora")
    shape = config.load(None, shape_args).model.resolve()
    save_hf(build_model(shape, seed=0, dtype=torch.bfloat16), shape, ctx.tmp / "qlora-hf")
    cfg = load_config(ctx, "qlora", [
        "--model.hf_path", str(ctx.tmp / "qlora-hf"), "--data.tokenizer", "byte",
        "--train.seq_len", str(seq_len), "--train.gbs", "1", "--parallel.mbs", "1",
        "--train.steps", "2", "--train.warmup_steps", "0", "--train.precision", "bf16",
        "--lora.rank", "16", "--lora.base", "nf4"])
    start = time.perf_counter()
    out = measured_vs_planned(ctx, cfg)
    out["two_steps_s"] = time.perf_counter() - start
    out["parameters"] = shape.num_params()
    return out


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
