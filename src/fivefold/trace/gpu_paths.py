"""What a GPU runs where the meta device would run something else.

`scaled_dot_product_attention` picks its kernel per device type; on meta it always takes
the math path (a bmm/softmax chain holding the score matrix), which no GPU takes. Under
`gpu_attention()` it runs the kernel torch's CUDA dispatch would pick, in its default order
(flash, then memory-efficient, then math; torch/nn/attention, sdp_utils): flash for
bf16/fp16 without a mask or dropout and a head dim of at most 256 (a multiple of 8), with
grouped-query heads as they are (flash handles them natively); memory-efficient otherwise,
its key/value heads repeated when grouped. Both kernels have meta implementations and
autograd formulas, so the backward is the GPU's too.

`torch.optim.AdamW`: the engine asks for the fused kernel on CUDA and foreach elsewhere
(parallel/update.py `adamw`); under `gpu_optimizer()` an AdamW of meta parameters that asks
for foreach is made fused, as on the GPU (torch's fused AdamW has a meta kernel). Over fp32
masters of bf16/fp16 gradients the engine then steps it by its own one-pass op on any device
but the CPU (parallel/adamw_kernel.py), which the trace sees as on a GPU.

FP8's blockwise GEMM: the engine takes cuBLASLt's blockwise `_scaled_mm` on a GPU of compute
capability 9.x (numerics/fp8_kernel.py `kernel_support`, asked by lowp/convert.py); under
`gpu_fp8(sm90=True)` a meta device answers as such a GPU (H100, H200), so a traced FP8 step
takes that kernel; elsewhere the emulated one, as the engine would.

Other `device.type == "cuda"` branches of the engine still take their non-CUDA side under a
trace (grep the source): pinned host buffers for offload (parallel/zero.py, nvme.py), the
pipeline's receive order (parallel/pipeline/runtime.py), the ring attention kernel choice
(parallel/context/kernels.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _gpu_sdpa(original):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False, **kwargs):
        if query.device.type != "meta" or kwargs:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kwargs)
        d = query.shape[-1]
        if (query.dtype in (torch.bfloat16, torch.float16) and attn_mask is None
                and d <= 256 and d % 8 == 0):
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(groups, dim=-3)
            value = value.repeat_interleave(groups, dim=-3)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
    sdpa.original = original
    return sdpa


def _fused_adamw(original):
    class AdamW(original):
        def __init__(self, params, *args, foreach=None, fused=None, **kwargs):
            params = list(params)
            flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
            if foreach and any(p.device.type == "meta" for p in flat):
                foreach, fused = None, True
            super().__init__(params, *args, foreach=foreach, fused=fused, **kwargs)
    AdamW.__name__ = AdamW.__qualname__ = original.__name__
    return AdamW


@contextmanager
def gpu_optimizer():
    """Within: an AdamW of meta parameters asking for foreach is fused, as on CUDA."""
    import torch.optim.optimizer as optimizer_mod

    supported = optimizer_mod._get_fused_kernels_supported_devices
    original = torch.optim.AdamW
    optimizer_mod._get_fused_kernels_supported_devices = lambda: [*supported(), "meta"]
    torch.optim.AdamW = _fused_adamw(original)
    try:
        yield
    finally:
        torch.optim.AdamW = original
        optimizer_mod._get_fused_kernels_supported_devices = supported


SM90 = ("h100", "h200")  # the catalog's GPUs of compute capability 9.x


@contextmanager
def gpu_fp8(sm90: bool):
    """Within: the blockwise FP8 kernel's support check answers for a meta device as an
    sm90 GPU would (`sm90`) or as one without the kernel."""
    try:
        from fivefold.lowp import convert
        from fivefold.numerics.fp8_kernel import scaled_mm_api
    except ImportError:  # a revision without FP8's kernel choice
        yield
        return
    original = convert.kernel_support

    def support(device):
        if device.type != "meta":
            return original(device)
        if not sm90:
            return False, "the traced GPU has no cuBLASLt blockwise FP8 GEMM (needs 9.x)"
        if scaled_mm_api() is None:
            return False, f"torch {torch.__version__} has neither F.scaled_mm nor _scaled_mm_v2"
        return True, "cuBLASLt (traced as on a GPU of compute capability 9.x)"
    convert.kernel_support = support
    try:
        yield
    finally:
        convert.kernel_support = original


@contextmanager
def gpu_attention():
    """Within: F.scaled_dot_product_attention on meta tensors runs the GPU's kernel."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _gpu_sdpa(original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
