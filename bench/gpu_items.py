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
