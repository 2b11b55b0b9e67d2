"""What a GPU runs where the meta device would run something else.

`scaled_dot_product_attention` picks its kernel per device type; on meta it always takes
the math path (a bmm/softmax chain holding the score matrix), which no GPU takes. Under
`gpu_attention()` it runs the kernel torch's CUDA dispatch would pick, in its default order
(flash, then memory-efficient, then math; torch/nn/attention, sdp_utils): flash for
bf16/fp16 without a mask or dropout and a head dim of at most 256 (a multiple of 8), with
grouped-query heads as they are (flash handles them natively); memory-efficient otherwise,
its key/value heads repeated when grouped. Both kernels have meta implementations and
autograd formulas, so the backward is the GPU's too.
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


@contextmanager
def gpu_attention():
    """Within: F.scaled_dot_product_attention on meta tensors runs the GPU's kernel."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _gpu_sdpa(original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
