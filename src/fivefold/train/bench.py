"""`fivefold bench`: how fast one layout trains, measured, beside the planner's prediction.

    fivefold bench [--config FILE] [--steps 10] [--warmup 2] [--rounds 1] [--peer hf]
                   [--out FILE] [--section.key VALUE ...]

It runs the configured job (any preset, HF config or layout; several processes under
torchrun) for `warmup` untimed steps and then `rounds` × `steps` timed ones, and writes one
JSON record: tokens/s (total and per device), MFU (model FLOPs 6N + 12·L·d·s per token over
the device's dense bf16 peak, see train/metrics.py; none on a CPU, which has no catalogued
peak), the step split into forward, backward, optimizer and the exposed wait for gradient
reduction, the peak memory (CUDA: max allocated / reserved; CPU: allocations counted by
torch's MemTracker over one extra step, and the peak resident set), the planner's prediction
beside each, the device, torch/CUDA versions and the git revision.

`--peer hf` also trains the same model with Hugging Face `transformers` (peer.py): one
device, same weights, batches, precision and AdamW, and the ratio of the two measured in
the same run — the engines take turns, `steps` steps each per round (the peer first every
other round), so load on a shared machine falls on both. Beside the ratio of the median
tokens/s: the median of each round's ratio, and the ratio per second of CPU time, which on
a shared CPU leaves out the time a step waited for a core.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fivefold.config import ArgumentParser, ConfigError, check_options
from fivefold.host import cpu_label, cpu_model
from fivefold.train.step_record import StepRecord, sync

# What a benchmark run does not need: no checkpoints (written, or resumed from a run that
# happens to live in checkpoint.dir), validation or log files.
BENCH_DEFAULTS = ["--train.eval_every", "0", "--checkpoint.every", "0", "--checkpoint.resume",
                  "never", "--log.progress", "false", "--log.tensorboard", "false"]


class FivefoldRunner:
    """Runs `Trainer.train_step` as `fivefold train` does, timing its parts from the outside:
    forward (hooks on each model chunk), optimizer step and the wait for gradient reduction
    (wrapped methods); backward is the rest of the step."""

    name = "fivefold"

    def __init__(self, cfg, dims):
        from fivefold.train.trainer import Trainer

        self.trainer = Trainer(cfg, dims, quiet=True)
        self.device = self.trainer.device
        self.parts: dict[str, float] = {}
        self._started: list[float] = []
        for chunk in self.trainer.model.chunks:
            chunk.register_forward_pre_hook(self._forward_start)
            chunk.register_forward_hook(self._forward_end)
        opt = self.trainer.optimizer
        opt.step = self._timed(opt.step, "optimizer")
        opt.finish_grad_sync = self._timed(opt.finish_grad_sync, "grad_sync_wait")

    def _forward_start(self, module, args) -> None:
        if torch.is_grad_enabled():
            sync(self.device)
            self._started.append(time.perf_counter())

    def _forward_end(self, module, args, out) -> None:
        if torch.is_grad_enabled() and self._started:
            sync(self.device)
            self._add("forward", time.perf_counter() - self._started.pop())

    def _add(self, key: str, seconds: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + seconds

    def _timed(self, fn, key: str):
        def timed(*args, **kwargs):
            sync(self.device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self._add(key, time.perf_counter() - start)
            return out
        return timed

    def tracked(self) -> tuple[list, list]:
        """The modules and torch optimizers whose tensors exist before a step."""
        opt = getattr(self.trainer.optimizer, "optimizer", None)
        return self.trainer.model.chunks, [opt] if opt is not None else []

    def step(self) -> StepRecord:
        self.parts = {}
        sync(self.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        record = self.trainer.train_step()
        sync(self.device)
        seconds = time.perf_counter() - start
        parts = {k: self.parts.get(k, 0.0) for k in ("forward", "optimizer", "grad_sync_wait")}
        parts["backward"] = max(seconds - sum(parts.values()), 0.0)
        return StepRecord(record["loss"], seconds, parts, time.process_time() - cpu_start)


def repo_relative(path: str | Path) -> str:
    """A path inside this repository as the repository names it, so that results written
    under bench/results/ hold no machine's paths; any other path as given."""
    root = Path(__file__).resolve().parents[3]  # src/fivefold/train/bench.py
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def git_revision() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=10)
        rev = out.stdout.strip()
        return (rev + ("-dirty" if dirty.stdout.strip() else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine(device: torch.device) -> dict:
    info = {"host_cpu": cpu_model(), "arch": platform.machine(),
            "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "load_average_1m": os.getloadavg()[0]}  # others' work on a shared machine
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        info["device"] = f"CPU: {cpu_label()}"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_peak_memory(runner, device: torch.device) -> dict:
    """Peak memory of one more step: CUDA's allocator counters, or on CPU every storage's
    allocation and release counted (train/allocations.py; the step runs slower under it),
    with the process's peak resident set beside it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        runner.step()
        return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    from fivefold.train.allocations import PeakAllocations, module_and_optimizer_tensors

    with PeakAllocations(module_and_optimizer_tensors(*runner.tracked())) as meter:
        runner.step()
    return {"peak_allocated_bytes": meter.peak, "peak_rss_bytes": peak_rss_bytes()}


def summarize(records: list[StepRecord], tokens_per_step: int, devices: int,
              flops_per_token: float, peak_flops: float | None) -> dict:
    times = [r.seconds for r in records]
    median = statistics.median(times)
    tps = tokens_per_step / median
    parts = {k: statistics.median(r.parts[k] for r in records) for k in records[0].parts}
    cpu = statistics.median(r.cpu_seconds for r in records)
    return {
        "tokens_per_s": tps, "tokens_per_s_per_device": tps / devices,
        "tokens_per_s_spread": [tokens_per_step / max(times), tokens_per_step / min(times)],
        "step_time_s": {"median": median, "min": min(times), "max": max(times)},
        "step_parts_s": parts,
        # Tokens per second of this process's CPU time: on a CPU shared with other work, what
        # the step costs without the time spent waiting for a core (one thread: --threads 1).
        "tokens_per_cpu_s": tokens_per_step / cpu if cpu > 0 else None,
        "cpu_step_time_s": cpu,
        "mfu": tps * flops_per_token / (peak_flops * devices) if peak_flops else None,
        "steps_timed": len(records),
    }


def round_ratios(ours: list[StepRecord], theirs: list[StepRecord], steps: int) -> list[float]:
    """fivefold / transformers tokens/s of each round (the median step of each side)."""
    out = []
    for start in range(0, len(ours), steps):
        mine = statistics.median(r.seconds for r in ours[start:start + steps])
        peer = statistics.median(r.seconds for r in theirs[start:start + steps])
        out.append(peer / mine)
    return out


def planned(trainer, device: torch.device) -> dict:
    """The planner's prediction for this very run: memory at the peak (itemised, without the
    CUDA context allowance) and, on a catalogued GPU, the step time and tokens/s."""
    import dataclasses

    from fivefold.plan.hardware import Assumptions, hardware_for_device_name
    from fivefold.plan.inputs import training_plan_inputs
    from fivefold.plan.timing import step_time
    from fivefold.train.loop import planned_peak_bytes

    items = planned_peak_bytes(trainer)
    out = {"peak_bytes": sum(items.values()), "memory_items": items}
    hw = hardware_for_device_name(torch.cuda.get_device_name(device)) if (
        device.type == "cuda") else None
    if hw is None:
        out["step_time_s"] = None
        out["note"] = "no time prediction: the planner's hardware catalog has GPUs only"
        return out
    work, layout = training_plan_inputs(trainer.cfg)
    work = dataclasses.replace(work, model=trainer.model_cfg, precision=trainer.precision)
    t = step_time(work, layout, hw, Assumptions())
    out["step_time_s"] = t.total
    out["tokens_per_s"] = work.tokens_per_step / t.total
    return out


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="fivefold bench",
        description="Measure training speed and memory of a config (default: the tiny "
                    "model), optionally beside Hugging Face transformers (--peer hf), and "
                    "write one JSON record. Config keys are overridden as --section.key "
                    "VALUE, as in `fivefold train`.")
    parser.add_argument("--config", help="a TOML file as for `fivefold train`")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with a peer, the engines take turns this many times")
    parser.add_argument("--peer", choices=("none", "hf"), default="none")
    parser.add_argument("--memory", choices=("on", "off"), default="on",
                        help="measure the peak memory over one extra step")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (default: torch's own choice); on a "
                             "shared machine 1 avoids OpenMP threads spinning on each other")
    parser.add_argument("--out", default="", help="the JSON file (default: bench/results/"
                                                  "bench-<model>-<precision>.json)")
    return parser


def _check(args) -> None:
    for key, low in (("steps", 1), ("warmup", 0), ("rounds", 1), ("threads", 0)):
        if getattr(args, key) < low:
            raise ConfigError(f"--{key} = {getattr(args, key)} must be >= {low}")


def _progress(runner, step: int, total: int, rec: StepRecord, tokens: int) -> None:
    print(f"{runner.name:>12} step {step:3d}/{total}  {rec.seconds:7.3f} s  "
          f"{tokens / rec.seconds:9.0f} tok/s  loss {rec.loss:.4f}", flush=True)


def run_bench(args, cfg, dims) -> dict:
    """Warm up and time fivefold (and the peer), measure memory; the JSON record."""
    from fivefold.train.loop import attention_backend

    runners = [FivefoldRunner(cfg, dims)]
    trainer = runners[0].trainer
    if args.peer == "hf":
        from fivefold.train.peer import HFRunner

        runners.append(HFRunner(cfg, trainer))
    log = dims.rank == 0
    tokens = cfg.train.gbs * cfg.train.seq_len
    losses = {r.name: [] for r in runners}
    timed = {r.name: [] for r in runners}
    for runner in runners:
        for i in range(args.warmup):
            rec = runner.step()
            losses[runner.name].append(rec.loss)
            if log:
                _progress(runner, i + 1, args.warmup, rec, tokens)
    total = args.steps * args.rounds
    for round_index in range(args.rounds):
        # Every other round the peer goes first, so neither engine always follows the other.
        for runner in (runners if round_index % 2 == 0 else runners[::-1]):
            for _ in range(args.steps):
                rec = runner.step()
                losses[runner.name].append(rec.loss)
                timed[runner.name].append(rec)
                if log:
                    _progress(runner, len(timed[runner.name]), total, rec, tokens)
    device = trainer.device
    flops = trainer.throughput.flops_per_token
    peak = trainer.throughput.peak
    engines = {}
    for runner in runners:
        result = summarize(timed[runner.name], tokens, dims.world_size, flops, peak)
        result["losses"] = losses[runner.name]
        if args.memory == "on":
            result["memory"] = measure_peak_memory(runner, device)
        engines[runner.name] = result
    record = {
        "kind": "fivefold bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "fivefold bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                                 else sys.argv[1:]),
        "git_revision": git_revision(),
        "machine": machine(device),
        "model": {"name": trainer.model_cfg.name, "parameters": trainer.model_cfg.num_params(),
                  **{k: getattr(trainer.model_cfg, k) for k in (
                      "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "tie_embeddings")}},
        "run": {"precision": trainer.precision, "seq_len": cfg.train.seq_len,
                "gbs": cfg.train.gbs, "mbs": cfg.parallel.mbs, "tokens_per_step": tokens,
                "compile": getattr(cfg.train, "compile", False),
                "layout": {k: getattr(cfg.parallel, k) for k in (
                    "dp", "tp", "pp", "cp", "zero", "sp", "offload")},
                "recompute": cfg.train.recompute, "warmup_steps": args.warmup,
                "attention_kernel": attention_backend(trainer),
                "steps": args.steps, "rounds": args.rounds},
        "flops_convention": "model FLOPs per token 6N + 12·L·(heads·head_dim)·s (PaLM "
                            "appendix B, no causal halving); MFU over the device's dense "
                            "bf16 peak (none known for a CPU)",
        "flops_per_token": flops,
        "engines": engines,
        "planned": planned(trainer, device),
    }
    if args.peer == "hf":
        ours, theirs = engines["fivefold"], engines["transformers"]
        record["ratio_tokens_per_s"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        if ours["tokens_per_cpu_s"] and theirs["tokens_per_cpu_s"]:
            record["ratio_tokens_per_cpu_s"] = (ours["tokens_per_cpu_s"]
                                                / theirs["tokens_per_cpu_s"])
        # Each round's ratio of the engines' median step times: the two run minutes apart
        # at most, so a load that changes over the run moves both sides of each ratio.
        record["ratio_by_round"] = round_ratios(timed["fivefold"], timed["transformers"],
                                                args.steps)
        n = len(ours["losses"])
        record["max_loss_rel_diff"] = max(
            abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"][:n]))
    return record


def report(record: dict) -> str:
    lines = []
    for name, e in record["engines"].items():
        mem = e.get("memory", {})
        mem_text = ", ".join(f"{k.replace('_bytes', '')} {v / 2**20:.1f} MiB"
                             for k, v in mem.items())
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in e["step_parts_s"].items())
        lo, hi = e["tokens_per_s_spread"]
        mfu = f", MFU {e['mfu']:.1%}" if e["mfu"] is not None else ""
        lines.append(f"{name:>12}: {e['tokens_per_s']:.0f} tok/s (steps from {lo:.0f} to "
                     f"{hi:.0f}){mfu}; step parts ms: {parts}; {mem_text}")
    plan = record["planned"]
    lines.append(f"{'planned':>12}: peak {plan['peak_bytes'] / 2**20:.1f} MiB"
                 + (f", {plan['tokens_per_s']:.0f} tok/s" if plan.get("step_time_s") else
                    f" ({plan['note']})"))
    if "ratio_tokens_per_s" in record:
        steps = len(record["engines"]["fivefold"]["losses"])
        lines.append(f"fivefold / transformers tokens/s: {record['ratio_tokens_per_s']:.2f}x; "
                     f"largest relative loss difference over {steps} steps: "
                     f"{record['max_loss_rel_diff']:.2e}")
        by_round = record["ratio_by_round"]
        cpu = record.get("ratio_tokens_per_cpu_s")
        lines.append(f"  per round: {', '.join(f'{r:.2f}' for r in by_round)} (median "
                     f"{statistics.median(by_round):.2f}x)"
                     + (f"; per CPU-second: {cpu:.2f}x" if cpu else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    check_options(overrides, parser)
    _check(args)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, overrides)
    finally:
        torch.set_num_threads(threads)


def _run(args, overrides: list[str]) -> int:
    from fivefold import config

    steps = args.warmup + args.steps * args.rounds + (1 if args.memory == "on" else 0)
    cfg = config.load(args.config, [*BENCH_DEFAULTS, "--train.steps", str(steps),
                                    *overrides])
    from fivefold.parallel.mesh import ParallelDims, init_distributed

    rank, world = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
    if world != cfg.parallel.world_size:
        raise ConfigError(f"{world} process(es) launched but parallel.dp·tp·pp·cp = "
                          f"{cfg.parallel.world_size}; launch with torchrun --nproc-per-node "
                          f"{cfg.parallel.world_size} or change the layout")
    if args.peer == "hf" and cfg.train.precision == "fp16":
        raise ConfigError("--peer hf compares fp32 or bf16 runs; set train.precision to fp32 "
                          "or bf16")
    if args.peer == "hf" and world > 1:
        raise ConfigError("--peer hf compares one device; run it without torchrun on a "
                          "layout of one process")
    dims = ParallelDims.from_config(cfg.parallel, rank)
    record = run_bench(args, cfg, dims)
    if dims.rank == 0:
        print(report(record), flush=True)
        out = Path(args.out or f"bench/results/bench-{record['model']['name']}-"
                               f"{record['run']['precision']}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}", flush=True)
    return 0
