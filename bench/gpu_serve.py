"""bench/gpu.py's serving items at GPU speed (registered in its ITEMS):

  serve_decode_profile   one decode step of 16 requests, before (the model's modules,
                         eager, gather + SDPA) and after (fused forward, paged kernel, CUDA
                         graph): host time by function (cProfile) beside torch.profiler's
                         device time by kernel, and the syncs (cudaStreamSynchronize,
                         cudaMemcpy*, cudaDeviceSynchronize) a step makes
  serve_16_requests      16 requests x 128 tokens (prompts 128, 135, ...): transformers'
                         generate against the engine with each switch (fused forward, paged
                         kernel, CUDA graphs) turned on in turn, in the same run; goal >= 2x
  serve_async            the same 16 requests x 128 tokens, the engine as served (fused,
                         kernel, graphs) with async scheduling off and on (serve/
                         async_step.py), alternating in the same run: tokens/s of each,
                         on / off, identical outputs, a decode step's wall time and syncs
  serve_128_mixed        128 requests of mixed lengths (prompts 32-512, outputs 16-256), all
                         at t = 0: the engine (continuous batching, paged cache) against
                         transformers' static batches of 32; goal >= 4x; TTFT and
                         inter-token latency percentiles of both

serve_16_requests and serve_decode_profile run synchronous steps (async scheduling off:
one switch at a time; serve_async turns it on); serve_128_mixed runs the engine as served
(async scheduling on, CUDA's default).

Same weights (smollm2-135m shaped, random init, bf16 on CUDA), greedy, EOS ignored; the
number of requests whose tokens agree is recorded beside each rate. On CPU (--dry-run) the
same code with a tiny model and a few requests; the graphs switch runs the static path
without capture there.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re
import statistics
import time

import torch
from gpu_items import NotRun, median_time  # noqa: F401  (NotRun: items' one-line reasons)

from fivefold.serve.kv_cache_manager import cdiv


def _serve_bench():
    """bench/serve/serve.py, loaded by its path: with bench/ on sys.path, `import serve`
    finds the folder bench/serve/ instead."""
    import importlib.util
    import sys
    from pathlib import Path

    if "bench_serve" not in sys.modules:
        path = Path(__file__).resolve().parent / "serve" / "serve.py"
        spec = importlib.util.spec_from_file_location("bench_serve", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_serve"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_serve"]

SHAPES = {  # preset, requests, prompt, output; mixed: requests, static batch
    False: {"preset": "smollm2-135m", "dtype": torch.bfloat16, "requests": 16, "prompt": 128,
            "output": 128, "mixed": (128, 32, (32, 512), (16, 256))},
    True: {"preset": "tiny", "dtype": torch.float32, "requests": 3, "prompt": 8, "output": 4,
           "mixed": (5, 2, (4, 24), (2, 8))},
}
# (label, fuse, paged kernel, cuda graphs): each switch on in turn, same run
CONFIGS = [("modules_eager", False, False, False), ("fused_eager_gather", True, False, False),
           ("fused_eager_kernel", True, True, False), ("fused_graphs_kernel", True, True, True)]


def _setup(ctx):
    import transformers

    from fivefold.models.hf import save_hf
    from fivefold.models.init import build_model
    from fivefold.models.presets import preset

    s = SHAPES[ctx.dry]
    base = preset(s["preset"])
    cfg = base.replace(max_seq_len=max(base.max_seq_len, 1024))
    model = build_model(cfg, seed=0).eval()
    directory = ctx.tmp / "gpu-serve-hf"
    if not directory.exists():
        save_hf(model, cfg, directory)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=s["dtype"])
    except TypeError:  # transformers before 4.56 names it torch_dtype
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=s["dtype"])
    hf = hf.to(ctx.device).eval()
    hf.generation_config.eos_token_id = None
    return cfg, model.to(ctx.device, s["dtype"]), hf, s


def _engine(ctx, model, kernel: bool, graphs: bool, fuse: bool, **kw):
    from fivefold.serve.engine import Engine

    os.environ["FIVEFOLD_PAGED_KERNEL"] = "1" if kernel else "0"
    static = ("static" if ctx.dry else True) if graphs else False
    return Engine(model, max_model_len=1024, fuse=fuse, cuda_graphs=static, **kw)


def _run_engine(engine, prompts, outputs) -> tuple[list, list]:
    from fivefold.serve.sampling_params import SamplingParams

    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
           for p, m in zip(prompts, outputs)]
    for rid in ids:
        engine.scheduler.requests[rid].arrival_time = start
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    outs = [final[i] for i in ids]
    return [o.token_ids for o in outs], [[o.arrival_time] + o.token_times for o in outs]


def _hf_batches(ctx, hf, prompts, outputs, batch: int) -> tuple[list, list]:
    StepClock = _serve_bench().StepClock

    tokens, times = [], []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch):
        chunk, wanted = prompts[b:b + batch], outputs[b:b + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=ctx.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                            device=ctx.device)
        clock = StepClock()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(wanted),
                              do_sample=False, pad_token_id=0, streamer=clock)
        for row, m in zip(out[:, width:].tolist(), wanted):
            tokens.append(row[:m])
            times.append([start] + clock.times[:m])
    return tokens, times


def _latency(times: list[list[float]]) -> dict:
    percentiles = _serve_bench().percentiles

    return {"ttft_s": percentiles([t[1] - t[0] for t in times if len(t) > 1]),
            "itl_s": percentiles([b - a for t in times for a, b in zip(t[1:], t[2:])])}


def _prompts(cfg, n, prompt, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, cfg.vocab_size, (prompt + 7 * i,), generator=g).tolist()
            for i in range(n)]


def serve_16_requests(ctx) -> dict:
    cfg, model, hf, s = _setup(ctx)
    prompts = _prompts(cfg, s["requests"], s["prompt"])
    outputs = [s["output"]] * len(prompts)
    rounds = 1  # after a warm-up run; the modules' eager engine alone is ~15 s on an H100
    hf_tokens, _ = _hf_batches(ctx, hf, prompts, outputs, len(prompts))
    hf_s = median_time(ctx, lambda: _hf_batches(ctx, hf, prompts, outputs, len(prompts)),
                       rounds, warmup=0)
    total = sum(outputs)
    result = {"model": cfg.name, "dtype": str(s["dtype"]), "requests": len(prompts),
              "output_tokens": s["output"], "tokens_per_s": {"transformers": total / hf_s},
              "ratio_vs_transformers": {}, "identical_outputs": {}}
    for label, fuse, kernel, graphs in CONFIGS:
        engine = _engine(ctx, model, kernel, graphs, fuse, max_num_seqs=len(prompts),
                         num_blocks=len(prompts) * 1024 // 16 + 8, async_scheduling="off")
        tokens, times = _run_engine(engine, prompts, outputs)  # warm-up (and graph capture)
        sec = median_time(ctx, lambda e=engine: _run_engine(e, prompts, outputs), rounds,
                          warmup=0)
        result["tokens_per_s"][label] = total / sec
        result["ratio_vs_transformers"][label] = hf_s / sec
        result["identical_outputs"][label] = sum(a == b for a, b in zip(tokens, hf_tokens))
        if label == CONFIGS[-1][0]:
            result["latency_engine"] = _latency(times)
    os.environ.pop("FIVEFOLD_PAGED_KERNEL", None)
    return result


def serve_128_mixed(ctx) -> dict:
    cfg, model, hf, s = _setup(ctx)
    n, batch, (p_lo, p_hi), (o_lo, o_hi) = s["mixed"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, cfg.vocab_size, (int(m),), generator=g).tolist()
               for m in torch.randint(p_lo, p_hi + 1, (n,), generator=g)]
    outputs = torch.randint(o_lo, o_hi + 1, (n,), generator=g).tolist()
    _hf_batches(ctx, hf, prompts[:batch], [2] * batch, batch)  # warm-up
    start = time.perf_counter()
    hf_tokens, hf_times = _hf_batches(ctx, hf, prompts, outputs, batch)
    ctx.sync()
    hf_s = time.perf_counter() - start
    engine = _engine(ctx, model, True, True, True, max_num_seqs=n, max_num_batched_tokens=8192,
                     num_blocks=n * cdiv(p_hi + o_hi, 16) + 64)  # all at once, no more
    _run_engine(engine, prompts[:4], [2] * 4)  # warm-up
    start = time.perf_counter()
    tokens, times = _run_engine(engine, prompts, outputs)
    ctx.sync()
    sec = time.perf_counter() - start
    total = sum(outputs)
    return {"model": cfg.name, "requests": n, "static_batch": batch,
            "prompt_tokens": [p_lo, p_hi], "output_tokens": [o_lo, o_hi],
            "tokens_per_s": {"transformers_static": total / hf_s, "engine": total / sec},
            "ratio_vs_transformers": hf_s / sec, "kv_blocks": engine.num_blocks,
            "preemptions": engine.scheduler.num_preemptions,
            "identical_outputs": sum(a == b for a, b in zip(tokens, hf_tokens)),
            "latency_engine": _latency(times), "latency_transformers": _latency(hf_times)}


def serve_decode_profile(ctx) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cfg, model, _, s = _setup(ctx)
    prompts = _prompts(cfg, s["requests"], s["prompt"])
    result = {"model": cfg.name, "sequences": len(prompts)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if ctx.device.type == "cuda" else [])
    for label, fuse, kernel, graphs in (CONFIGS[0], CONFIGS[-1]):  # before, after
        engine = _engine(ctx, model, kernel, graphs, fuse, max_num_seqs=len(prompts),
                         num_blocks=len(prompts) * 1024 // 16 + 8, async_scheduling="off")
        from fivefold.serve.sampling_params import SamplingParams

        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=64, temperature=0,
                                                 ignore_eos=True))
        for _ in range(4):  # the prefill, then decode steps (the graph captured)
            engine.step()
        ctx.sync()
        wall = median_time(ctx, engine.step, 3 if ctx.dry else 10, warmup=0)
        prof = cProfile.Profile()
        cpu = time.process_time()
        prof.enable()
        engine.step()
        prof.disable()
        host_ms = (time.process_time() - cpu) * 1e3
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        with profile(activities=activities) as tp:
            engine.step()
            ctx.sync()
        events = tp.key_averages()
        device_attr = "device_time_total" if hasattr(events[0], "device_time_total") \
            else "cuda_time_total"
        kernels = sorted(((e.key, getattr(e, device_attr, 0), e.count) for e in events
                          if getattr(e, device_attr, 0) > 0), key=lambda k: -k[1])[:15]
        syncs = {e.key: e.count for e in events if "Synchronize" in e.key
                 or "Memcpy" in e.key or e.key.startswith("aten::item")
                 or e.key == "aten::_local_scalar_dense"}
        result[label] = {
            "step_wall_ms": wall * 1e3, "step_host_cpu_ms": host_ms,
            "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
            "kernel_launches": sum(e.count for e in events if e.key in (
                "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")),
            "graph_replays": sum(e.count for e in events if e.key == "cudaGraphLaunch"),
            "device_us_by_kernel": [{"kernel": k[:120], "us": t, "count": c}
                                    for k, t, c in kernels],
            "syncs": syncs,
            "host_by_function": [re.sub(r"\S*/(site-packages|src)/", "", line)  # no paths
                                 for line in text.getvalue().splitlines()[:40]]}
    before, after = result[CONFIGS[0][0]], result[CONFIGS[-1][0]]
    result["host_ms_before_over_after"] = before["step_host_cpu_ms"] / max(
        after["step_host_cpu_ms"], 1e-9)
    os.environ.pop("FIVEFOLD_PAGED_KERNEL", None)
    return result


def serve_async(ctx) -> dict:
    """Async scheduling off against on: same model, requests and switches otherwise, each
    round timing both (the order alternating), the median of the rounds."""
    from fivefold.models.init import build_model
    from fivefold.models.presets import preset
    from fivefold.serve.sampling_params import SamplingParams

    s = SHAPES[ctx.dry]
    base = preset(s["preset"])
    cfg = base.replace(max_seq_len=max(base.max_seq_len, 1024))
    model = build_model(cfg, seed=0).eval().to(ctx.device, s["dtype"])
    prompts = _prompts(cfg, s["requests"], s["prompt"])
    outputs = [s["output"]] * len(prompts)
    engines = {mode: _engine(ctx, model, True, True, True, max_num_seqs=len(prompts),
                             num_blocks=len(prompts) * 1024 // 16 + 8,
                             async_scheduling=mode) for mode in ("off", "on")}
    tokens = {mode: _run_engine(e, prompts, outputs)[0]  # warm-up (and graph capture)
              for mode, e in engines.items()}
    times = {mode: [] for mode in engines}
    for r in range(1 if ctx.dry else 3):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            ctx.sync()
            start = time.perf_counter()
            _run_engine(engines[mode], prompts, outputs)
            ctx.sync()
            times[mode].append(time.perf_counter() - start)
    total = sum(outputs)
    rate = {mode: total / statistics.median(t) for mode, t in times.items()}
    result = {"model": cfg.name, "dtype": str(s["dtype"]), "requests": len(prompts),
              "output_tokens": s["output"], "tokens_per_s": rate,
              "async_on_over_off": rate["on"] / rate["off"],
              "identical_outputs": sum(a == b for a, b in zip(tokens["on"], tokens["off"])),
              "steps_ahead": engines["on"].stats()["steps_ahead"], "decode_step": {}}
    if ctx.dry:
        result["note"] = "CPU: the device is the host, nothing overlaps; not a speed number"
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if ctx.device.type == "cuda" else [])
    for mode, engine in engines.items():  # one decode step in the middle of a run
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=16, temperature=0,
                                                 ignore_eos=True))
        walls = []
        for _ in range(8):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        with profile(activities=activities) as prof:
            engine.step()
        while engine.has_unfinished():
            engine.step()
        events = prof.key_averages()
        result["decode_step"][mode] = {
            "wall_ms_median_of_steps_3_to_8": statistics.median(walls[2:]) * 1e3,
            "syncs": {e.key: e.count for e in events if "Synchronize" in e.key
                      or e.key in ("cudaMemcpy", "aten::_local_scalar_dense")},
            "copies_to_host": sum(e.count for e in events if "DtoH" in e.key)}
    os.environ.pop("FIVEFOLD_PAGED_KERNEL", None)
    return result

