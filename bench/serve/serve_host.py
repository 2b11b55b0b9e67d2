"""Host time of a decode step, on the CPU, as a proxy for the GPU: fivefold's engine against
transformers' `generate` on a model so narrow that its arithmetic is small.

    python bench/serve/serve_host.py [--prompt 16 128] [--steps 32] [--rounds 3]

The model: Llama-shaped, hidden 64, 30 layers, 4 heads (2 KV heads), vocabulary 256, fp32,
one thread; 16 greedy sequences, each prompt `--prompt` tokens. For each prompt length:

- the engine: the fused forward as served (serve/fused.py, its decode steps in float32 by
  serve/fused_decode.py), the fused forward's general layer loop for decodes too (as
  before serve/fused_decode.py: "fused loop") and the model's own forward (`fuse=False`):
  CPU milliseconds of each decode step (`engine.step()`: scheduling, the
  inputs, the forward, sampling; median over `--steps` steps after the prefill);
- transformers: CPU milliseconds of `generate` for `--steps` + 1 new tokens minus that for
  1 new token, over `--steps` (the prefill and the set-up cancel): its time per decode step.

Rounds alternate the four, the medians of the rounds are printed with the ratios to
transformers (goal: <= 0.5x), and whether the greedy tokens of all four agree. Beside the
times, a count that does not depend on the machine's load: the aten ops one decode step
dispatches (a step of the engine after the prefill; transformers: `generate` of 2 new tokens
minus that of 1), all of them and the kernels among them (not views, metadata or
allocations, as fivefold/trace/counter.py counts them): on a GPU each kernel is a launch.
JSON: bench/results/serve_host.json with the machine, versions and git revision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import ModelConfig  # noqa: E402
from fivefold.serve.engine import Engine  # noqa: E402
from fivefold.serve.sampling_params import SamplingParams  # noqa: E402
from fivefold.trace.counter import NOT_KERNELS  # noqa: E402
from fivefold.train.bench import cpu_model, git_revision, machine  # noqa: E402

CFG = ModelConfig(name="narrow-64x30", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=30, num_heads=4, num_kv_heads=2, max_seq_len=1024,
                  tie_embeddings=True)
SEQUENCES = 16
ENGINES = ("fused", "fused_loop", "modules")


def make_engine(model, prompts, variant: str) -> Engine:
    """variant: "fused" (the default engine), "fused_loop" (the fused forward's general
    layer loop for decodes too, serve/fused.py, as before serve/fused_decode.py), "modules"."""
    engine = Engine(model, max_num_seqs=len(prompts), max_model_len=CFG.max_seq_len,
                    num_blocks=len(prompts) * (CFG.max_seq_len // 16) + 8,
                    fuse=variant != "modules")
    if variant == "fused_loop":
        engine.runner.fused.lean_decode = False
    return engine


def engine_step_ms(model, prompts, steps: int, variant: str) -> tuple[float, list[list[int]]]:
    """Median CPU ms of a decode step, and every sequence's first `steps` + 1 tokens."""
    engine = make_engine(model, prompts, variant)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    engine.step()  # the prefills (and every first token)
    cpu = []
    while engine.has_unfinished():
        start = time.process_time()
        outputs = engine.step()
        cpu.append((time.process_time() - start) * 1e3)
        final.update({o.request_id: o.token_ids for o in outputs if o.finished})
    return statistics.median(cpu), [final[i] for i in ids]


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched, and the kernels among them: not views (an output
    that aliases an input without writing it), metadata or allocations."""

    def __init__(self):
        super().__init__()
        self.ops = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        ret = func._schema.returns
        alias = ret[0].alias_info if ret else None
        if func._schema.name.split("::")[-1] not in NOT_KERNELS and \
                not (alias is not None and not alias.is_write):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def engine_step_ops(model, prompts, variant: str) -> tuple[int, int]:
    """Aten ops and kernels of the engine's second decode step."""
    engine = make_engine(model, prompts, variant)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    engine.step()
    engine.step()
    with OpCount() as count:
        engine.step()
    return count.ops, count.kernels


