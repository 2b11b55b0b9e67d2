"""A whole training run: days, GPU-hours and money for a token budget, and a model shape
from a bare parameter count.

Two clocks are given side by side, because the field quotes both:
- the plan's own: tokens / (predicted tokens per second);
- the rule of thumb C = 6·N·D (8·N·D with full recomputation: one more forward) at an
  achieved rate X per GPU, days = C / (n·X) (Kaplan et al. 2020; Narayanan et al. 2021 §5.1
  "training time ≈ 8TP/(nX)"). X defaults to the plan's achieved model FLOP/s per GPU;
  `--achieved-tflops` sets it, as the worked examples do (82B parameters, 150B tokens, 1024
  A100s: 2.67 days at 312 TFLOP/s with 6ND, 16.36 days at 68 TFLOP/s with 8ND).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.models.presets import ModelConfig
from fivefold.plan.flops import SECONDS_PER_DAY

HEAD_DIM = 128  # GPT-3 and Llama: 128-wide heads from 1B up
ASPECT = 128  # hidden size per layer: GPT-3 175B 12288/96, 13B 5120/40, Llama-2 7B 4096/32
BASE_VOCAB = 51200  # GPT-2's 50257 padded to a multiple of 1024 (Megatron-LM)


def model_from_params(num_params: float) -> ModelConfig:
    """A GPT-3-style shape (LayerNorm, 4h GeLU MLP, tied embeddings, heads of 128) with
    `num_params` parameters: h/L about 128 as in GPT-3 (Brown et al. 2020, Table 2.1), h a
    multiple of 1024 (8 heads) from 1024 up, and the vocabulary (from 51,200 up) absorbing
    the remainder, so the count is `num_params` to within h/2 (1e-6 relative at 7.5B)."""
    n = float(num_params)
    if n < 1e6:
        raise ValueError(f"--params {num_params:g} is too small to plan; give e.g. 7.5e9")
    # 12·L·h² ≈ N with L = h/128  →  h ≈ (128·N/12)^(1/3), in steps of 8 heads from 1024
    # up (so tp = 8 divides the heads)
    ideal = (ASPECT * n / 12) ** (1 / 3)
    step = 8 * HEAD_DIM if ideal >= 8 * HEAD_DIM else HEAD_DIM
    h = max(HEAD_DIM, round(ideal / step) * step)
    probe = ModelConfig(name="probe", vocab_size=0, hidden_size=h, intermediate_size=4 * h,
                        num_layers=1, num_heads=h // HEAD_DIM, num_kv_heads=h // HEAD_DIM,
                        tie_embeddings=True, qkv_bias=True, mlp="gelu", norm="layernorm")
    layer, final_norm = probe.layer_params(0), 2 * h
    layers = max(1, int((n - BASE_VOCAB * h - final_norm) // layer))
    vocab = max(BASE_VOCAB, round((n - layers * layer - final_norm) / h))
    return probe.replace(name=f"gpt-{n / 1e9:g}b", vocab_size=vocab, num_layers=layers,
                         max_seq_len=131072)


@dataclass(frozen=True)
class RunCost:
    tokens: float
    num_gpus: int
    num_params: float
    flops_rule: str  # "6ND" or "8ND"
    total_flops: float
    achieved_flops_per_gpu: float  # what the rule-of-thumb clock runs at
    days_rule: float
    days_planned: float  # from the plan's predicted tokens per second (0: no plan)
    price_per_gpu_hour: float

    @property
    def gpu_hours(self) -> float:
        days = self.days_planned or self.days_rule
        return days * 24 * self.num_gpus

    @property
    def gpu_hours_rule(self) -> float:
        return self.days_rule * 24 * self.num_gpus

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.price_per_gpu_hour

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "num_gpus": self.num_gpus, "num_params": self.num_params,
                "flops_rule": self.flops_rule, "total_flops": self.total_flops,
                "achieved_flops_per_gpu": self.achieved_flops_per_gpu,
                "days_rule": self.days_rule, "days_planned": self.days_planned,
                "gpu_hours": self.gpu_hours, "gpu_hours_rule": self.gpu_hours_rule,
                "price_per_gpu_hour": self.price_per_gpu_hour, "cost": self.cost}

    def describe(self) -> str:
        lines = [f"whole run: {self.tokens:.4g} tokens on {self.num_gpus:,} GPUs"]
        if self.days_planned:
            lines.append(f"  planned throughput: {self.days_planned:.2f} days, "
                         f"{self.gpu_hours:,.0f} GPU-hours")
        lines.append(f"  rule of thumb C = {self.flops_rule[0]}·N·D = {self.total_flops:.4g} "
                     f"FLOPs at {self.achieved_flops_per_gpu / 1e12:.4g} TFLOP/s per GPU: "
                     f"{self.days_rule:.2f} days, {self.gpu_hours_rule:,.0f} GPU-hours")
        if self.price_per_gpu_hour:
            lines.append(f"  cost at {self.price_per_gpu_hour:g} per GPU-hour: "
                         f"{self.cost:,.0f}")
        return "\n".join(lines)


def run_cost(tokens: float, num_gpus: int, num_params: float, *, flops_rule: str = "6ND",
             achieved_flops_per_gpu: float, tokens_per_second: float = 0.0,
             price_per_gpu_hour: float = 0.0) -> RunCost:
    """The run's cost by both clocks (see the module docstring)."""
    factor = {"6ND": 6.0, "8ND": 8.0}[flops_rule]
    total = factor * num_params * tokens
    days_rule = total / (num_gpus * achieved_flops_per_gpu) / SECONDS_PER_DAY
    days_planned = tokens / tokens_per_second / SECONDS_PER_DAY if tokens_per_second else 0.0
    return RunCost(tokens, num_gpus, num_params, flops_rule, total, achieved_flops_per_gpu,
                   days_rule, days_planned, price_per_gpu_hour)
