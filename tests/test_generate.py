"""Generation: the KV-cache path against full recomputation, and the samplers' promises.

Tolerance: the logits of every decoding step agree with a full-sequence recomputation within
1e-5 in fp32 (1e-10 in fp64), and the greedy tokens agree exactly.
"""

import math

import pytest
import torch

from fivefold.models.hf import save_hf
from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.train.generate import decode, generate, main, sample_token

PROMPT = [5, 17, 3, 60, 42, 8, 19]


CFG = ModelConfig(name="gen", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=64, init_std=0.1)


@pytest.fixture(scope="module")
def model():
    # init_std 0.1 (logits up to ~3) keeps greedy choices away from near-ties.
    return build_model(CFG, seed=7).eval()


def greedy_by_recomputing(model, prompt, steps):
    tokens, all_logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens]))[0, -1].float()
            all_logits.append(logits)
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], all_logits


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_kv_cache_greedy_matches_recomputation(dtype, tol):
    model = build_model(CFG, seed=7, dtype=dtype).eval()
    steps = 16
    expected, expected_logits = greedy_by_recomputing(model, PROMPT, steps)
    got, got_logits = decode(model, PROMPT, steps, lambda row: int(row.argmax()))
    assert got == expected
    diff = max((a - b).abs().max().item() for a, b in zip(got_logits, expected_logits))
    print(f"kv-cache vs recompute ({dtype}): max |logit diff| over {steps} steps = {diff:.3g}")
    assert len(got_logits) == steps and diff <= tol
    assert len(set(got)) > 1  # not a degenerate repeat of one token
    assert generate(model, PROMPT, steps, greedy=True) == expected
    assert generate(model, PROMPT, steps, temperature=0.0) == expected


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = generate(model, PROMPT, 16, greedy=True)
    assert generate(model, PROMPT, 16, top_k=1, seed=3) == greedy
    assert generate(model, PROMPT, 16, top_p=1e-4, seed=4) == greedy


def test_sampling_is_deterministic_from_its_seed(model):
    a = generate(model, PROMPT, 30, temperature=1.5, seed=11)
    assert generate(model, PROMPT, 30, temperature=1.5, seed=11) == a
    assert generate(model, PROMPT, 30, temperature=1.5, seed=12) != a
    assert a != generate(model, PROMPT, 30, greedy=True)  # it does sample


def test_eos_stops_and_is_kept(model):
    first = generate(model, PROMPT, 5, greedy=True)[0]
    assert generate(model, PROMPT, 5, greedy=True, eos_id=first) == [first]
    assert generate(model, PROMPT, 5, greedy=True, eos_id=[63, first]) == [first]


PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]


def draw(n=4000, **kwargs) -> list[int]:
    logits = torch.tensor([math.log(p) for p in PROBS])
    gen = torch.Generator().manual_seed(0)
    return [sample_token(logits, generator=gen, **kwargs) for _ in range(n)]


@pytest.mark.parametrize("top_p, nucleus", [(0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, None)])
def test_top_p_draws_only_from_the_nucleus(top_p, nucleus):
    draws = draw(top_p=top_p)
    nucleus = nucleus or set(range(len(PROBS)))
    assert set(draws) == nucleus  # nothing outside, and every member does occur
    # renormalised over the nucleus: token 0's share is 0.5 / mass(nucleus)
    share = draws.count(0) / len(draws)
    expected = PROBS[0] / sum(PROBS[i] for i in nucleus)
    assert abs(share - expected) < 0.03  # ~4 standard deviations at n = 4000


def test_top_k_and_temperature():
    assert set(draw(top_k=2)) == {0, 1}
    hot = draw(temperature=5.0).count(0) / 4000
    cold = draw(temperature=0.3).count(0) / 4000
    assert cold > 0.8 and hot < 0.35  # p(0) = 0.5 at temperature 1


def test_bad_sampling_settings_are_refused(model):
    from fivefold.config import ConfigError

    with pytest.raises(ConfigError, match="--top-p"):
        generate(model, PROMPT, 4, top_p=0.0)
    with pytest.raises(ConfigError, match="max_seq_len = 64"):
        generate(model, PROMPT, 60)


def test_cli_with_hf_directory(tmp_path, capsys):
    cfg = ModelConfig(name="bytes", vocab_size=256, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64,
                      tie_embeddings=True, init_std=0.3)
    save_hf(build_model(cfg, seed=1), cfg, tmp_path / "hf")
    args = ["--hf", str(tmp_path / "hf"), "--prompt", "Hello", "--max-new-tokens", "8"]
    assert main([*args, "--greedy"]) == 2  # no tokenizer.json: never bytes unless asked
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "has no tokenizer.json; give --tokenizer" in err
    args += ["--tokenizer", "byte"]
    assert main([*args, "--greedy"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Hello") and len(out.encode()) > len("Hello")
    assert main([*args, "--greedy"]) == 0 and capsys.readouterr().out == out
    assert main([*args, "--max-new-tokens", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "max_seq_len = 64" in err and err.count("\n") == 1


def test_cli_uses_tokenizer_json(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat"] * 4,
                            trainers.BpeTrainer(vocab_size=40, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig(name="bpe", vocab_size=tok.get_vocab_size(), hidden_size=32,
                      intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_seq_len=64)
    save_hf(build_model(cfg, seed=2), cfg, tmp_path / "hf",
            extra_files=[tmp_path / "tokenizer.json"])
    assert main(["--hf", str(tmp_path / "hf"), "--prompt", "the cat", "--greedy",
                 "--max-new-tokens", "4"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["the", "cat"] and len(words) > 2
