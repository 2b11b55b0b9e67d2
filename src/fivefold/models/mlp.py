"""The dense feed-forward block, used by every dense layer (models/llama.py) and as the
expert and shared-expert MLP of a mixture-of-experts layer (models/moe.py)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from fivefold.models.presets import ModelConfig


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020) as in Llama, or the GPT-style GeLU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=not self.swiglu)
        self.down_proj = nn.Linear(f, h, bias=not self.swiglu)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
