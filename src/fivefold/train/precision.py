"""Precision policy and the dynamic loss scaler of fp16 training.

    fp32  parameters, gradients and Adam states in fp32: 4 + 4 + 8 = 16 bytes per parameter
    bf16  bf16 parameters and gradients, fp32 master weights and Adam states:
          2 + 2 + 4 + 8 = 16 bytes per parameter (the ZeRO paper's mixed-precision layout,
          Rajbhandari et al. 2020, §3.1)
    fp16  as bf16, with the loss scaled so that small gradients survive fp16's range
          (Micikevicius et al. 2018, "Mixed Precision Training")
    fp8   as bf16, with the GEMMs of the linear layers in FP8 (lowp/, numerics/fp8.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# fp8: parameters and activations in bf16, FP8 only inside the linears' GEMMs (lowp/)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' means bf16 on a GPU that supports it, fp32 on CPU."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


@dataclass
class LossScaler:
    """Dynamic loss scaling: halve on overflow (and skip the step), double after a clean run.

    With `enabled=False` (fp32, bf16) the scale stays 1 and no step is skipped.
    """

    enabled: bool = False
    scale: float = 2.0**16
    growth_interval: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0
    skipped_steps: int = 0

    def __post_init__(self):
        if not self.enabled:
            self.scale = 1.0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self.clean_steps = state["clean_steps"]
        self.skipped_steps = state["skipped_steps"]
