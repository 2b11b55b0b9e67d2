"""Step metrics: model FLOPs and MFU, memory, the JSONL file, TensorBoard and the progress line."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from fivefold.models.presets import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token: 6·N + 12·L·(heads·head_dim)·s.

    6·N counts the forward (2 FLOPs per multiply-add) and backward (twice the forward) matmuls
    over N parameters (Kaplan et al. 2020, §2.1); the second term is self-attention's QK^T and
    AV matmuls over a window of s tokens (PaLM, Chowdhery et al. 2022, appendix B), without the
    causal halving, as PaLM and Megatron count it. N counts the weights that take part in a
    matmul: every layer's projections and MLP, and the output head (the tied embedding when
    tied) — not the input embedding (a lookup), norm weights or biases. Recomputation does not
    change model FLOPs (it is hardware FLOPs).

    The planner's `model_flops_per_token` is this count, so the MFU a run logs and the MFU
    `fivefold plan` predicts for it are the same quantity.
    """
    from fivefold.plan.flops import model_flops_per_token

    return model_flops_per_token(cfg, seq_len)


def device_peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """Dense bf16 peak of the device in FLOP/s, from the planner's hardware catalog."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    from fivefold.plan.hardware import peak_for_device_name

    return peak_for_device_name(torch.cuda.get_device_name(device))


def memory_bytes(device: torch.device) -> int:
    """CUDA peak allocated bytes, or the process's resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_reserved_bytes(device: torch.device) -> int | None:
    """CUDA peak reserved bytes (what the caching allocator took from the device); None on
    a CPU, which has no caching allocator to ask."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def sdpa_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> str:
    """Which kernel `scaled_dot_product_attention` runs for the model's causal attention
    here: the first of flash, memory-efficient and math (the dispatcher's order of
    preference) that accepts this device, dtype and head shape, found by running a small
    causal call restricted to each in turn. "math" on CUDA means no fused kernel applies
    (an fp32 model, or a head dimension the kernels do not take)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fivefold.models.llama import SDPA_GQA

    gqa = {"enable_gqa": True} if num_heads != num_kv_heads and SDPA_GQA else {}
    kv_heads = num_kv_heads if gqa else num_heads
    q = torch.zeros(1, num_heads, 16, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(1, kv_heads, 16, head_dim, device=device, dtype=dtype)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # each refusal also warns why
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, **gqa)
            return name
        except RuntimeError:
            continue
    return "none"


class MetricsWriter:
    """Writes one JSON line per step (and per validation), and TensorBoard scalars."""

    def __init__(self, log_dir: str, tensorboard: bool, enabled: bool = True,
                 resume_step: int | None = None):
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            # Steps logged after the checkpoint we resume from are about to run again: keep
            # the history up to it, so the file holds each step once.
            kept = self._history_up_to(resume_step)
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a" if resume_step is not None else "w")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: say so once, go on without it
                print("note: log.tensorboard = true but the tensorboard package is missing; "
                      "pip install tensorboard (or set log.tensorboard = false)",
                      file=sys.stderr, flush=True)
            else:
                self.tb = SummaryWriter(str(Path(log_dir) / "tensorboard"))

    def _history_up_to(self, step: int) -> list[str]:
        """The file's records up to `step`. A line cut short by a crash mid-write (or any line
        that is not a JSON record) is dropped with a note instead of blocking the resume."""
        kept, dropped = [], 0
        for line in self.path.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                record_step = int(record.get("step", 0))
            except (ValueError, TypeError, AttributeError):
                dropped += 1
                continue
            if record_step <= step:
                kept.append(line)
        if dropped:
            print(f"note: dropped {dropped} unreadable line(s) of {self.path} (a write cut "
                  f"short by a crash); the other records are kept", file=sys.stderr, flush=True)
        return kept

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value == value:
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


class Throughput:
    """Tokens per second and MFU over the last step."""

    def __init__(self, flops_per_token: float, peak_flops: float | None, num_gpus: int):
        self.flops_per_token = flops_per_token
        self.peak = peak_flops
        self.num_devices = num_gpus
        self.start = time.perf_counter()

    def begin(self) -> None:
        """A step starts: what ran since the last lap (evaluation, a save) is not counted."""
        self.start = time.perf_counter()

    def lap(self, tokens: int) -> tuple[float, float | None, float]:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        tps = tokens / elapsed
        mfu = tps * self.flops_per_token / (self.peak * self.num_devices) if self.peak else None
        return tps, mfu, elapsed
