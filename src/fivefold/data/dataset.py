"""A prepared token file, memory-mapped and checked once on open; and the bundled corpus.

Every way a token file can be wrong (missing, metadata missing or garbled, a size or dtype
that disagrees with the metadata, ids outside the vocabulary) raises ConfigError with one
line naming the file and the fix, before any process group or model exists.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from fivefold.config import ConfigError
from fivefold.data.prepare import FORMAT, VERSION, meta_path, prepare
from fivefold.data.tokenizer import BUILTIN, load_tokenizer

CORPUS_DIR = Path(__file__).parent / "corpus"
SCAN_CHUNK = 1 << 24  # tokens read at a time when checking ids: bounded memory on big files
REPREPARE = "re-run `fivefold prepare`"
_REQUIRED = {"format": str, "version": int, "dtype": str, "num_tokens": int, "vocab_size": int,
             "eos_id": int, "tokenizer": dict}


class TokenDataset:
    """The token stream of one prepared file: `tokens` is a read-only np.memmap."""

    def __init__(self, path: Path, meta: dict, tokens: np.ndarray):
        self.path, self.meta, self.tokens = path, meta, tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary: the trainer checks it fits model.vocab_size."""
        return self.meta["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self.meta["eos_id"]

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def num_documents(self) -> int | None:
        return self.meta.get("num_documents")

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def tokenizer_spec(self) -> str:
        """'byte', a shipped tokenizer's name, or the tokenizer.json path, resolved against
        the metadata's directory."""
        tok = self.meta["tokenizer"]
        if tok.get("kind") == "byte" or not tok.get("path"):
            return "byte"
        if tok["path"] in BUILTIN:
            return tok["path"]
        return str(self.path.parent / tok["path"])  # an absolute path stays absolute

    def load_tokenizer(self):
        return load_tokenizer(self.tokenizer_spec)

    @classmethod
    def open(cls, path: str | os.PathLike, checksum: bool = False) -> TokenDataset:
        """Open and check a token file (or its .json metadata). checksum=True also compares
        the sha256 of the whole file; the id range is always checked."""
        path = Path(path)
        if path.suffix == ".json":  # the metadata was named: open its token file
            path = path.with_name(path.name[: -len(".json")])
        if not path.is_file():
            raise ConfigError(f"token file {path} does not exist; run `fivefold prepare` to make "
                              f"it, or leave data.path empty for the bundled corpus")
        meta = _read_meta(path)
        dtype = np.dtype(meta["dtype"])
        expected = meta["num_tokens"] * dtype.itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise ConfigError(f"token file {path} has {actual} bytes but its metadata says "
                              f"{meta['num_tokens']} {dtype.name} tokens ({expected} bytes); "
                              f"the file is truncated or from another run: {REPREPARE}")
        if checksum and meta.get("sha256") and _sha256(path) != meta["sha256"]:
            raise ConfigError(f"token file {path} does not match the sha256 in its metadata; "
                              f"it changed after preparing: {REPREPARE}")
        tokens = (np.memmap(path, dtype=dtype, mode="r") if meta["num_tokens"]
                  else np.zeros(0, dtype=dtype))  # mmap cannot map an empty file
        _check_ids(path, tokens, meta["vocab_size"])
        return cls(path, meta, tokens)


def _read_meta(path: Path) -> dict:
    mp = meta_path(path)
    if not mp.is_file() and path.is_file() and path.stat().st_size == 0:
        raise ConfigError(f"token file {path} is empty (0 bytes): it holds no tokens; "
                          f"{REPREPARE} from text")
    if not mp.is_file():
        raise ConfigError(f"token file {path} has no metadata file {mp}; {REPREPARE} to write "
                          f"both")
    try:
        meta = json.loads(mp.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"metadata {mp} is garbled ({type(e).__name__}); {REPREPARE}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"metadata {mp} is garbled (not a JSON object); {REPREPARE}")
    for key, typ in _REQUIRED.items():
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise ConfigError(f"metadata {mp} is garbled ('{key}' missing or not "
                              f"{typ.__name__}); {REPREPARE}")
    if meta["format"] != FORMAT or meta["version"] > VERSION:
        raise ConfigError(f"metadata {mp} is format {meta['format']!r} v{meta['version']}, not "
                          f"{FORMAT} v{VERSION}; {REPREPARE} with this fivefold")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise ConfigError(f"metadata {mp}: dtype {meta['dtype']!r} is not uint16 or uint32; "
                          f"{REPREPARE}")
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        raise ConfigError(f"metadata {mp}: vocab_size {meta['vocab_size']} does not fit dtype "
                          f"{meta['dtype']}; {REPREPARE}")
    if meta["num_tokens"] < 0 or meta["vocab_size"] <= 0:
        raise ConfigError(f"metadata {mp} is garbled (negative sizes); {REPREPARE}")
    if not 0 <= meta["eos_id"] < meta["vocab_size"]:
        raise ConfigError(f"metadata {mp}: eos_id {meta['eos_id']} lies outside the vocabulary "
                          f"of {meta['vocab_size']}; {REPREPARE}")
    return meta


def _check_ids(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    for start in range(0, len(tokens), SCAN_CHUNK):
        top = int(tokens[start:start + SCAN_CHUNK].max())
        if top >= vocab_size:
            raise ConfigError(f"token file {path} holds token id {top}, outside its metadata's "
                              f"vocab_size {vocab_size}; file and metadata disagree: {REPREPARE}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def corpus_files() -> list[Path]:
    """The bundled public-domain corpus (see corpus/README.md): one document per file."""
    return sorted(CORPUS_DIR.glob("*.txt"))


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fivefold"


def default_corpus_tokens(tokenizer: str = "byte", cache_dir: str | os.PathLike | None = None
                          ) -> Path:
    """The bundled corpus as a token file, prepared on first use and cached.

    The cache name hashes the corpus and the tokenizer file, so an edited corpus or tokenizer
    gets a new file. Ranks that start together may each prepare it; the writes are atomic
    renames of identical content, so that race is harmless.
    """
    files = corpus_files()
    if not files:
        raise ConfigError(f"the bundled corpus is missing from {CORPUS_DIR}; reinstall fivefold "
                          f"or set data.path to a prepared token file")
    tok = load_tokenizer(tokenizer)
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    digest.update(b"byte" if tok.kind == "byte" else Path(tok.path).read_bytes())
    name = f"corpus-{tok.kind}-{digest.hexdigest()[:16]}.bin"
    out = Path(cache_dir or default_cache_dir()) / name
    if out.is_file() and meta_path(out).is_file():
        try:
            TokenDataset.open(out)
            return out
        except ConfigError:
            pass  # a damaged cache entry: prepare it again below
    prepare([str(f) for f in files], str(out), tokenizer=tokenizer, overwrite=True)
    return out
