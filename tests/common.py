"""Small configs shared by the tests."""

from __future__ import annotations

from fivefold import config


def small_config(tmp_path, *overrides: str, **kw) -> config.Config:
    """A tiny fp32 run on the bundled corpus that writes only under tmp_path."""
    args = [
        "--model.hidden_size", "32", "--model.intermediate_size", "64",
        "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--train.seq_len", "32", "--train.gbs", "4", "--train.steps", "5",
        "--train.warmup_steps", "0", "--train.eval_every", "0", "--train.precision", "fp32",
        "--train.device", "cpu",
        "--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.every", "0",
        "--log.dir", str(tmp_path / "log"), "--log.progress", "false",
        "--log.tensorboard", "false",
        # The tests' model and micro-batching, pinned: the byte tokenizer with tiny's
        # vocabulary, one sequence per micro-batch (the defaults are the default job's).
        "--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
        *overrides,
    ]
    return config.load(None, args)


def assert_same_lora_run(losses, norms, adapters: dict, rank_runs, tokens: int = 4 * 32,
                         depth: int = 3 * 2, width: int = 64) -> None:
    """A parallel LoRA run against the single process it must reproduce. `rank_runs` holds,
    per rank, (losses, gradient norms, the adapter tensors that rank holds). The float32 error
    model of tests/tolerances.py at the run's sizes (default: small_config's 4 sequences of 32
    tokens per step, 2 blocks of 3 GEMMs of length ≤ 64): every rank's losses within
    loss_rtol and gradient norms within trained_rtol; the adapters gathered from all ranks
    name the same tensors, each within trained_rtol in its norm after its AdamW steps."""
    from tolerances import loss_rtol, trained_rtol, within

    loss_tol, trained_tol = loss_rtol(tokens, depth, width), trained_rtol(tokens, depth, width)
    merged = {}
    for got_losses, got_norms, rank_adapters in rank_runs:
        for a, b in zip(losses, got_losses, strict=True):
            assert within(abs(a - b) / abs(a), loss_tol, "lora loss"), (losses, got_losses)
        for a, b in zip(norms, got_norms, strict=True):
            assert within(abs(a - b) / abs(a), trained_tol, "lora norm"), (norms, got_norms)
        merged.update(rank_adapters)
    assert adapters and set(merged) == set(adapters), (sorted(merged), sorted(adapters))
    for name, value in adapters.items():
        err = float((merged[name] - value).norm() / value.norm())
        assert within(err, trained_tol, f"lora {name}"), (name, err)


def save_tiny_hf_llama(path, hidden: int = 32, intermediate: int = 64, kv_heads: int = 2,
                       tied: bool = True, seed: int = 0, **config_kw):
    """A 2-layer transformers LlamaForCausalLM (vocabulary 256, 4 heads) with weights drawn
    from `seed`, saved at `path`; returns the model (eval mode)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden,
                                   intermediate_size=intermediate, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads,
                                   tie_word_embeddings=tied, **config_kw)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def tiny_train_argv(root) -> list[str]:
    """`fivefold train` argv: a 2-layer width-32 model of the byte vocabulary, 3 fp32 steps
    on the CPU, a checkpoint every step under root/ck (the last 8 items set steps, the
    checkpoint cadence and the directories), logs under root/log."""
    return ["train", "--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs",
            "1", "--model.hidden_size", "32", "--model.intermediate_size", "64",
            "--model.num_layers", "2", "--train.seq_len", "32", "--train.gbs", "4",
            "--train.precision", "fp32", "--train.device", "cpu", "--train.eval_every", "0",
            "--log.progress", "false", "--log.tensorboard", "false", "--train.steps", "3",
            "--checkpoint.every", "1", "--checkpoint.keep", "5",
            "--checkpoint.dir", str(root / "ck"), "--log.dir", str(root / "log")]


def run_interpreted(args: list[str], timeout: int = 600, **kw) -> dict:
    """Run `python args...` with Triton's interpreter (TRITON_INTERPRET=1 is read when a
    kernel is defined, so outside this process) and return the JSON its last line prints.
    The child is forked from a warm process that has imported torch and Triton
    (tests/warm_interpreter.py), in its own environment and directory (`cwd`)."""
    import json
    import os

    import pytest
    import warm_interpreter

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", **kw.pop("env", {})}
    for name in kw.pop("unset", ()):
        env.pop(name, None)
    cwd = str(kw.pop("cwd", os.getcwd()))
    assert not kw, f"run_interpreted takes timeout, env, unset and cwd, not {sorted(kw)}"
    code, out, err = warm_interpreter.run(args, env, cwd, timeout)
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def greedy_workload(n: int, seed: int, vocab: int, prompt=(1, 200), output=(1, 40)):
    """n random prompts of `prompt` lengths (inclusive) over `vocab`, each with greedy
    SamplingParams of `output` max_tokens: the serving tests' mixed batch."""
    import torch

    from fivefold.serve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for _ in range(n):
        length = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        prompts.append(torch.randint(0, vocab, (length,), generator=g).tolist())
        max_tokens = int(torch.randint(output[0], output[1] + 1, (1,), generator=g))
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return prompts, params
