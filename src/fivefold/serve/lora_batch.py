"""Many LoRA adapters on one base, in one batch: each sequence gets its own adapter.

Merging an adapter into the weights (finetune/inject.py, merge_and_unload) serves one adapter
per model copy. Punica (Chen et al. 2023, arXiv 2310.18547) and S-LoRA (Sheng et al. 2023,
arXiv 2311.03285) keep the base weights once and add each token's own low-rank update:

    y = x Wᵀ + scaling_a · (x A_aᵀ) B_aᵀ        for the tokens of sequences with adapter a

The base GEMM runs once for the whole step; the update runs per adapter over the rows of
that adapter's tokens. Each step's sequences are put in adapter order first (a stable sort;
attention is per sequence and the linears per row, so the order changes no result), so an
adapter's tokens are one run of rows: a slice, with no gather (Punica's SGMV with one
segment per adapter), and each adapter's A and B are read once per step and linear. The
rows of each adapter are found once per step (`AdapterSet.begin_step`) for every layer.

Requests name their adapter in `SamplingParams.adapter` (the OpenAI `model` field picks it);
None is the base alone. The step's row groups are per thread, so data-parallel replicas
stepping one shared model from their own threads (serve/dp_router.py) do not mix.

Adapters load from PEFT directories (adapter_config.json + adapter_model.safetensors) or from
fivefold LoRA checkpoints (finetune/attach.py); they must fit the served model's linears.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fivefold.errors import ConfigError
from fivefold.finetune.lora import lora_scaling


@dataclass
class Adapter:
    name: str
    rank: int
    scaling: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A r×in, B out×r)


def load_adapter(name: str, directory: str) -> Adapter:
    """A PEFT adapter directory or a fivefold LoRA checkpoint, as (A, B) per module."""
    path = Path(directory)
    if (path / "adapter_config.json").is_file():
        from fivefold.finetune.io import read_peft_config, read_peft_tensors

        cfg = read_peft_config(path)
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        scaling = lora_scaling(rank, alpha, bool(cfg.get("use_rslora")))
        tensors = read_peft_tensors(path)
    else:
        from fivefold.finetune.attach import adapters_of, load_for_inference

        if not path.is_dir():
            raise ConfigError(f"--lora {name}={directory}: no such directory; give a PEFT "
                              f"adapter directory or a fivefold LoRA checkpoint")
        model, _, _, lora = load_for_inference(str(path))
        if lora is None:
            raise ConfigError(f"--lora {name}={directory} is neither a PEFT adapter directory "
                              f"(no adapter_config.json) nor a LoRA checkpoint (lora.rank = 0)")
        rank = int(lora["rank"])
        scaling = lora_scaling(rank, float(lora["alpha"]), bool(lora.get("rslora")))
        tensors = adapters_of(model)
    factors: dict[str, list] = {}
    for key, t in tensors.items():
        module, _, leaf = key.removesuffix(".weight").rpartition(".")
        factors.setdefault(module, [None, None])["AB".index(leaf[-1])] = t.detach().float()
    return Adapter(name, rank, scaling, {m: (a, b) for m, (a, b) in factors.items()})


class StepRows(threading.local):
    """This thread's step: (adapter index, the slice of rows of its tokens in the
    flattened batch)."""

    groups: list[tuple[int, slice]] = []

    def __deepcopy__(self, memo):  # a prepacked copy of the model shares the step's rows
        return self


class MultiLoraLinear(nn.Module):
    """A base linear plus any number of adapters, each applied to its own tokens' rows."""

    def __init__(self, base_layer: nn.Module, rows: StepRows, num_adapters: int):
        super().__init__()
        self.base_layer, self.rows = base_layer, rows
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        # the adapters that touch this linear, by index; absent ones leave it alone. Their
        # factors are buffers (so `.to()` moves them) laid out for the two GEMMs: Aᵀ (in×r)
        # as `lora_A_<index>`, scaling·Bᵀ (r×out) as `lora_B_<index>`
        self.indices: set[int] = set()
        self.num_adapters = num_adapters

    def add(self, index: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        weight = self.base_layer.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        self.register_buffer(f"lora_A_{index}", a.t().contiguous().to(weight.device, dtype))
        self.register_buffer(f"lora_B_{index}",
                             (b.float() * scaling).t().contiguous().to(weight.device, dtype))
        self.indices.add(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        groups = self.rows.groups
        if not groups:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for index, rows in groups:
            if index not in self.indices:
                continue
            a, b = getattr(self, f"lora_A_{index}"), getattr(self, f"lora_B_{index}")
            xs = x2[rows]
            if xs.dtype != a.dtype:
                xs = xs.to(a.dtype)
            # one segment (SGMV): shrink to r, then expand and add in place
            if y.dtype == a.dtype:
                y2[rows].addmm_(xs @ a, b)
            else:
                y2[rows] += ((xs @ a) @ b).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.indices)} of {self.num_adapters}"


