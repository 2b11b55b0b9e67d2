"""Serving throughput: fivefold's engine vs transformers' `generate` on the same requests.

    python bench/serve/serve.py [--preset llama-25m] [--requests 64] [--batch 16] [--threads 1]

The workload: `--requests` greedy requests, all arriving at once, with prompt lengths drawn
uniformly from 16-256 tokens and output lengths from 16-256 (EOS ignored: every request
produces exactly its `max_tokens`). Both runs use the same weights (fivefold's model saved
as a Hugging Face directory and loaded by transformers), fp32, on this CPU:

- fivefold, same batch: `Engine` with continuous batching, at most `--batch` sequences per
  step, a paged KV cache of 16-token blocks, its linears as `fivefold serve` runs them:
  prepacked for oneDNN where a start-up probe on the model's shapes finds that faster on
  this CPU, else sgemm (serve/prepack.py; the probe's times and choice are in the JSON);
- fivefold, same KV memory: no cap on sequences, but a KV pool of only as many token slots
  as transformers' static batch reserves (`--batch` × (256 + 256): every row padded to the
  longest prompt plus the longest output). This is PagedAttention's claim: in the memory a
  static batch reserves, paging fits more sequences;
- fivefold, same batch, sgemm linears: as the first, but its linears call torch's `F.linear`
  (BLAS sgemm) as transformers' do (`--no-prepack`): the gain of batching and paging alone;
- fivefold, same batch, prepacked linears (forced, whatever the probe said);
- transformers: `model.generate` over static batches of `--batch` requests in arrival order,
  prompts left-padded to the batch's longest, each batch generating up to its longest
  `max_tokens` (the tokens past a request's own `max_tokens` are not counted).

Printed and written to bench/results/serve.json: output tokens/s, requests/s, time to first
token and inter-token latency percentiles (p50, p90, p99; all requests arrive at t = 0, so
a request of a later static batch waits for the earlier ones), the ratio of tokens/s, how
many requests' tokens agree between the two, one decode step of each at the same batch
and context timed alone, the machine (CPU model from /proc/cpuinfo), versions and git
revision. On a shared machine compare the tokens per CPU-second ratios: with one thread
they hardly depend on what else runs.

    python bench/serve/serve.py --step-only --preset smollm2-135m --baseline efcc609

`--step-only` measures the host work of one decode step instead: `--batch` greedy requests
(prompts of 128, 135, ... tokens, as bench/gpu.py's serve item) past their prefill, the
wall and CPU milliseconds of each of `--steps` decode steps (median) and the aten ops one
step calls (torch.profiler), written to bench/results/serve_step.json. `--baseline REV`
also runs the engine of git revision REV (its src/ exported to a temporary directory), in
alternating child processes, `--rounds` each, and records both, their ratio and whether
the greedy tokens agree. `--one-call` puts every decoding sequence into one padded SDPA
call a layer, as on CUDA (on CPU they are otherwise cut into cache-sized groups).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# a child of --baseline runs another revision's engine: its src/ comes first
sys.path.insert(0, os.environ.get("FIVEFOLD_BENCH_SRC") or str(ROOT / "src"))

from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import preset  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402
from fivefold.train.bench import cpu_model, git_revision, machine  # noqa: E402


def workload(n: int, vocab: int, seed: int, prompt=(16, 256), output=(16, 256)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g).tolist()
    outputs = torch.randint(output[0], output[1] + 1, (n,), generator=g).tolist()
    # ids 3.. : clear of the pad and special ids transformers might treat specially
    prompts = [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]
    return prompts, outputs


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(values)}


def summarize(name, seconds, outputs, first_times, token_times, cpu_seconds) -> dict:
    """`cpu_seconds`: this process's CPU time over the run. On a shared machine the wall
    clock of two runs made one after the other depends on what else ran meanwhile; with one
    thread, tokens per CPU-second is far less sensitive to that, so both are reported."""
    tokens = sum(len(o) for o in outputs)
    itl = [b - a for times in token_times for a, b in zip(times, times[1:])]
    return {"name": name, "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "requests_per_s": len(outputs) / seconds,
            "cpu_seconds": cpu_seconds, "tokens_per_cpu_s": tokens / cpu_seconds,
            "ttft_s": percentiles(first_times), "itl_s": percentiles(itl)}


def run_fivefold(model, prompts, outputs, name: str, max_num_seqs: int,
                 num_blocks: int, prepack: bool | str = "auto") -> tuple[dict, list[list[int]]]:
    engine = Engine(model, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                    max_num_batched_tokens=4096, max_model_len=512, prepack=prepack)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in outputs]
    cpu = time.process_time()
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for rid in ids:  # all arrive at t = 0
        engine.scheduler.requests[rid].arrival_time = start
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    outs = [final[i] for i in ids]
    result = summarize(name, seconds, [o.token_ids for o in outs],
                       [o.first_token_time - start for o in outs],
                       [o.token_times for o in outs], cpu)
    result["steps"] = engine.num_steps
    result["preemptions"] = engine.scheduler.num_preemptions
    result["max_num_seqs"], result["kv_blocks"] = max_num_seqs, num_blocks
    result["prepacked_linears"] = engine.num_prepacked
    if engine.linear_probe is not None:
        result["linear_probe"] = vars(engine.linear_probe)
    return result, [o.token_ids for o in outs]


class StepClock:
    """A transformers streamer that only notes when each step's tokens appear."""

    def __init__(self):
        self.times: list[float] = []
        self.first = True

    def put(self, value):
        if self.first:  # generate first hands over the prompt
            self.first = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_transformers(hf, prompts, outputs, batch: int, pad_id: int):
    cpu = time.process_time()
    start = time.perf_counter()
    tokens, first_times, token_times = [], [], []
    for b in range(0, len(prompts), batch):
        chunk, wanted = prompts[b:b + batch], outputs[b:b + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        clock = StepClock()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(wanted),
                              do_sample=False, pad_token_id=pad_id, streamer=clock)
        for row, m in zip(out[:, width:].tolist(), wanted):
            tokens.append(row[:m])
            first_times.append(clock.times[0] - start)
            token_times.append(clock.times[:m])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return summarize("transformers", seconds, tokens, first_times, token_times, cpu), tokens


