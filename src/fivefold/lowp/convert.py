"""convert_to_fp8(model, recipe, keep_out): put FP8 GEMMs into a model, in place.

What changes (and what does not):
  - every `nn.Linear` not kept out gets the FP8 forward by a class swap (a subclass with
    `FP8LinearMixin` first; torchao's `convert_to_float8_training` swaps whole modules):
    the object, its parameters, their names, the tags a parallel transformation put on
    them (and the mixins that keep those tags) and therefore checkpoints stay as they were.
    FP8 is a compute format; what is stored stays fp32/bf16.
  - a module that takes a pluggable GEMM (a `linear_fn` attribute: the tensor-parallel
    column and row linears) gets the FP8 one; it runs on the rank's local shard, so
    column- and row-parallel GEMMs quantise their own shards.
  - routed experts (`GroupedExperts`, also under expert parallelism, which only shards
    them) run their three GEMMs per expert in FP8 (`FP8GroupedExperts`).

What always stays in high precision (DeepSeek-V3 §3.3.1: "the embedding module, the output
head, MoE gating modules, normalization operators, and attention operators"): the embedding
and the norms are not linears, attention's softmax and the SDPA call are not GEMMs of a
linear, the router scores in fp32 with its own F.linear; the output head (`lm_head`, or
the tied embedding) and a shared expert's gate are kept out by name (`ALWAYS_KEPT_OUT`).

Keep-out patterns (`train.fp8_keep_out`) are fnmatch patterns on module names; a pattern
also keeps out everything under a module it names ("layers.0" keeps out the first block)
and a bare leaf name matches that leaf anywhere ("down_proj"). A pattern that matches no
linear is refused (ConfigError): a typo would otherwise silently change nothing.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from fivefold.config.fp8 import (  # noqa: F401 (parse_keep_out: re-exported)
    ALWAYS_KEPT_OUT,
    keep_out_matches,
    parse_keep_out,
    unmatched_keep_out,
)
from fivefold.config.train import resolve_compile
from fivefold.errors import ConfigError
from fivefold.lowp.delayed import add_expert_history, add_history
from fivefold.lowp.experts import FP8ExpertsMixin, FP8GroupedExperts
from fivefold.lowp.linear import (
    FP8Linear,
    FP8LinearFn,
    FP8LinearMixin,
    FP8Recipe,
    FP8ShardMixin,
)
from fivefold.models.moe import GroupedExperts
from fivefold.numerics.fp8_kernel import kernel_shape_problem, kernel_support


def fp8_targets(model: nn.Module) -> dict[str, nn.Module]:
    """The modules FP8 can take over: linears, pluggable-GEMM layers, grouped experts."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, GroupedExperts))
            or hasattr(type(m), "linear_fn")}


