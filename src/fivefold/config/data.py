"""[data]: the token file (or the bundled corpus) and its tokenizer, and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import ConfigError


@dataclass
class DataSection:
    path: str = ""  # a token file from `fivefold prepare`; empty: the bundled corpus
    val_fraction: float = 0.05
    tokenizer: str = "auto"  # auto: corpus-bpe if model.vocab_size >= 2048, else byte; or a .json


CORPUS_TOKENIZERS = ("auto", "corpus-bpe", "byte")
CORPUS_BPE_VOCAB = 2048  # data/corpus/bpe-2048.json


def corpus_tokenizer(spec: str, vocab_size: int) -> str:
    """data.tokenizer for the bundled corpus, with auto resolved: the shipped BPE when the
    model's vocabulary holds it, bytes otherwise (the byte-vocabulary presets tiny and tiny-moe
    keep training on bytes)."""
    if spec != "auto":
        return spec
    return "corpus-bpe" if vocab_size >= CORPUS_BPE_VOCAB else "byte"


def check_data(cfg) -> None:
    """The input files must exist and be what they say."""
    d = cfg.data
    if d.path and Path(d.path).is_dir():
        raise ConfigError(f"data.path = '{d.path}' is a directory; give the token file "
                          f"`fivefold prepare -o FILE` wrote (e.g. {d.path}/tokens.bin)")
    if d.path and Path(d.path).exists() and not Path(d.path).is_file():
        raise ConfigError(f"data.path = '{d.path}' is not a regular file (a device or a pipe "
                          f"has no token file's header); give the file `fivefold prepare -o "
                          f"FILE` wrote")
    if d.path and not Path(d.path).exists():
        raise ConfigError(f"data.path = '{d.path}' does not exist; run `fivefold prepare` to make "
                          f"a token file, or leave data.path empty for the bundled corpus")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction = {d.val_fraction} must lie in [0, 1)")
    if d.tokenizer not in CORPUS_TOKENIZERS and not Path(d.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer = '{d.tokenizer}' is none of "
                          f"{', '.join(CORPUS_TOKENIZERS)} nor a tokenizer.json file")
