"""How many token rows the fused head-and-loss (models/loss.py) takes at a time: one rule
for the engine and the planner (plan/activations.py), so both hold the same chunk. No torch.

On a CPU the chunk is fixed: `LOGITS_CHUNK_ELEMENTS` fp32 logits (64 MiB). Each chunk reads
the head's weight W (V × h) twice and adds its share of W's gradient into an fp32 buffer,
which a CPU's caches tolerate and its allocator prefers small.

On a GPU the chunk follows the device's memory instead. Every chunk costs a read of W for
the logits, one for the input's gradient and a read-modify-write of an fp32 V × h gradient:
at Llama 3's 128k vocabulary and h 4096 about 10 GB of traffic a chunk, and a 64 MiB chunk
means 63 chunks at 8192 tokens (~620 GB a step, W5-NOTES §1). So the chunk takes up to
`DEVICE_MEMORY_SHARE` of the device's memory in compute-dtype logits (the fused kernel
writes their gradient over them, nothing fp32 of that size exists): 1/32 of an 80 GiB
card is 2.5 GiB, the whole 8192 × 128k bf16 logits (2 GiB), so one chunk, W read twice a
step, and W's gradient written once in the compute dtype with no fp32 buffer at all.
"""

from __future__ import annotations

LOGITS_CHUNK_ELEMENTS = 1 << 24  # a CPU's chunk: 2^24 fp32 logits = 64 MiB
DEVICE_MEMORY_SHARE = 32  # a GPU's chunk: at most 1/32 of its memory in logits


def chunk_rows(num_tokens: int, vocab_local: int, device_memory: float = 0.0,
               logit_bytes: int = 2) -> int:
    """Token rows per chunk. `device_memory`: the GPU's bytes (0: a CPU, the fixed chunk);
    `logit_bytes`: the compute dtype's size, what a GPU chunk's logits take per element."""
    if device_memory > 0:
        elements = int(device_memory // DEVICE_MEMORY_SHARE // max(logit_bytes, 1))
    else:
        elements = LOGITS_CHUNK_ELEMENTS
    return max(1, min(num_tokens, elements // max(vocab_local, 1)))


def num_chunks(num_tokens: int, vocab_local: int, device_memory: float = 0.0,
               logit_bytes: int = 2) -> int:
    rows = chunk_rows(num_tokens, vocab_local, device_memory, logit_bytes)
    return -(-num_tokens // rows) if num_tokens else 0
