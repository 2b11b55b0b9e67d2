"""Linear layers with their weights laid out once for oneDNN, for serving fp32 on a CPU.

`F.linear` on a CPU calls the BLAS's sgemm, which repacks the weight matrix into its
cache-blocked panel layout on every call; oneDNN can take the weight reordered once into
the layout its kernels read (`torch.ops.mkldnn._reorder_linear_weight`, the op torch's own
inductor freezing pass uses for CPU linears) and run `_linear_pointwise` on it each step.
CPU inference engines prepack their GEMM weights in the same way (vLLM's CPU backend and
IPEX through oneDNN). On this project's 2-core AMD EPYC test machine, one thread, the fp32
GEMMs of llama-25m run 2.3-2.8x faster so (16 tokens x 512 -> 32000: 8.7 ms -> 3.1 ms;
512 -> 1376: 0.25 -> 0.10 ms; at 1024 tokens 2.3x too), with results within ~1e-5 of
sgemm's (another summation order, not another arithmetic): `bench/serve/serve.py` reports the
engine with and without it.

`prepack_linears(model)` returns a copy of the model for the engine to run: every plain
`nn.Linear` (and the output head, tied or not) is replaced by a `PackedLinear`, and every
other parameter and buffer is the caller's own tensor, shared, not copied. The caller's
model is left as it was. Quantised layers, expert layers and a head that is not a plain
linear keep their own forward (a LoRA layer's base and adapter linears are packed, its sum
is its own). The packed weights sit beside the original ones, which the copy still
references (`.weight`), so serving this way holds the linear weights twice.

The gain depends on the CPU and the shapes: on an Intel Xeon the same packing was 2-16%
faster per CPU-second on llama-25m but 7-17% slower on the 1M-parameter default model,
whose GEMMs are small enough for oneDNN's per-call overhead to dominate. So
`probe_linears(model)` times both paths on the model's own linear shapes (each distinct
(out, in) once, weighted by how many linears have it, at a decode step's 16 rows, the two
paths interleaved, in CPU time, within ~0.5 s) and the engine (`prepack="auto"`, `fivefold serve`'s
default) packs only when oneDNN was faster here.
"""

from __future__ import annotations

import copy
import time
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def can_prepack(model: nn.Module) -> bool:
    """fp32 weights on a CPU, with torch's oneDNN linear ops present (torch >= 2.1 built
    with oneDNN, which the x86 and arm64 wheels are) and giving F.linear's result."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # present, and right on this machine's kernels (a probe of 3 x 8 -> 4)
        g = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(shape, generator=g) for shape in ((4, 8), (4,), (3, 8)))
        got = PackedLinear(w, b, batch_hint=3)(x)
        return torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W reordered once for oneDNN. `batch_hint`: the rows a call usually
    has (oneDNN picks the layout for it; any row count works)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 16):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        # the original (shared) weight stays: code that reads `.weight` (its dtype, a LoRA
        # base's) works on the copy as on the model
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def prepack_linears(model: nn.Module, batch_hint: int = 16) -> tuple[nn.Module, int]:
    """(a copy of `model` whose plain linears are PackedLinear, how many were packed)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    served = copy.deepcopy(model, memo=shared)
    count = 0
    head = getattr(served, "lm_head", "absent")
    if (hasattr(served, "logits") and hasattr(served, "output_weight")
            and (head is None or type(head) is nn.Linear)):
        # the output head, also when tied to the embedding (Llama.logits is
        # F.linear(norm(h), output_weight())): this copy's logits use the packed weight
        bias = None if head is None else head.bias
        served.packed_head = PackedLinear(served.output_weight(), bias, batch_hint)
        served.logits = types.MethodType(_packed_logits, served)
        count += 1
    for module in list(served.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not head:
                setattr(module, name, PackedLinear(child.weight, child.bias, batch_hint))
                count += 1
    return served, count


def _packed_logits(self, h: torch.Tensor) -> torch.Tensor:
    return self.packed_head(self.norm(h))


@dataclass
class LinearProbe:
    prepack: bool  # oneDNN was faster on this machine for this model's shapes
    packed_ms: float  # the model's linears at `rows` rows, one pass, oneDNN prepacked
    sgemm_ms: float  # the same with F.linear
    rows: int

    def describe(self) -> str:
        chosen = "oneDNN prepacked" if self.prepack else "sgemm (F.linear)"
        return (f"linears: {chosen}; probe on this model's shapes at {self.rows} rows: "
                f"oneDNN {self.packed_ms:.2f} ms, sgemm {self.sgemm_ms:.2f} ms per pass")


def _linear_shapes(model: nn.Module) -> dict[tuple[int, int], tuple[torch.Tensor, int]]:
    """(out, in) -> (one weight of that shape, how many linears have it), head included."""
    shapes: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
    weights = [m.weight for m in model.modules() if type(m) is nn.Linear]
    head = getattr(model, "lm_head", None)
    if hasattr(model, "output_weight") and (head is None or type(head) is nn.Linear):
        if head is not None:
            weights = [w for w in weights if w is not head.weight]
        weights.append(model.output_weight())
    for w in weights:
        key = tuple(w.shape)
        shapes[key] = (shapes.get(key, (w, 0))[0], shapes.get(key, (w, 0))[1] + 1)
    return shapes


@torch.no_grad()
def probe_linears(model: nn.Module, rows: int = 16, budget_s: float = 0.5) -> LinearProbe:
    """Time oneDNN-prepacked against F.linear on the model's own linear shapes, in CPU time
    of the process (on a shared machine the wall clock of a call depends on who else runs;
    its CPU time hardly does). Each round runs every distinct shape once by each path
    (interleaved), after one warm-up call each; rounds repeat until `budget_s` is spent (at least 3,
    at most 50); the median round counts."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for (_, in_features), (weight, count) in _linear_shapes(model).items():
        w = weight.detach()
        x = torch.randn(rows, in_features, generator=g)
        packed = PackedLinear(w, None, rows)
        packed(x), F.linear(x, w)  # warm-up: oneDNN builds its kernel on the first call
        cases.append((packed, w, x, count))
    packed_times, sgemm_times = [], []
    start = time.perf_counter()
    while len(packed_times) < 3 or time.perf_counter() - start < budget_s:
        packed = sgemm = 0.0
        for layer, w, x, count in cases:
            t0 = time.process_time()
            layer(x)
            t1 = time.process_time()
            F.linear(x, w)
            t2 = time.process_time()
            packed += (t1 - t0) * count
            sgemm += (t2 - t1) * count
        packed_times.append(packed)
        sgemm_times.append(sgemm)
        if len(packed_times) >= 50:
            break
    packed_ms = sorted(packed_times)[len(packed_times) // 2] * 1e3
    sgemm_ms = sorted(sgemm_times)[len(sgemm_times) // 2] * 1e3
    return LinearProbe(packed_ms < sgemm_ms, packed_ms, sgemm_ms, rows)
