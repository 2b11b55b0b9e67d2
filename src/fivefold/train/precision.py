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


class LossScaler:
    """Dynamic loss scaling: halve on overflow (and skip the step), double after a clean run.

    With `enabled=False` (fp32, bf16) the scale stays 1 and no step is skipped.

    The state lives on the device once a step has told it of an overflow by a tensor
    (`update(found_inf)` with a 0-d float, 1.0 for an overflow): the scale, the clean-step
    run and the skipped count are then 0-d tensors updated there, so a step never waits for
    the device to know whether it overflowed. `scale`, `clean_steps` and `skipped_steps`
    read them as numbers (a wait for the device: for logs and checkpoints, not inside a
    step); `loss_factor` and `inverse` hand the step what it multiplies by, as a tensor
    once the state is on the device. Each update makes new tensors (a record of an earlier
    step keeps its value)."""

    def __init__(self, enabled: bool = False, scale: float = 2.0**16,
                 growth_interval: int = 1000, min_scale: float = 1.0):
        self.enabled, self.growth_interval, self.min_scale = enabled, growth_interval, min_scale
        self._scale = scale if enabled else 1.0  # a float, or a 0-d fp32 tensor
        self._clean = 0  # clean steps since the last overflow or growth check (int/tensor)
        self._skipped = 0

    @property
    def scale(self) -> float:
        return float(self._scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = float(value)

    @property
    def clean_steps(self) -> int:
        return int(self._clean)

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    def scale_value(self):
        """The scale as the step holds it (a float, or a 0-d tensor on the device)."""
        return self._scale

    def loss_factor(self, num_tokens: int):
        """What the summed loss is multiplied by before the backward: scale / num_tokens,
        divided in float64 (as Python divides a float) and rounded to fp32 once, as a
        multiplication by a Python float rounds its scalar."""
        if not isinstance(self._scale, torch.Tensor):
            return self._scale / num_tokens
        return (self._scale.double() / num_tokens).float()

    def inverse(self):
        """1 / scale (exact: the scale is a power of two)."""
        if not isinstance(self._scale, torch.Tensor):
            return 1.0 / self._scale
        return 1.0 / self._scale

    def update(self, found_inf) -> None:
        """After a step: `found_inf` a bool (decided on the host) or a 0-d float tensor
        (1.0: a rank overflowed), which keeps the state on its device."""
        if not self.enabled:
            return
        if not isinstance(found_inf, torch.Tensor):
            self._update_host(bool(found_inf))
            return
        dev = found_inf.device
        if not isinstance(self._scale, torch.Tensor):  # once: the state moves to the device
            self._scale = torch.tensor(float(self._scale), dtype=torch.float32, device=dev)
            self._clean = torch.tensor(int(self._clean), dtype=torch.int64, device=dev)
            self._skipped = torch.tensor(int(self._skipped), dtype=torch.int64, device=dev)
        found = found_inf > 0
        clean = torch.where(found, 0, self._clean + 1)
        grow = (clean % self.growth_interval == 0) & ~found
        halved = torch.clamp(self._scale / 2, min=self.min_scale)
        self._scale = torch.where(found, halved, torch.where(grow, self._scale * 2, self._scale))
        self._clean = clean
        self._skipped = self._skipped + found.to(torch.int64)

    def _update_host(self, found_inf: bool) -> None:
        scale, clean = float(self._scale), int(self._clean)
        if found_inf:
            self._scale, self._clean = max(scale / 2, self.min_scale), 0
            self._skipped = int(self._skipped) + 1
        else:
            clean += 1
            self._clean = clean
            self._scale = scale * 2 if clean % self.growth_interval == 0 else scale

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._clean = int(state["clean_steps"])
        self._skipped = int(state["skipped_steps"])
