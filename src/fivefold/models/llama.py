"""A Llama-family decoder in plain PyTorch. It knows nothing of parallelism.

The structure and parameter names follow Hugging Face's `LlamaForCausalLM` (without the
`model.` prefix), so checkpoints convert by renaming alone:

    embed_tokens -> layers[i] (input_layernorm, self_attn, post_attention_layernorm, mlp)
    -> norm -> lm_head (absent when the embeddings are tied) -> loss_fn

Every piece a parallel dimension replaces is its own module: the attention core (`core`,
recomputed by selective recomputation, replaced by ring attention for context parallelism),
the loss (`loss_fn`, which also applies the head, in chunks of tokens; replaced by the
vocab-parallel loss under tensor parallelism). Heads are
instance attributes, so tensor parallelism can shrink them to the local count.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models import block_kernels
from fivefold.models.block_kernels import apply_rope
from fivefold.models.loss import chunked_linear_cross_entropy, cross_entropy_sum
from fivefold.models.mlp import MLP
from fivefold.models.moe import MoE
from fivefold.models.presets import ModelConfig


class RMSNormFunction(torch.autograd.Function):
    """weight · x / rms(x), saving only x and 1/rms for backward.

    Written out by hand so that backward keeps what a fused norm kernel keeps (the input and
    one statistic per token) instead of autograd's extra normalised copy of x: one tensor of
    b·s·h fewer per norm, two per layer. Statistics are taken in fp32 and the result cast
    back, as Llama does, so bf16 runs keep fp32-accurate normalisation.
    """

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        # a GPU, eager: one kernel (models/block_kernels.py); elsewhere the torch ops
        fused = block_kernels.fused_path(x)
        y, rstd = (block_kernels.rms_norm_forward(x.contiguous(), weight, eps) if fused
                   else block_kernels.rms_norm_reference_forward(x, weight, eps))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        if block_kernels.fused_path(x):
            grad_x, grad_weight = block_kernels.rms_norm_backward(grad, x.contiguous(), weight,
                                                                rstd)
        else:
            grad_x, grad_weight = block_kernels.rms_norm_reference_backward(grad, x, weight,
                                                                          rstd)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """GPT-style LayerNorm with bias (for the GPT-3 shaped variant)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.norm == "rmsnorm" else LayerNorm(
        cfg.hidden_size, cfg.norm_eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, with Llama-3.1's frequency scaling when configured.

    Llama 3.1 (Meta's reference `apply_scaling`, also HF `_compute_llama3_parameters`): keep
    high frequencies (wavelength < original_len / high_freq_factor), divide low frequencies
    (wavelength > original_len / low_freq_factor) by `factor`, and interpolate smoothly between.
    """
    dim = cfg.dim_per_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
    sc = cfg.rope_scaling
    if not sc:
        return inv_freq.float()
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


class Rotary(nn.Module):
    """Cos/sin tables for rotary position embeddings (rotate-half layout, as in HF Llama)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


# torch >= 2.5 lets SDPA share each key/value head among its query heads without copying them.
SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d))V with a causal mask: the part selective recomputation drops.

    q: (b, heads, s, d); k, v: (b, kv_heads, s_kv, d). Grouped-query attention shares each
    key/value head among its group of query heads (on torch < 2.5 by repeating them).
    """

    def forward(self, q, k, v, causal_offset: int | None = 0):
        rep = q.shape[1] // k.shape[1]
        gqa = {}
        if rep > 1 and SDPA_GQA:
            gqa = {"enable_gqa": True}
        elif rep > 1:
            b, kvh, s, d = k.shape
            k = k[:, :, None].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)
            v = v[:, :, None].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)
        if causal_offset == 0 and q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        # Decoding with a KV cache: query i sits at position causal_offset + i.
        qpos = torch.arange(q.shape[2], device=q.device) + causal_offset
        mask = qpos[:, None] >= torch.arange(k.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.dim_per_head
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=cfg.mlp == "gelu")
        if cfg.qk_norm:  # RMSNorm of q and k before RoPE: per head (Qwen3) or whole (OLMoE)
            whole = cfg.qk_norm_whole
            self.q_norm = RMSNorm(cfg.q_size if whole else cfg.dim_per_head, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size if whole else cfg.dim_per_head, cfg.norm_eps)
        self.qk_norm, self.qk_norm_whole = cfg.qk_norm, cfg.qk_norm_whole
        self.core = AttentionCore()

    def forward(self, x, cos, sin, cache: KVCache | None = None, layer: int = 0, start: int = 0):
        b, s, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim)
        if self.qk_norm and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if block_kernels.rope_fused_path(q, cos):  # a GPU, eager: q and k in one kernel
            q, k = block_kernels.RopeFunction.apply(q, k, cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if cache is not None and hasattr(cache, "attend"):
            # A paged cache (serve/kv_cache.py) holds a batch of sequences flattened into one
            # row: it stores k, v in their blocks and attends each sequence to its own.
            out = cache.attend(layer, q, k, v)
        else:
            if cache is not None:
                k, v = cache.update(layer, start, k, v)
            out = self.core(q, k, v, causal_offset=start)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, layer: int = 0, start: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class CrossEntropySum(nn.Module):
    """Sum of token cross-entropies in fp32 from the head's input and weight; targets of -100
    are ignored. The head runs in chunks of tokens inside the loss, so the full logits never
    exist (models/loss.py).

    The trainer divides by the number of target tokens in the whole global batch, so that
    accumulation and data parallelism give the same loss as one big batch.
    """

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        return chunked_linear_cross_entropy(hidden, weight, targets)

    def from_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, targets)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loss_fn = CrossEntropySum()

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(h), self.output_weight())

    def forward(self, tokens, targets=None, cache: KVCache | None = None, start: int = 0,
                positions: torch.Tensor | None = None,
                logits_index: torch.Tensor | None = None):
        """tokens (b, s) -> logits (b, s, V); with targets, the summed fp32 loss instead
        (computed without materialising the logits).

        `positions` (s,) overrides the RoPE positions start, start + 1, ... (a serving batch
        holds several sequences in one row); `logits_index` keeps only those positions'
        logits: (b, len(logits_index), V)."""
        h = self.embed_tokens(tokens)
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, i, start)
        if targets is None:
            return self.logits(h if logits_index is None else h[:, logits_index])
        return self.loss_fn(self.norm(h), self.output_weight(), targets)


class KVCache:
    """Pre-allocated keys and values for generation: (layers, b, kv_heads, max_len, d)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.dim_per_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, layer: int, start: int, k, v):
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