class AdapterSet:
    """The adapters a model serves, by name, and the per-step rows of their tokens."""

    def __init__(self, names: list[str], rows: StepRows):
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.rows = rows

    def key(self, item) -> int:
        adapter = item[0].params.adapter
        return -1 if adapter is None else self.index[adapter]

    def begin_step(self, out, device):
        """The step with its sequences ordered by adapter (a stable sort: Punica and S-LoRA
        batch so), so each adapter's tokens are one run of rows (a slice, no gather); then
        the rows of each adapter, for every layer of this step. Returns the reordered step
        (its copies done already: none are left in it)."""
        from fivefold.serve.scheduler import SchedulerOutput

        scheduled = sorted(out.scheduled, key=self.key)
        self.group_rows(scheduled, self.key)
        return SchedulerOutput(scheduled, out.preempted, [])

    def group_rows(self, scheduled, key) -> None:
        """The rows of each adapter's tokens in a batch of `scheduled` (in adapter order:
        each adapter's sequences one run), `key(item)` its adapter index (-1: none)."""
        spans: dict[int, list[int]] = {}  # adapter index -> [first row, end row]
        begin = 0
        for item in scheduled:
            end = begin + item[1]
            index = key(item)
            if index >= 0:
                spans.setdefault(index, [begin, end])[1] = end
            begin = end
        self.rows.groups = [(index, slice(lo, hi)) for index, (lo, hi) in spans.items()]

    def end_step(self) -> None:
        self.rows.groups = []


def _target(model: nn.Module, adapter: Adapter, module_name: str) -> nn.Module:
    """The linear an adapter's module names, its factors checked against it."""
    try:
        base = model.get_submodule(module_name)
    except AttributeError:
        base = None
    if base is None or not hasattr(base, "in_features"):
        raise ConfigError(f"--lora {adapter.name}: the adapter targets '{module_name}', which "
                          f"this model has no linear for; it was made for another model")
    a, b = adapter.factors[module_name]
    if a.shape != (adapter.rank, base.in_features) or \
            b.shape != (base.out_features, adapter.rank):
        raise ConfigError(f"--lora {adapter.name}: '{module_name}' has factors "
                          f"{tuple(a.shape)} and {tuple(b.shape)}, this model needs "
                          f"({adapter.rank}, {base.in_features}) and "
                          f"({base.out_features}, {adapter.rank}); it was made for "
                          f"another model")
    return base


def check_adapters(model: nn.Module, adapters: list[Adapter]) -> None:
    """Every adapter fits the model (a ConfigError naming the first that does not), without
    changing the model."""
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ConfigError(f"--lora names must differ; got {', '.join(names)}")
    for adapter in adapters:
        for module_name in adapter.factors:
            _target(model, adapter, module_name)


def stage_adapter(adapter: Adapter, first: int, end: int, last: bool) -> Adapter:
    """What a pipeline stage of layers [first, end) holds of an adapter (serve/pp_worker.py):
    the factors of its layers' linears (`layers.<i>.`), and on the last stage the others
    (the head's)."""
    kept = {}
    for name, factors in adapter.factors.items():
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            if first <= int(parts[1]) < end:
                kept[name] = factors
        elif last:
            kept[name] = factors
    return Adapter(adapter.name, adapter.rank, adapter.scaling, kept)


def apply_adapters(model: nn.Module, adapters: list[Adapter]) -> AdapterSet:
    """Wrap every linear some adapter targets in a MultiLoraLinear (in place)."""
    check_adapters(model, adapters)
    rows = StepRows()
    wrapped: dict[str, MultiLoraLinear] = {}
    for index, adapter in enumerate(adapters):
        for module_name, (a, b) in adapter.factors.items():
            layer = wrapped.get(module_name)
            if layer is None:
                base = _target(model, adapter, module_name)
                layer = wrapped[module_name] = MultiLoraLinear(base, rows, len(adapters))
                parent, _, child = module_name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, layer)
            layer.add(index, a, b, adapter.scaling)
    return AdapterSet([a.name for a in adapters], rows)


def attach(engine, adapters: AdapterSet) -> None:
    """Let `engine` admit requests for these adapters and group its steps' rows by them."""
    engine.adapters = adapters
    engine.runner.adapters = adapters
