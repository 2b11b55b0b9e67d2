"""The planner: memory, FLOPs, communication, step time and MFU of a layout, and a search for
the fastest layouts that fit. No torch anywhere in this package: a plan is instant.

Entry points for programs (the engine's agreement tests call the first three):
- `model_state_bytes(model, tp=, pp=, dp=, cp=, ep=, zero=, ...)` → ModelStates per rank
- `activation_bytes_per_microbatch(model, mbs, seq_len, tp=, sp=, cp=, recompute=,
  dtype_bytes=, flash=)` → ActivationBytes (per layer, by term, and outside the layers)
- `ledger_volume(workload, layout, pp_rank)` → {group: {op: bytes}} per step
- `plan_layout(workload, layout, hw, assume)` → LayoutPlan; `search(...)` → SearchResult
"""

from fivefold.plan.activations import ActivationBytes, activation_bytes_per_microbatch
from fivefold.plan.comm import collectives, ledger_volume, wire_volume
from fivefold.plan.evaluate import LayoutPlan, plan_layout
from fivefold.plan.flops import (
    hardware_flops_per_token,
    model_flops_per_token,
    training_days,
    training_flops,
)
from fivefold.plan.hardware import CATALOG, Assumptions, Hardware, get_hardware
from fivefold.plan.layout import Layout, Workload, check_layout
from fivefold.plan.memory import peak_memory
from fivefold.plan.model_states import (
    BytesPerParam,
    ModelStates,
    bytes_per_param,
    model_state_bytes,
    shard_model_states,
)
from fivefold.plan.placement import bubble_ratio
from fivefold.plan.search import SearchResult, SearchSpace, search

__all__ = [
    "CATALOG", "ActivationBytes", "Assumptions", "BytesPerParam", "Hardware", "Layout",
    "LayoutPlan", "ModelStates", "SearchResult", "SearchSpace", "Workload",
    "activation_bytes_per_microbatch", "bubble_ratio", "bytes_per_param", "check_layout",
    "collectives", "get_hardware", "hardware_flops_per_token", "ledger_volume",
    "model_flops_per_token", "model_state_bytes", "peak_memory", "plan_layout", "search",
    "shard_model_states", "training_days", "training_flops", "wire_volume",
]