def decode_step_ms(model, hf, batch: int, context: int, rounds: int = 7) -> dict:
    """One decode step of `batch` sequences of `context` tokens, alone: the engine (paged
    cache, gather + SDPA) with prepacked and with sgemm linears, and transformers (its cache,
    torch.cat + SDPA), median of alternating rounds."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.cfg.vocab_size, (context,), generator=g).tolist()
               for _ in range(batch)]
    engines = {}
    for name, prepack in (("fivefold_ms", True), ("fivefold_sgemm_ms", False)):
        engine = Engine(model, max_num_seqs=batch, num_blocks=batch * (context // 16 + 4) + 8,
                        max_num_batched_tokens=max(batch * context, 2048),
                        max_model_len=context + 16, prepack=prepack)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=rounds + 4, temperature=0,
                                                      ignore_eos=True))
        engine.step()  # every prompt, one step
        engines[name] = engine.step
    with torch.inference_mode():
        out = hf(torch.tensor(prompts), use_cache=True)
    state = {"cache": out.past_key_values, "next": out.logits[:, -1:].argmax(-1)}

    def theirs():
        with torch.inference_mode():
            o = hf(state["next"], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["next"] = o.past_key_values, o.logits[:, -1:].argmax(-1)

    steps = {**engines, "transformers_ms": theirs}
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {"batch": batch, "context": context,
            **{name: statistics.median(ms) for name, ms in times.items()}}


def decode_step_host(name: str, batch: int, steps: int, one_call: bool = False) -> dict:
    """Per decode step of `batch` greedy sequences: wall and CPU ms (median of `steps`),
    the aten ops of one step, and every request's tokens. `one_call`: every decoding
    sequence in one padded SDPA call a layer, as on CUDA (serve/kv_cache.py)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = preset(name).replace(max_seq_len=max(preset(name).max_seq_len, 512))
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size, (128 + 7 * i,), generator=g).tolist()
               for i in range(batch)]
    engine = Engine(model, max_num_seqs=batch, max_model_len=512, max_num_batched_tokens=8192,
                    num_blocks=batch * 512 // 16 + 8)
    if one_call:
        engine.cache.decode_group_bytes = None
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}

    def step():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})

    for _ in range(3):  # the prefill, then two decode steps to warm up
        step()
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        step()
        wall.append((time.perf_counter() - w) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    while engine.has_unfinished():
        step()
    return {"model": name, "layers": cfg.num_layers, "sequences": batch, "steps": steps,
            "step_wall_ms": statistics.median(wall), "step_cpu_ms": statistics.median(cpu),
            "aten_ops_per_step": sum(ops.values()),
            "sdpa_calls_per_step": ops.get("aten::scaled_dot_product_attention", 0),
            "index_select_calls_per_step": ops.get("aten::index_select", 0),
            "tokens": [final[i] for i in ids]}


def step_only(args, argv) -> int:
    if args.child:
        print(json.dumps(decode_step_host(args.preset, args.batch, args.steps,
                                          args.one_call)))
        return 0
    runs = {"after": []}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"after": str(ROOT / "src")}
        if args.baseline:
            archive = subprocess.run(["git", "archive", args.baseline, "src"], cwd=ROOT,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            sources, runs = {"before": str(Path(tmp) / "src"), **sources}, {"before": [],
                                                                            **runs}
        for _ in range(args.rounds):  # alternating: load drifts hit both alike
            for label, src in sources.items():
                cmd = [sys.executable, __file__, "--step-only", "--child", "--preset",
                       args.preset, "--batch", str(args.batch), "--steps", str(args.steps),
                       "--threads", str(args.threads)] + ["--one-call"] * args.one_call
                out = subprocess.run(cmd, env={**os.environ, "FIVEFOLD_BENCH_SRC": src},
                                     capture_output=True, text=True, check=True).stdout
                runs[label].append(json.loads(out.splitlines()[-1]))
    result = {"benchmark": "serve_step", "threads": args.threads, "rounds": args.rounds,
              "baseline": args.baseline or None, "one_call": args.one_call}
    for label, rounds in runs.items():
        last = dict(rounds[-1])
        last.pop("tokens")
        last["step_wall_ms"] = statistics.median(r["step_wall_ms"] for r in rounds)
        last["step_cpu_ms"] = statistics.median(r["step_cpu_ms"] for r in rounds)
        last["step_cpu_ms_rounds"] = [r["step_cpu_ms"] for r in rounds]
        result[label] = last
        print(f"{label:>6}: {last['model']} ({last['layers']} layers), {last['sequences']} "
              f"sequences: {last['step_cpu_ms']:.1f} CPU-ms ({last['step_wall_ms']:.1f} ms "
              f"wall) a decode step, {last['aten_ops_per_step']} aten ops, "
              f"{last['sdpa_calls_per_step']} SDPA calls, "
              f"{last['index_select_calls_per_step']} index_select calls")
    if args.baseline:
        before, after = result["before"], result["after"]
        same = sum(a == b for a, b in zip(runs["before"][0]["tokens"],
                                           runs["after"][0]["tokens"]))
        result["cpu_ms_ratio_before_over_after"] = before["step_cpu_ms"] / after["step_cpu_ms"]
        result["aten_ops_ratio_before_over_after"] = (before["aten_ops_per_step"]
                                                      / after["aten_ops_per_step"])
        result["identical_greedy_outputs"] = f"{same}/{args.batch}"
        print(f"before / after: {result['cpu_ms_ratio_before_over_after']:.2f}x CPU time a "
              f"step, {result['aten_ops_ratio_before_over_after']:.2f}x aten ops; identical "
              f"greedy outputs {same}/{args.batch}")
    info = machine(torch.device("cpu"))
    info["cpu_model"] = cpu_model()
    result.update(machine=info, git=git_revision(),
                  command="python bench/serve/serve.py " + " ".join(argv or sys.argv[1:]))
    out = Path(args.out or ROOT / "bench" / "results" / "serve_step.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-25m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="default: bench/results/serve.json "
                    "(serve_step.json with --step-only)")
    ap.add_argument("--step-only", action="store_true",
                    help="time the host work of one decode step (see above)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--one-call", action="store_true",
                    help="--step-only: all decodes in one padded SDPA call, as on CUDA")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default="", help="a git revision to measure too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.step_only:
        return step_only(args, argv)
    args.out = args.out or str(ROOT / "bench" / "results" / "serve.json")
    import transformers

    base = preset(args.preset)
    cfg = base.replace(max_seq_len=max(base.max_seq_len, 512))
    model = build_model(cfg, seed=args.seed).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, cfg, Path(tmp))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: every request runs its length
    prompts, outputs = workload(args.requests, cfg.vocab_size, args.seed)
    static_slots = args.batch * (256 + 256)  # what one padded static batch reserves
    ours, our_tokens = run_fivefold(model, prompts, outputs, "fivefold", args.batch,
                                    args.batch * 32 + 64)
    memory, memory_tokens = run_fivefold(model, prompts, outputs, "fivefold-same-kv",
                                         args.requests, static_slots // 16)
    plain, plain_tokens = run_fivefold(model, prompts, outputs, "fivefold-sgemm", args.batch,
                                       args.batch * 32 + 64, prepack=False)
    packed, packed_tokens = run_fivefold(model, prompts, outputs, "fivefold-prepacked",
                                         args.batch, args.batch * 32 + 64, prepack=True)
    theirs, their_tokens = run_transformers(hf, prompts, outputs, args.batch, pad_id=0)
    same = sum(a == b for a, b in zip(our_tokens, their_tokens))
    same_plain = sum(a == b for a, b in zip(plain_tokens, their_tokens))
    ratio_plain = plain["tokens_per_s"] / theirs["tokens_per_s"]
    cpu_ratio_plain = plain["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]
    same_runs = sum(a == b for a, b in zip(our_tokens, memory_tokens))
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    ratio_memory = memory["tokens_per_s"] / theirs["tokens_per_s"]
    cpu_ratio = ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]
    cpu_ratio_memory = memory["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]
    step = decode_step_ms(model, hf, args.batch, 300)
    info = machine(torch.device("cpu"))
    info["cpu_model"] = cpu_model()
    same_packed = sum(a == b for a, b in zip(packed_tokens, their_tokens))
    cpu_ratio_packed = packed["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]
    print(f"{info['cpu_model']} ({info['device']}); torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {args.threads} thread(s); {cfg.name} fp32")
    print(f"{args.requests} requests, prompts 16-256, outputs 16-256 tokens, batch "
          f"{args.batch}")
    if "linear_probe" in ours:
        probe = ours["linear_probe"]
        chosen = "oneDNN prepacked" if probe["prepack"] else "sgemm"
        print(f"start-up probe chose {chosen} linears: oneDNN {probe['packed_ms']:.2f} ms, "
              f"sgemm {probe['sgemm_ms']:.2f} ms per pass of 16 rows (CPU time)")
    for r in (ours, memory, plain, packed, theirs):
        print(f"{r['name']:>16}: {r['tokens_per_s']:8.1f} tokens/s  {r['requests_per_s']:6.3f} "
              f"req/s  {r['seconds']:7.1f} s  TTFT p50 {r['ttft_s']['p50']:.2f} s p99 "
              f"{r['ttft_s']['p99']:.2f} s  ITL p50 {r['itl_s']['p50'] * 1e3:.1f} ms p99 "
              f"{r['itl_s']['p99'] * 1e3:.1f} ms  {r['tokens_per_cpu_s']:8.1f} tokens/CPU-s")
    print(f"fivefold / transformers tokens/s: {ratio:.2f}x at the same batch ({args.batch}), "
          f"{ratio_memory:.2f}x in the same KV memory ({static_slots} token slots); "
          f"identical greedy outputs: {same}/{args.requests} (fivefold's two runs: "
          f"{same_runs}/{args.requests})")
    print(f"per CPU-second: {cpu_ratio:.2f}x at the same batch, {cpu_ratio_memory:.2f}x in the "
          f"same KV memory")
    print(f"with torch's sgemm linears, as transformers runs them (--no-prepack): "
          f"{ratio_plain:.2f}x at the same batch ({cpu_ratio_plain:.2f}x per CPU-second); "
          f"identical greedy outputs: {same_plain}/{args.requests}")
    print(f"with prepacked linears forced: {cpu_ratio_packed:.2f}x per CPU-second; identical "
          f"greedy outputs: {same_packed}/{args.requests}")
    print(f"one decode step alone, batch {step['batch']}, {step['context']} tokens of context: "
          f"fivefold {step['fivefold_ms']:.1f} ms (sgemm linears {step['fivefold_sgemm_ms']:.1f} "
          f"ms), transformers {step['transformers_ms']:.1f} ms")
    result = {"benchmark": "serve", "model": cfg.name, "dtype": "fp32",
              "requests": args.requests, "batch": args.batch, "threads": args.threads,
              "workload": {"prompt_tokens": [16, 256], "output_tokens": [16, 256],
                           "seed": args.seed, "arrivals": "all at t=0"},
              "fivefold": ours, "fivefold_same_kv_memory": memory,
              "fivefold_sgemm_linears": plain, "transformers": theirs,
              "tokens_per_s_ratio_sgemm_linears": ratio_plain,
              "tokens_per_cpu_s_ratio_sgemm_linears": cpu_ratio_plain,
              "identical_outputs_sgemm_linears": same_plain,
              "fivefold_prepacked_linears": packed,
              "tokens_per_cpu_s_ratio_prepacked_linears": cpu_ratio_packed,
              "identical_outputs_prepacked_linears": same_packed,
              "tokens_per_s_ratio": ratio, "tokens_per_s_ratio_same_kv_memory": ratio_memory,
              "tokens_per_cpu_s_ratio": cpu_ratio,
              "tokens_per_cpu_s_ratio_same_kv_memory": cpu_ratio_memory,
              "identical_outputs": same, "identical_outputs_between_fivefold_runs": same_runs,
              "decode_step_alone": step,
              "machine": info, "git": git_revision(),
              "command": "python bench/serve/serve.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
