"""Perplexity over a token stream: exp of the mean negative log-likelihood per target token.

Method. The stream t_0 … t_{N-1} is cut into windows of `seq_len` + 1 tokens that overlap
by one token, as the training loader cuts it (data/loader.py): window k covers
[k·seq_len, k·seq_len + seq_len + 1), its inputs are the first seq_len tokens and its
targets the same shifted by one. So every token but the first is a target exactly once,
and the last window may be shorter. Each window starts with an empty context (no sliding
window: a token near a window's start is scored with little context, the usual
"non-overlapping" perplexity; see the transformers documentation's page on the perplexity
of fixed-length models).

    loss = Σ_windows Σ_targets −log p(t_i | t_<i in its window) / (number of targets)
    perplexity = exp(loss)

The mean is token-weighted: a short last window counts by its tokens, not as a whole
window. On one window this is what transformers' `LlamaForCausalLM(input_ids,
labels=input_ids).loss` gives (its labels are shifted inside the model), which is the
oracle in tests/test_eval_perplexity.py.

The loss is the model's own summed fp32 cross-entropy (models/loss.py), which never holds
a whole batch's logits, so a 128k vocabulary fits as it does in training.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fivefold.config import ConfigError


@dataclass
class PerplexityResult:
    loss: float  # mean negative log-likelihood per target token, in nats
    perplexity: float
    tokens: int  # target tokens scored
    windows: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)


def window_bounds(num_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """[start, end) of each window of at most seq_len + 1 tokens; consecutive windows share
    one token, the last holds at least two (one input, one target)."""
    if seq_len < 1:
        raise ConfigError(f"--seq-len {seq_len} must be >= 1")
    return [(start, min(start + seq_len + 1, num_tokens))
            for start in range(0, max(num_tokens - 1, 0), seq_len)]


@torch.no_grad()
def perplexity(model, tokens, seq_len: int, batch_size: int = 8,
               max_tokens: int | None = None) -> PerplexityResult:
    """Token-weighted perplexity of `model` over `tokens` (a 1-D array or tensor of ids).

    `model(inputs, targets)` must return the summed cross-entropy of the targets (the
    fivefold Llama does). Full windows are run `batch_size` at a time; the last, shorter
    window alone. `max_tokens` keeps only the first that many tokens of the stream.
    """
    ids = torch.as_tensor(np.asarray(tokens[:max_tokens] if max_tokens else tokens)
                          .astype(np.int64))  # a copy: a token file's memmap is read-only
    if ids.dim() != 1:
        raise ConfigError(f"perplexity needs a 1-D token stream, got shape {tuple(ids.shape)}")
    if ids.numel() < 2:
        raise ConfigError(f"perplexity needs at least 2 tokens (one input, one target); the "
                          f"stream holds {ids.numel()}: give a longer token file")
    vocab = model.cfg.vocab_size
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ConfigError(f"token id {high if high >= vocab else low} is outside the model's "
                          f"vocabulary of {vocab}; use a token file made with the model's "
                          f"tokenizer")
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be >= 1")
    seq_len = min(seq_len, model.cfg.max_seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    bounds = window_bounds(ids.numel(), seq_len)
    full = [b for b in bounds if b[1] - b[0] == seq_len + 1]
    rest = [b for b in bounds if b[1] - b[0] != seq_len + 1]
    total, count = 0.0, 0
    for first in range(0, len(full), batch_size):
        batch = torch.stack([ids[s:e] for s, e in full[first:first + batch_size]]).to(device)
        total += float(model(batch[:, :-1], batch[:, 1:]))
        count += batch[:, 1:].numel()
    for s, e in rest:
        window = ids[s:e].unsqueeze(0).to(device)
        total += float(model(window[:, :-1], window[:, 1:]))
        count += e - s - 1
    model.train(was_training)
    loss = total / count
    return PerplexityResult(loss=loss, perplexity=math.exp(loss), tokens=count,
                            windows=len(bounds), seq_len=seq_len)


def validation_tokens(path: str | Path, val_fraction: float) -> np.ndarray:
    """The validation split of a prepared token file: its last `val_fraction`, as the
    training loader splits it (data/loader.py split_bounds)."""
    from fivefold.data.loader import TokenDataset, split_bounds

    ds = TokenDataset.open(path)
    start, end = split_bounds(ds.num_tokens, val_fraction, "val")
    if end - start < 2:
        raise ConfigError(f"the validation split of {path} (data.val_fraction = "
                          f"{val_fraction}) holds {end - start} tokens; give --data TOKENS")
    return np.asarray(ds.tokens[start:end])


def token_file(path: str | Path) -> np.ndarray:
    """All tokens of a prepared token file (`fivefold prepare`)."""
    from fivefold.data.loader import TokenDataset

    return np.asarray(TokenDataset.open(path).tokens)


def checkpoint_validation(meta: dict) -> tuple[np.ndarray, str, int]:
    """(tokens, description, seq_len) of the validation split a checkpoint was trained
    beside, from its meta.json: data.path (or the bundled corpus in the checkpoint's
    tokenizer), data.val_fraction and train.seq_len."""
    from fivefold.data.dataset import default_corpus_tokens

    cfg = meta.get("config") or {}
    data, train = cfg.get("data") or {}, cfg.get("train") or {}
    val_fraction = float(data.get("val_fraction", 0.05)) or 0.05
    path = data.get("path") or default_corpus_tokens(meta.get("tokenizer") or "byte")
    seq_len = int(train.get("seq_len") or meta["model"]["max_seq_len"])
    described = f"validation split (last {val_fraction:g}) of {path}"
    return validation_tokens(path, val_fraction), described, seq_len
