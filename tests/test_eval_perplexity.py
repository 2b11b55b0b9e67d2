"""Perplexity (evaluate/perplexity.py) against transformers' loss on the same tokens.

Oracle: a tiny LlamaForCausalLM made here, saved with save_pretrained and loaded through
fivefold's HF loader. transformers' `model(input_ids, labels=input_ids).loss` is the mean
cross-entropy of one window's shifted targets; summed over windows by their target counts
and exponentiated it is the token-weighted perplexity. Tolerance: 1e-5 relative, fp32.
"""

import json
import math

import numpy as np
import pytest
import torch

from fivefold.config import ConfigError
from fivefold.evaluate.perplexity import perplexity, validation_tokens, window_bounds
from fivefold.models.hf import load_hf

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights far from init, so a wrong mapping moves the loss
        for name, p in hf.named_parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if "norm" in name
                    else torch.randn(p.shape, generator=gen) * 0.1)
    directory = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(directory)
    return hf, load_hf(directory, dtype=torch.float32).eval()


def hf_perplexity(hf, ids: torch.Tensor, seq_len: int) -> tuple[float, int]:
    total, count = 0.0, 0
    with torch.no_grad():
        for s, e in window_bounds(ids.numel(), seq_len):
            window = ids[s:e].unsqueeze(0)
            total += float(hf(input_ids=window, labels=window).loss) * (e - s - 1)
            count += e - s - 1
    return math.exp(total / count), count


def stream(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_one_window_equals_transformers_loss(models):
    hf, ours = models
    ids = stream(SEQ + 1)
    with torch.no_grad():
        expected = math.exp(float(hf(input_ids=ids[None], labels=ids[None]).loss))
    got = perplexity(ours, ids, SEQ)
    assert (got.tokens, got.windows) == (SEQ, 1)
    assert got.perplexity == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_many_windows_token_weighted(models, batch_size):
    hf, ours = models
    ids = stream(5 * SEQ + 7)  # five full windows and a short last one of 6 targets
    expected, count = hf_perplexity(hf, ids, SEQ)
    got = perplexity(ours, ids.numpy(), SEQ, batch_size=batch_size)
    assert got.tokens == count == ids.numel() - 1
    assert got.windows == 6
    assert got.perplexity == pytest.approx(expected, rel=1e-5)
    # the short window weighs by its tokens: a window-averaged mean differs here
    assert got.loss == pytest.approx(math.log(expected), rel=1e-5)


def test_windows_score_every_token_once():
    for n, seq in [(2, 4), (17, 16), (18, 16), (33, 16), (100, 7)]:
        targets = [i for s, e in window_bounds(n, seq) for i in range(s + 1, e)]
        assert targets == list(range(1, n)), (n, seq)
        assert all(e - s <= seq + 1 for s, e in window_bounds(n, seq))


def test_validation_split_is_the_loaders(tmp_path):
    from fivefold.data.prepare import prepare

    text = tmp_path / "a.txt"
    text.write_text("abcdefghij" * 40)
    out = tmp_path / "t.bin"
    prepare([str(text)], str(out), tokenizer="byte")
    meta = json.loads(out.with_name("t.bin.json").read_text())
    all_tokens = np.fromfile(out, dtype=meta["dtype"])
    val = validation_tokens(out, 0.1)
    n = len(all_tokens)
    assert len(val) == int(n * 0.1)
    assert np.array_equal(val, all_tokens[n - int(n * 0.1):])


def test_bad_streams_are_one_line(models):
    _, ours = models
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        perplexity(ours, torch.tensor([3]), SEQ)
    with pytest.raises(ConfigError, match="outside the model's vocabulary of 96"):
        perplexity(ours, torch.tensor([1, 2, VOCAB]), SEQ)
