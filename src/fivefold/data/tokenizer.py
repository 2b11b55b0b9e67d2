"""Tokenizers: byte-level (vocabulary 256, no files) or a Hugging Face `tokenizers` BPE.

A spec names one: "byte", "corpus-bpe" (the 2048-token BPE shipped with the bundled corpus,
the default job's tokenizer) or the path of a tokenizer.json.

Both give `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size` and `eos_id`,
the id written between documents by `fivefold prepare`.

Byte-level: a token is one byte of the UTF-8 encoding, and the separator is byte 0 (NUL).
NUL never occurs in real text, so it can mark document ends without taking a byte away from
the text; `prepare` drops any NUL found in the input so that the separator stays unambiguous.
Decoding is exact for any complete UTF-8 sequence; a window cut inside a multi-byte
character decodes with U+FFFD in its place.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.config import ConfigError

BYTE_EOS_ID = 0
# Tokenizers shipped with the package, by spec name. corpus-bpe was trained on the bundled
# corpus with `fivefold prepare <corpus/*.txt> -o corpus.bin --train-tokenizer 2048`
# (training is deterministic: the same file comes out each time). At 2.8 bytes a token the
# default model sees 2.8x more text per step than with bytes, and every piece it samples is
# a piece of a word that occurs in the corpus.
BUILTIN = {"corpus-bpe": Path(__file__).parent / "corpus" / "bpe-2048.json"}
# End-of-text names, in the order they are looked for in a tokenizer.json. A tokenizer we
# train ourselves uses the first.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class ByteTokenizer:
    kind = "byte"
    path = None
    vocab_size = 256
    eos_id = BYTE_EOS_ID

    @property
    def spec(self) -> str:
        return "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a tokenizer.json file."""

    kind = "bpe"

    def __init__(self, path: str | Path, name: str | None = None):
        from tokenizers import Tokenizer

        self.name = name  # a BUILTIN spec name, stored instead of the install's path
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"tokenizer file {self.path} does not exist; give 'byte' or the "
                              f"path of a tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception here
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"tokenizer file {self.path} is not a valid tokenizer.json "
                              f"({first}); give a file saved by Hugging Face tokenizers") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = [self._tok.token_to_id(name) for name in EOS_NAMES]
        eos = [i for i in eos if i is not None]
        special = [i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]
        if not eos and len(special) == 1:  # its only special token ends a text (an export of
            eos = special                  # a byte-level run: models/hf_tokenizer.py)
        if not eos:
            raise ConfigError(f"tokenizer {self.path} has no end-of-text token (looked for "
                              f"{', '.join(EOS_NAMES)}); add one as a special token")
        self.eos_id = eos[0]

    @property
    def spec(self) -> str:
        return self.name or str(self.path)

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS from a post-processor: prepare places the separators itself.
        return gil_free_ids(self._tok, text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


Tokenizer = ByteTokenizer | BPETokenizer


def gil_free_ids(tok, text: str, add_special_tokens: bool) -> list[int]:
    """`tok.encode(text).ids`, through the batch form: it lets go of the GIL while it works
    (encode holds it, so a server's event loop stalls for seconds on a prompt of megabytes),
    and encode_batch_fast (tokenizers >= 0.21) computes no offsets, which also makes freeing
    the result, done under the GIL, cheap. The ids are the same."""
    batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return batch([text], add_special_tokens=add_special_tokens)[0].ids


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """'byte', a BUILTIN name, or the path of a tokenizer.json. Raises ConfigError otherwise."""
    if str(spec) == "byte":
        return ByteTokenizer()
    if str(spec) in BUILTIN:
        return BPETokenizer(BUILTIN[str(spec)], name=str(spec))
    return BPETokenizer(spec)


HF_TOKENIZER_HELP = ("with --hf: the tokenizer the model was trained with, when the directory "
                  "has no tokenizer.json: byte, corpus-bpe or a tokenizer.json file")


def hf_tokenizer_spec(directory: str | Path, option: str | None) -> str:
    """The tokenizer of a Hugging Face directory: --tokenizer where given, else the
    directory's tokenizer.json. A directory without one is refused: decoding a BPE model's
    ids as bytes would print garbage with exit 0."""
    directory = Path(directory)
    if option:
        return option
    if (directory / "tokenizer.json").is_file():
        return str(directory / "tokenizer.json")
    raise ConfigError(f"--hf {directory} has no tokenizer.json; give --tokenizer byte, "
                      f"corpus-bpe or the tokenizer.json the model was trained with")


def train_bpe(texts, vocab_size: int, out: str | Path) -> BPETokenizer:
    """Train a byte-level BPE on an iterable of documents, save it as out, and load it.

    Byte-level pre-tokenisation with the full 256-byte initial alphabet means any text,
    including characters unseen in training, encodes and decodes exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = 256 + 1  # the byte alphabet plus the end-of-text token
    if vocab_size < minimum:
        raise ConfigError(f"--train-tokenizer {vocab_size} is too small; a byte-level BPE needs "
                          f"at least {minimum} (256 bytes + end-of-text)")
    if vocab_size > 2**32:
        raise ConfigError(f"--train-tokenizer {vocab_size} does not fit in uint32 token ids")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_NAMES[0]], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return BPETokenizer(out)


def describe(tok: Tokenizer, relative_to: Path | None = None) -> dict:
    """The tokenizer as stored in token-file metadata; a path next to the metadata is relative,
    so a prepared directory can be moved as a whole."""
    path = None
    if getattr(tok, "name", None):  # a shipped tokenizer: its name, valid on any install
        path = tok.name
    elif tok.path is not None:
        path = Path(tok.path).resolve()
        if relative_to is not None and path.parent == relative_to.resolve():
            path = path.name
        path = str(path)
    return {"kind": tok.kind, "path": path, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}

