"""bench/gpu.py's items for the training step at GPU speed (issue: training at GPU speed):

  step_before_after   the 8B-shaped 2-block step (train_8b_blocks' shape) with the chunked
                      loss (before), the fused loss, the fused loss with the RMSNorm and RoPE
                      kernels (models/block_kernels.py: eager's default), that on torch's
                      fused AdamW over fp32 gradient copies instead of the one-pass AdamW
                      (parallel/adamw_kernel.py), and that with each block compiled
                      (train.compile = true, what auto picks on CUDA): tokens/s, MFU, the
                      planner's MFU and the trace's predicted step beside each
  hf_peer_compiled    transformers' LlamaForCausalLM of the same shape, bf16, compiled
                      (torch.compile of the model on CUDA; eager in a dry run), fused AdamW:
                      its step time and tokens/s against the fastest fivefold variant
  step_profile        torch.profiler's table of one fused-loss step (device time by kernel on
                      CUDA, CPU time in a dry run), top 15 rows
  adamw_one_pass      parallel/adamw_kernel.py on bf16 against torch's fused AdamW, and its
                      time beside the cast, torch's AdamW and the copy it replaces
"""

from __future__ import annotations

import contextlib
import time

import torch
from gpu_items import Context, NotRun, load_config, median_time, train_steps, world_of_one

# name, the fused loss, the norm and RoPE kernels, train.compile, the one-pass AdamW
VARIANTS = (("chunked_loss_eager", False, False, "false", True),
            ("fused_loss_eager", True, False, "false", True),
            ("fused_loss_block_kernelss_torch_adamw_eager", True, True, "false", False),
            ("fused_loss_block_kernelss_eager", True, True, "false", True),
            ("fused_loss_compiled", True, True, "true", True))


@contextlib.contextmanager
def loss_path(fused: bool, norms: bool = True, adamw: bool = True):
    """The fused loss (models/loss.py), the norm and RoPE kernels (models/block_kernels.py)
    and the one-pass AdamW (parallel/adamw_kernel.py) on or off."""
    from fivefold.models import block_kernels, loss
    from fivefold.parallel import adamw_kernel

    before = loss.FUSED_ON_DEVICE, block_kernels.FUSED_ON_DEVICE, adamw_kernel.FUSED_ON_DEVICE
    loss.FUSED_ON_DEVICE, block_kernels.FUSED_ON_DEVICE = fused, norms
    adamw_kernel.FUSED_ON_DEVICE = adamw
    try:
        yield
    finally:
        (loss.FUSED_ON_DEVICE, block_kernels.FUSED_ON_DEVICE,
         adamw_kernel.FUSED_ON_DEVICE) = before


def _predicted(overrides: list[str], device: torch.device, fused: bool,
               norms: bool = True, adamw: bool = True) -> float | None:
    """The trace's predicted step on this GPU (None off the catalog or in a dry run)."""
    if device.type != "cuda":
        return None
    from fivefold.plan.hardware import hardware_for_device_name
    from fivefold.trace import trace_step

    hw = hardware_for_device_name(torch.cuda.get_device_name(device))
    if hw is None:
        return None
    with loss_path(fused, norms, adamw):
        return trace_step(list(overrides), gpu=hw.name, planner=False).timeline.step_s


def step_before_after(ctx: Context) -> dict:
    overrides = ctx.shape("blocks_overrides")
    out = {}
    for name, fused, norms, compiled, adamw in VARIANTS:
        if compiled == "true" and ctx.dry:
            out[name] = {"status": "not run", "reason": "compiling on a CPU takes minutes; "
                                                        "the GPU run measures it"}
            continue
        with loss_path(fused, norms, adamw):
            run = train_steps(ctx, f"step-{name}", [*overrides, "--train.compile", compiled])
        out[name] = {k: run[k] for k in ("tokens_per_s", "step_time_s", "mfu", "planned_mfu",
                                         "losses")}
        try:
            out[name]["trace_predicted_step_s"] = _predicted(overrides, ctx.device, fused,
                                                             norms, adamw)
        except Exception as e:  # noqa: BLE001  the measurement stands without the prediction
            out[name]["trace_predicted_step_s"] = None
            out[name]["trace_note"] = str(e).splitlines()[0][:200]
    base = out["chunked_loss_eager"]["tokens_per_s"]
    out["ratio_vs_chunked"] = {k: v["tokens_per_s"] / base for k, v in out.items()
                               if isinstance(v, dict) and "tokens_per_s" in v}
    return out


def _hf_model(ctx: Context):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise NotRun(f"transformers is not installed: {e}") from None
    cfg = load_config(ctx, "hf-peer", ctx.shape("blocks_overrides"))
    mc = cfg.model.resolve()
    hf_cfg = LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
                         intermediate_size=mc.intermediate_size,
                         num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                         num_key_value_heads=mc.num_kv_heads, max_position_embeddings=max(
                             mc.max_seq_len, cfg.train.seq_len), rms_norm_eps=mc.norm_eps,
                         rope_theta=mc.rope_theta, tie_word_embeddings=mc.tie_embeddings,
                         attn_implementation="sdpa")
    return cfg, LlamaForCausalLM(hf_cfg)


