"""parallelize(): the one place that fixes the order in which dimensions transform the model.

    tensor (+ sequence) parallel -> context parallel -> expert parallel -> recomputation
    -> pipeline split -> materialise weights -> data parallel / ZeRO (the optimizer side)

The model arrives built on the meta device, so no rank ever allocates more than its share:
each transformation edits modules and tags parameters, and `materialize` then draws each
local tensor from its logical name (see models/init.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivefold.config.train import resolve_compile
from fivefold.models.init import materialize
from fivefold.models.moe import probe_grouped_mm
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.recompute import apply_recompute, compile_inside


@dataclass
class ParallelModel:
    """This rank's share of the model: its chunks (one, or several for virtual pipeline stages)."""

    chunks: list[nn.Module]
    dims: ParallelDims
    fp8_line: str = ""  # train.precision = fp8: where its GEMMs run (lowp/convert.py)

    def named_parameters(self, frozen: bool = False) -> list[tuple[str, nn.Parameter]]:
        """The parameters the optimizer, DP/ZeRO and checkpoints handle: those that require
        a gradient. A frozen base (LoRA, finetune/) is left out unless `frozen`."""
        seen, out = set(), []
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                if id(p) not in seen and (frozen or p.requires_grad):
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def train(self, mode: bool = True) -> None:
        for c in self.chunks:
            c.train(mode)


def parallelize(model: nn.Module, dims: ParallelDims, cfg, device: torch.device,
                dtype: torch.dtype, recompute_policies=None) -> ParallelModel:
    """Apply every configured dimension to a meta-built model, then materialise it.
    `recompute_policies`: under train.recompute = auto, one per block (the planner's)."""
    par, model_cfg = cfg.parallel, cfg.model.resolve()
    if par.tp > 1:
        from fivefold.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, dims, sp=par.sp, sp_saved_input=par.sp_saved_input)
    if par.cp > 1:
        from fivefold.parallel.context import apply_context_parallel

        # Every device has a block kernel: fused (CPU), flash (CUDA) or the portable one.
        apply_context_parallel(model, dims["cp"], par.cp_layout, par.cp_comm)
    if par.ep > 1:
        from fivefold.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, dims)
    fp8_line = ""
    if cfg.train.precision == "fp8":  # FP8 GEMMs in the linears (their local shards) and experts
        from fivefold.lowp.convert import apply_fp8

        _, fp8_line = apply_fp8(model, cfg.train, device)
        if par.fp8_allgather:  # ZeRO-3 gathers these weights in FP8 (parallel/zero3_fp8.py)
            from fivefold.parallel.zero3_fp8 import mark_fp8_gather

            mark_fp8_gather(model)
    apply_recompute(model, cfg.train.recompute, recompute_policies)
    if par.pp > 1:
        from fivefold.parallel.pipeline.stages import split_stages

        chunks = split_stages(model, dims, cfg)
    else:
        chunks = [model]
    for chunk in chunks:
        materialize(chunk, model_cfg, cfg.train.seed, device, dtype)
    if par.pp > 1:  # after materialize, which makes new Parameter objects
        from fivefold.parallel.pipeline.stages import tag_replicas

        tag_replicas(chunks)
    if resolve_compile(cfg.train.compile, device.type):  # auto: on CUDA
        compile_blocks(chunks)
    return ParallelModel(chunks, dims, fp8_line)


def compile_blocks(chunks: list[nn.Module]) -> None:
    """train.compile: each transformer block goes through `torch.compile` (inductor: Triton
    kernels on CUDA, C++ built with the system compiler on a CPU), in place, so parameter
    names and every hook stay. Per block rather than the whole model: the blocks share one
    compiled graph (their code is the same; weights are inputs), the first compile is
    short, and what sits between blocks (pipeline sends, the chunked loss) stays eager."""
    if any(p.device.type == "cpu" for c in chunks for p in c.parameters()):
        separate_cpu_kernel_cache()
    for chunk in chunks:
        probe_grouped_mm(chunk)
        layers = chunk.layers
        for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
            if not compile_inside(block):  # fully recomputed: its forward, inside the
                # checkpoint; a checkpoint that replays all-to-alls: the block eager
                block.compile()


def separate_cpu_kernel_cache() -> None:
    """Inductor's on-disk cache of C++ kernels does not key them on the CPU kernels ATen was
    told to use (ATEN_CPU_CAPABILITY): a block compiled under one capability and loaded under
    another gave a forward off by 1e25 (avx2 after AVX-512 kernels), a glibc heap abort
    (AVX-512 after avx2) and a compile error (default), each gone with a fresh cache (torch
    2.13, seen with tests/test_speed_paths.py). So each capability gets a cache of its own
    inside inductor's default one, unless TORCHINDUCTOR_CACHE_DIR names another (inductor
    writes its default there itself once it has looked, so that value counts as unset)."""
    import os

    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # torch < 2.6
        from torch._inductor.runtime.runtime_utils import default_cache_dir
    default = os.path.abspath(default_cache_dir())
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is not None and os.path.abspath(current) != default:
        return
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default, f"cpu-{capability}")