def transformers_step_ops(hf, prompts) -> tuple[int, int]:
    ids = torch.tensor(prompts)
    counts = []
    for n in (1, 2):
        with torch.inference_mode(), OpCount() as count:
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        counts.append((count.ops, count.kernels))
    return counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]


def transformers_step_ms(hf, prompts, steps: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)

    def generate(n):
        start = time.process_time()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return time.process_time() - start, out

    one = statistics.median(generate(1)[0] for _ in range(3))
    many, out = generate(steps + 1)
    return (many - one) / steps * 1e3, out[:, ids.shape[1]:].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_host.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    model = build_model(CFG, seed=0).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, CFG, Path(tmp))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    transformers_step_ms(hf, [[3] * 8] * 2, 2)  # warm-up
    cases = []
    for length in args.prompt:
        g = torch.Generator().manual_seed(length)
        prompts = [torch.randint(3, CFG.vocab_size, (length,), generator=g).tolist()
                   for _ in range(SEQUENCES)]
        times = {name: [] for name in ENGINES + ("transformers",)}
        tokens = {}
        for _ in range(args.rounds):  # alternating: load drifts hit all alike
            for name in ENGINES:
                ms, tokens[name] = engine_step_ms(model, prompts, args.steps, name)
                times[name].append(ms)
            ms, tokens["transformers"] = transformers_step_ms(hf, prompts, args.steps)
            times["transformers"].append(ms)
        ms = {name: statistics.median(t) for name, t in times.items()}
        ops = {name: engine_step_ops(model, prompts, name) for name in ENGINES}
        ops["transformers"] = transformers_step_ops(hf, prompts)
        case = {"prompt_tokens": length, "sequences": SEQUENCES, "decode_steps": args.steps,
                "step_cpu_ms": ms, "step_cpu_ms_rounds": times,
                "step_aten_ops": {k: v[0] for k, v in ops.items()},
                "step_kernels": {k: v[1] for k, v in ops.items()},
                "fused_over_transformers": ms["fused"] / ms["transformers"],
                "fused_loop_over_transformers": ms["fused_loop"] / ms["transformers"],
                "modules_over_transformers": ms["modules"] / ms["transformers"],
                "identical_greedy_fused_vs_transformers": sum(
                    a == b for a, b in zip(tokens["fused"], tokens["transformers"])),
                "identical_greedy_fused_vs_modules": sum(
                    a == b for a, b in zip(tokens["fused"], tokens["modules"])),
                "identical_greedy_fused_vs_fused_loop": sum(
                    a == b for a, b in zip(tokens["fused"], tokens["fused_loop"]))}
        cases.append(case)
        print(f"prompts of {length} tokens, {SEQUENCES} sequences, CPU ms a decode step: "
              f"fused {ms['fused']:.2f}, fused loop {ms['fused_loop']:.2f}, modules "
              f"{ms['modules']:.2f}, transformers {ms['transformers']:.2f}; fused / "
              f"transformers {case['fused_over_transformers']:.2f}x (fused loop "
              f"{case['fused_loop_over_transformers']:.2f}x, modules "
              f"{case['modules_over_transformers']:.2f}x); identical greedy tokens: fused vs "
              f"transformers {case['identical_greedy_fused_vs_transformers']}/{SEQUENCES}, "
              f"vs fused loop {case['identical_greedy_fused_vs_fused_loop']}/{SEQUENCES}, "
              f"vs modules {case['identical_greedy_fused_vs_modules']}/{SEQUENCES}")
        print("  aten ops (kernels) a decode step: " + ", ".join(
            f"{name} {n} ({k})" for name, (n, k) in ops.items()))
    info = machine(torch.device("cpu"))
    info["cpu_model"] = cpu_model()
    result = {"benchmark": "serve_host", "model": vars(CFG) if hasattr(CFG, "__dict__") else
              str(CFG), "threads": 1, "rounds": args.rounds, "cases": cases,
              "transformers": transformers.__version__, "machine": info,
              "git": git_revision(),
              "command": "python bench/serve/serve_host.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