def hf_peer_compiled(ctx: Context) -> dict:
    cfg, model = _hf_model(ctx)
    model = model.to(ctx.device, torch.bfloat16)
    compiled = ctx.device.type == "cuda"
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5,
                            fused=ctx.device.type in ("cuda", "cpu"))
    seq = cfg.train.seq_len
    ids = torch.randint(0, model.config.vocab_size, (cfg.train.gbs, seq), device=ctx.device)

    def step():
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps, warmup = ctx.shape("train_steps")
    began = time.perf_counter()
    step_s = median_time(ctx, step, steps, warmup + (1 if compiled else 0))
    tokens = cfg.train.gbs * seq
    out = {"compiled": compiled, "step_time_s": step_s, "tokens_per_s": tokens / step_s,
           "seconds_with_compile": time.perf_counter() - began}
    mine = ctx.results.get("step_before_after", {})
    best = max((v["tokens_per_s"] for v in mine.values()
                if isinstance(v, dict) and "tokens_per_s" in v), default=None)
    if best:
        out["fivefold_best_over_hf"] = best / out["tokens_per_s"]
    return out


def step_profile(ctx: Context) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.bench import FivefoldRunner

    cfg = load_config(ctx, "profile", [*ctx.shape("blocks_overrides"), "--train.steps", "3",
                                       "--train.precision", "bf16", "--train.compile", "false"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if ctx.device.type == "cuda" else [])
    with world_of_one(ctx, "profile"):
        runner = FivefoldRunner(cfg, ParallelDims.from_config(cfg.parallel))
        try:
            runner.step()  # warm-up: the optimizer's states exist from here on
            ctx.sync()
            with profile(activities=activities) as prof:
                runner.step()
                ctx.sync()
        finally:
            runner.trainer.close()
    key = "cuda_time_total" if ctx.device.type == "cuda" else "cpu_time_total"
    events = prof.key_averages()
    table = events.table(sort_by=key, row_limit=15)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    print(table)
    return {"sort_by": key, "table": table, "kernel_launches": launches,
            "ops": len(events)}


def adamw_one_pass(ctx: Context) -> dict:
    """parallel/adamw_kernel.py on the GPU, bf16 gradients and parameters (the interpreter
    cannot check bf16): against torch's fused AdamW on the fp32 copies the step made before,
    3 steps of 2^24 values, in the units of tests/test_adamw_kernel.py (bound 3 after 3
    steps), the parameter the master rounded, a skipped step writing nothing; and the time of
    one step beside the old path's (cast-and-clip, torch's fused AdamW, copy into bf16)."""
    from fivefold.parallel import adamw_kernel as K

    if ctx.device.type != "cuda" or not K.triton_usable(ctx.device):
        raise NotRun("the one-pass AdamW runs on CUDA with Triton (tests/test_adamw_kernel.py "
                     "checks it in Triton's interpreter, fp32 and fp16)")
    dev, n = ctx.device, 1 << 24
    lr, b1, b2, wd, eps = 1e-3, 0.9, 0.95, 0.1, 1e-8
    gen = torch.Generator(device=dev).manual_seed(0)
    master = torch.randn(n, device=dev, generator=gen)
    mine = [master.clone(), torch.zeros(n, device=dev), torch.zeros(n, device=dev),
            torch.zeros((), device=dev)]
    ref = [t.clone() for t in mine]
    param = master.to(torch.bfloat16)
    f1, f2 = torch.tensor(2.0**-3, device=dev), torch.tensor(0.3719, device=dev)
    ok = torch.zeros((), device=dev)
    worst = 0.0
    for _ in range(3):
        g = (torch.randn(n, device=dev, generator=gen) * 8e-2).to(torch.bfloat16)
        mine[3] += 1
        K.adamw_mixed_(mine[0], g, mine[1], mine[2], param, mine[3], f1, f2, ok, lr, b1, b2,
                       wd, eps)
        ref[3] += 1
        torch._fused_adamw_([ref[0]], [g.float() * f1 * f2], [ref[1]], [ref[2]], [], [ref[3]],
                            lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                            amsgrad=False, maximize=False)
        unit = 2.0**-22 * ref[0].abs() + 2.0**-20 * lr
        worst = max(worst, float(((mine[0] - ref[0]).abs() / unit).max()))
    before = [t.clone() for t in (*mine[:3], param)]
    K.adamw_mixed_(mine[0], torch.full_like(g, float("nan")), mine[1], mine[2], param,
                   mine[3], f1, f2, torch.ones((), device=dev), lr, b1, b2, wd, eps)
    skipped = all(torch.equal(a, b) for a, b in zip(before, (*mine[:3], param)))
    param_ok = torch.equal(param, mine[0].to(torch.bfloat16))

    def one_pass():
        K.adamw_mixed_(mine[0], g, mine[1], mine[2], param, mine[3], f1, f2, ok, lr, b1, b2,
                       wd, eps)

    def torch_path():
        copy = torch.mul(g, (f1 * f2).reshape(1))
        torch._fused_adamw_([ref[0]], [copy], [ref[1]], [ref[2]], [], [ref[3]], lr=lr,
                            beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False,
                            maximize=False)
        param.copy_(ref[0])

    fast, slow = (median_time(ctx, fn, 20, 3) for fn in (one_pass, torch_path))
    return {"values": n, "worst_vs_torch_units": worst, "within_bound": worst <= 3.0,
            "param_is_master": param_ok,
            "skip_writes_nothing": skipped, "one_pass_s": fast, "torch_path_s": slow,
            "one_pass_GBps": 28 * n / fast / 1e9, "speedup": slow / fast}
