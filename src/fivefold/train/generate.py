"""Text generation with the model's KV cache, and the `fivefold generate` command.

The prompt is run once (prefill), filling the cache; then each new token is one forward pass
over a single position that attends to the cached keys and values. Sampling takes the last
position's logits, divides them by the temperature, keeps the `top_k` largest and then the
smallest set whose probability reaches `top_p` (nucleus sampling, Holtzman et al. 2020), and
draws from what is left with a seeded generator, so a run is reproducible from its seed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from fivefold.config import ArgumentParser, ConfigError
from fivefold.data.tokenizer import HF_TOKENIZER_HELP, gil_free_ids
from fivefold.models.llama import KVCache
from fivefold.models.sampling import sample_token


def _as_set(ids: int | Iterable[int] | None) -> set[int]:
    return set() if ids is None else {ids} if isinstance(ids, int) else set(ids)


def decode(model, prompt_tokens: list[int], max_new_tokens: int,
           pick: Callable[[torch.Tensor], int],
           eos_id: int | Iterable[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """New tokens and the fp32 logits each was picked from, using the model's KVCache.

    `pick` maps a (vocab,) logits row to the next token id. Stops after `max_new_tokens` or
    after emitting a token in `eos_id` (which is included in the result).
    """
    cfg = model.cfg
    if not prompt_tokens:
        raise ConfigError("the prompt is empty; generation needs at least one prompt token")
    total = len(prompt_tokens) + max_new_tokens
    if total > cfg.max_seq_len:
        raise ConfigError(f"prompt ({len(prompt_tokens)} tokens) + --max-new-tokens "
                          f"({max_new_tokens}) exceeds the model's max_seq_len = "
                          f"{cfg.max_seq_len}; shorten one of them")
    bad = [t for t in prompt_tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary of "
                          f"{cfg.vocab_size}; use the tokenizer the model was trained with")
    stop = _as_set(eos_id)
    param = next(model.parameters())
    cache = KVCache(cfg, 1, total, param.device, param.dtype)
    new_tokens: list[int] = []
    step_logits: list[torch.Tensor] = []
    with torch.inference_mode():
        tokens = torch.tensor([prompt_tokens], device=param.device)
        logits = model(tokens, cache=cache, start=0)[0, -1].float()
        for step in range(max_new_tokens):
            token = pick(logits)
            new_tokens.append(token)
            step_logits.append(logits)
            if token in stop or step == max_new_tokens - 1:
                break
            tokens = torch.tensor([[token]], device=param.device)
            logits = model(tokens, cache=cache, start=len(prompt_tokens) + step)[0, -1].float()
    return new_tokens, step_logits


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ConfigError(f"--temperature {temperature} must be >= 0 (0 means greedy)")
    if top_k < 0:
        raise ConfigError(f"--top-k {top_k} must be >= 0 (0 switches it off)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p {top_p} must lie in (0, 1] (1 switches it off)")


def generate(model, prompt_tokens: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, greedy: bool = False, seed: int = 0,
             eos_id: int | Iterable[int] | None = None) -> list[int]:
    """The new tokens (not the prompt) generated after `prompt_tokens`."""
    check_sampling(temperature, top_k, top_p)
    generator = torch.Generator().manual_seed(seed)

    def pick(logits: torch.Tensor) -> int:
        return sample_token(logits, temperature, top_k, top_p, greedy, generator)

    return decode(model, prompt_tokens, max_new_tokens, pick, eos_id)[0]


class TextCodec:
    """encode/decode for the command: a tokenizer.json, or UTF-8 bytes."""

    def __init__(self, tokenizer_json: Path | None = None, eos_id=None):
        self.eos_id = eos_id
        self._tok = None
        if tokenizer_json is not None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(tokenizer_json))

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return list(text.encode("utf-8"))
        # with the model's BOS, as transformers would add
        return gil_free_ids(self._tok, text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._tok.decode(ids, skip_special_tokens=True)


def _hf_eos(directory: Path):
    """eos_token_id from generation_config.json (chat models list several), else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return eos
    return None


def hf_codec(directory: Path, option: str | None):
    """encode/decode for --hf: the directory's tokenizer.json (as transformers encodes,
    with the model's end-of-text ids), or the tokenizer --tokenizer names."""
    from fivefold.data.tokenizer import hf_tokenizer_spec, load_tokenizer

    spec = hf_tokenizer_spec(directory, option)
    if option:
        return load_tokenizer(spec)
    return TextCodec(Path(spec), _hf_eos(directory))


def load_for_generation(args) -> tuple:
    """(model, codec) from --hf or --checkpoint."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no GPU is visible; use --device cpu or auto")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16,
             "auto": torch.bfloat16 if device == "cuda" else torch.float32}[args.dtype]
    if getattr(args, "tokenizer", None) and not args.hf:
        raise ConfigError("--tokenizer names the tokenizer of an --hf directory; a checkpoint "
                          "records its own, so drop --tokenizer")
    if args.hf:
        from fivefold.models.hf import load_hf

        directory = Path(args.hf)
        if not (directory / "config.json").is_file():
            raise ConfigError(f"--hf {directory} has no config.json; give a Hugging Face "
                              f"checkpoint directory")
        codec = hf_codec(directory, getattr(args, "tokenizer", None))  # before the weights
        model = load_hf(directory, dtype=dtype, device=device)
        return model.eval(), codec
    from fivefold.data.tokenizer import load_tokenizer
    from fivefold.finetune.attach import load_for_inference
    from fivefold.quant.io import is_quantized, load_quantized

    if is_quantized(args.checkpoint):  # `fivefold quantize` output: packed weights stay so
        model, _model_cfg, spec = load_quantized(args.checkpoint)
    else:
        # A LoRA checkpoint comes back as its base with the adapters (finetune/attach.py).
        model, _model_cfg, spec, _lora = load_for_inference(args.checkpoint)
    if isinstance(spec, dict):  # token-file metadata: {"kind", "path", ...}
        spec = spec.get("path") or "byte"
    tok = load_tokenizer(spec)
    return model.to(device=device, dtype=dtype).eval(), tok


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fivefold generate",
                                description="Generate text from a checkpoint or HF model.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a fivefold checkpoint directory")
    source.add_argument("--hf", help="a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--tokenizer", help=HF_TOKENIZER_HELP)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate after the prompt (default 64)")
    # The command's sampling defaults are llama.cpp's (temperature 0.8, top-k 40, top-p 0.95,
    # common/common.h): the unlikely tail a small model spreads its mass over is cut off.
    # The library functions keep the neutral 1.0 / off / off.
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="0: off")
    p.add_argument("--top-p", type=float, default=0.95, help="1: off")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=0,
                   help="the sampling's random seed: the same seed, the same text (default 0)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: the GPU when torch sees one, else the CPU")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="the weights' dtype; auto: bf16 on a GPU, fp32 on a CPU")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error, or the help
        return int(e.code or 0)
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
        model, codec = load_for_generation(args)
        prompt = codec.encode(args.prompt)
        new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                       args.top_p, args.greedy, args.seed, codec.eos_id)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if new and codec.eos_id is not None and new[-1] in _as_set(codec.eos_id):
        new = new[:-1]  # the end-of-text marker is not text
    print(codec.decode(prompt + new))
    return 0