def convert_to_fp8(model: nn.Module, recipe: FP8Recipe,
                   keep_out: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Swap FP8 GEMMs into `model` (meta-built or materialised); returns the converted names."""
    targets = fp8_targets(model)
    problem = unmatched_keep_out(targets, keep_out)
    if problem:
        raise ConfigError(problem)
    converted = []
    for name, module in targets.items():
        if any(keep_out_matches(name, p) for p in (*ALWAYS_KEPT_OUT, *keep_out)):
            continue
        if isinstance(module, nn.Linear):
            _swap(module, FP8LinearMixin).fp8_recipe = recipe
            if recipe.scaling == "delayed":
                add_history(module, recipe.history_len)
        elif isinstance(module, GroupedExperts):
            _swap(module, FP8ExpertsMixin).fp8_recipe = recipe
            if recipe.scaling == "delayed":  # per expert and projection (lowp/delayed.py)
                add_expert_history(module, recipe.history_len)
        else:  # a tensor-parallel shard; under delayed scaling it keeps its own history
            if recipe.scaling == "delayed":
                _swap(module, FP8ShardMixin)
                add_history(module, recipe.history_len)
            module.linear_fn = FP8LinearFn(recipe, module)
        converted.append(name)
    return converted


_SWAPPED: dict[tuple[type, type], type] = {(FP8LinearMixin, nn.Linear): FP8Linear,
                                           (FP8ExpertsMixin, GroupedExperts): FP8GroupedExperts}


def _swap(module: nn.Module, mixin: type) -> nn.Module:
    """module.__class__ becomes (mixin, its class), once per class (FSDP2's fully_shard and
    parallel/tensor.py swap classes the same way)."""
    cls = type(module)
    if not issubclass(cls, mixin):
        if (mixin, cls) not in _SWAPPED:
            _SWAPPED[(mixin, cls)] = type(f"FP8{cls.__name__}", (mixin, cls), {})
        module.__class__ = _SWAPPED[(mixin, cls)]
    return module


def apply_fp8(model: nn.Module, train_cfg, device: torch.device) -> tuple[list[str], str]:
    """train.precision = 'fp8': the recipe and keep-out list of [train], on `model`; returns
    the converted names and the line that says which kernel the GEMMs take (the trainer
    prints it on rank 0 unless quiet)."""
    recipe = FP8Recipe.from_name(train_cfg.fp8_recipe, train_cfg.fp8_grad_format,
                                 getattr(train_cfg, "fp8_scaling", "dynamic"),
                                 getattr(train_cfg, "fp8_history_len", 16))
    check_fp8_device(recipe, device)
    check_fp8_compile(recipe, resolve_compile(getattr(train_cfg, "compile", False),
                                              device.type), device)
    converted = convert_to_fp8(model, recipe, parse_keep_out(train_cfg.fp8_keep_out))
    modules = dict(model.named_modules())
    kernel, line = choose_kernel(getattr(train_cfg, "fp8_kernel", "auto"), recipe,
                                 [modules[n] for n in converted], device)
    if kernel != recipe.kernel:
        set_recipe([modules[n] for n in converted], replace(recipe, kernel=kernel))
    return converted, line


def fp8_weight_shapes(module: nn.Module) -> list[tuple[int, int]]:
    """The (rows, cols) of each weight an FP8 module quantises (the local shard under tp)."""
    if isinstance(module, GroupedExperts):
        return [tuple(w.shape[1:]) for w in (module.w_gate, module.w_up, module.w_down)]
    return [tuple(module.weight.shape)]


def choose_kernel(choice: str, recipe: FP8Recipe, modules: list[nn.Module],
                  device: torch.device) -> tuple[str, str]:
    """(the blockwise kernel to use, the line that says where the FP8 GEMMs run).
    `choice`: train.fp8_kernel (auto | scaled_mm | emulated)."""
    if recipe.name != "blockwise":
        where = "cuBLASLt" if device.type == "cuda" else f"torch's {device.type} kernel"
        delayed = ", delayed scaling" if recipe.scaling == "delayed" else ""
        return "emulated", f"fp8: {recipe.name}{delayed} GEMMs on torch._scaled_mm ({where})"
    emulated = "fp8: blockwise GEMMs emulated in 128-wide K slices, fp32 accumulation"
    if choice == "emulated":
        return "emulated", f"{emulated} (train.fp8_kernel = 'emulated')"
    ok, why = kernel_support(device)
    if ok:
        for module in modules:
            problem = next(filter(None, (kernel_shape_problem(*shape)
                                         for shape in fp8_weight_shapes(module))), None)
            if problem:
                ok, why = False, f"{type(module).__name__}: {problem}"
                break
    if ok:
        return "scaled_mm", f"fp8: blockwise GEMMs on {why}"
    if choice == "scaled_mm":
        raise ConfigError(f"train.fp8_kernel = 'scaled_mm' cannot run here: {why}; use "
                          f"fp8_kernel = 'auto' or 'emulated'")
    return "emulated", f"{emulated} ({why})"


def set_recipe(modules: list[nn.Module], recipe: FP8Recipe) -> None:
    for module in modules:
        if isinstance(module, (FP8LinearMixin, FP8ExpertsMixin)):
            module.fp8_recipe = recipe
        else:
            module.linear_fn = FP8LinearFn(recipe, module)


def check_fp8_device(recipe: FP8Recipe, device: torch.device) -> None:
    """`torch._scaled_mm` (tensorwise, rowwise) needs FP8 tensor cores on CUDA: compute
    capability 8.9 (Ada) or 9.0 (Hopper) and up. Blockwise runs its K slices anywhere."""
    if device.type != "cuda" or recipe.name == "blockwise":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"train.fp8_recipe = '{recipe.name}' on {name} (compute capability "
                          f"{major}.{minor}): FP8 GEMMs need 8.9 or newer; use "
                          f"train.precision = 'bf16' or fp8_recipe = 'blockwise'")


def check_fp8_compile(recipe: FP8Recipe, compiled: bool, device: torch.device) -> None:
    """train.compile with FP8: tensorwise (dynamic or delayed scaling), rowwise and
    rowwise_gw_hp compile on any device (their GEMMs, casts and delayed scaling's record
    folds are custom ops, numerics/fp8_ops.py and fp8_cast.py; delayed scaling's host state
    is read by the graphs as constants, lowp/delayed.py); blockwise compiles on CUDA, but on
    a CPU inductor's C++ code generation fails on its 128-wide slices (torch 2.13:
    AssertionError in cpp.py `try_loop_split`), so that is refused before the first step."""
    if compiled and recipe.name == "blockwise" and device.type == "cpu":
        raise ConfigError("train.compile = true with train.fp8_recipe = 'blockwise' on a CPU: "
                          "inductor cannot compile the blockwise FP8 linear there; use "
                          "train.compile = false (or auto), or fp8_recipe = 'tensorwise' or "
                          "'rowwise'")
