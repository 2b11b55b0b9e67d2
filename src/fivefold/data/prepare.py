"""`fivefold prepare`: text, jsonl or parquet files → one flat token file + a JSON of metadata.

    fivefold prepare books/ notes.jsonl -o data/tokens.bin                   # byte-level
    fivefold prepare web.parquet -o data/tokens.bin --train-tokenizer 8192  # train a BPE
    fivefold prepare web.jsonl -o data/tokens.bin --tokenizer tokenizer.json

Documents: a .txt file is one document; each row of a .jsonl/.json/.parquet file is one
(its `--text-field`, read with Hugging Face `datasets`); a directory stands for the
supported files under it, sorted, less the files `prepare` itself writes. Every non-empty
document is followed by the tokenizer's end-of-text id, so the stream reads
doc₀ EOS doc₁ EOS … docₙ EOS and the loader's windows cross document ends the way
pre-training data usually does.

Files written, each atomically (a temporary name, then a rename):
- OUT, the tokens: a flat array of uint16 when the vocabulary fits 2¹⁶ ids, else uint32,
  read back with np.memmap;
- OUT.json, the metadata (see `write_tokens`): tokenizer, vocab size, dtype, token count,
  byte size and sha256 of OUT, documents, EOS id and the source files;
- OUT's stem + .tokenizer.json, with --train-tokenizer: the BPE trained on these inputs.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fivefold.config import ArgumentParser, ConfigError, writable_file
from fivefold.data.tokenizer import describe, load_tokenizer, train_bpe

FORMAT = "fivefold-tokens"
VERSION = 1
SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
ENCODE_BATCH = 256  # documents per tokenizer call: big enough for the Rust side to parallelise


def meta_path(tokens_path: str | Path) -> Path:
    """Where the metadata of a token file lives: tokens.bin → tokens.bin.json."""
    p = Path(tokens_path)
    return p.with_name(p.name + ".json")


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def expand_inputs(inputs: list[str]) -> list[Path]:
    """The input files in order; a directory contributes its supported files, sorted."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*")
                           if f.is_file() and f.suffix in SUFFIXES and not _is_output(f))
            if not found:
                raise ConfigError(f"input directory {p} holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif not p.is_file():
            raise ConfigError(f"input {p} does not exist; give text, jsonl or parquet files")
        elif p.suffix not in SUFFIXES:
            raise ConfigError(f"input {p} has suffix '{p.suffix}'; supported: "
                              f"{', '.join(SUFFIXES)}")
        else:
            files.append(p)
    if not files:
        raise ConfigError("no input files given; name text, jsonl or parquet files")
    return files


def _is_output(path: Path) -> bool:
    """A file `prepare` wrote (token metadata or a trained tokenizer), not an input: a
    directory is often both the inputs' and the outputs' home."""
    return path.name.endswith(".tokenizer.json") or (
        path.suffix == ".json" and path.with_name(path.name[: -len(".json")]).is_file())


# Bytes of each text input that were not UTF-8 and became U+FFFD, by path: `prepare` says
# how many rather than changing a file's text without a word.
REPLACED: dict[str, int] = {}


def _count_replaced(error: UnicodeDecodeError) -> tuple[str, int]:
    REPLACED[_decoding] = REPLACED.get(_decoding, 0) + error.end - error.start
    return "\ufffd", error.end


codecs.register_error("fivefold-count", _count_replaced)
_decoding = ""


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file, in file order."""
    global _decoding
    if SUFFIXES[path.suffix] == "text":
        _decoding = str(path)
        REPLACED.pop(_decoding, None)  # a second pass (tokenizer training) counts afresh
        yield path.read_bytes().decode("utf-8", errors="fivefold-count")
        return
    from fivefold.extras import require

    # lazily: only jsonl/parquet need it, and it is slow to import
    datasets = require("datasets", "data", f"reading {path.suffix} files")

    datasets.disable_progress_bars()
    # A private cache directory: the Arrow copy is thrown away instead of piling up in ~/.cache.
    with tempfile.TemporaryDirectory(prefix="fivefold-prepare-") as cache:
        try:
            table = datasets.load_dataset(SUFFIXES[path.suffix], data_files=str(path),
                                          split="train", cache_dir=cache)
        except (datasets.exceptions.DatasetsError, ValueError, OSError) as e:
            # DatasetGenerationError for a bad json line, ArrowInvalid (a ValueError) for parquet
            raise ConfigError(f"cannot read {path} as {SUFFIXES[path.suffix]} "
                              f"({type(e).__name__}); check the file's format") from None
        if text_field not in table.column_names:
            raise ConfigError(f"{path} has no field '{text_field}' (fields: "
                              f"{', '.join(table.column_names)}); pass --text-field NAME")
        for batch in table.select_columns([text_field]).iter(batch_size=1024):
            for text in batch[text_field]:
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise ConfigError(f"{path}: field '{text_field}' holds {type(text).__name__}, "
                                      f"not text; pass --text-field with a text column")
                yield text


def _encoded(tok, docs: Iterator[str], dtype: str) -> Iterator[np.ndarray]:
    """Each non-empty document's tokens followed by EOS, as arrays of dtype."""
    eos = np.array([tok.eos_id], dtype=dtype)
    if tok.kind == "byte":
        for text in docs:
            raw = text.replace("\x00", "").encode("utf-8")  # NUL is the separator
            if raw:
                yield np.concatenate([np.frombuffer(raw, dtype=np.uint8).astype(dtype), eos])
        return
    batch: list[str] = []
    for text in docs:
        if text:
            batch.append(text)
        if len(batch) == ENCODE_BATCH:
            yield from _encode_batch(tok, batch, dtype, eos)
            batch = []
    yield from _encode_batch(tok, batch, dtype, eos)


def _encode_batch(tok, texts: list[str], dtype: str, eos: np.ndarray) -> Iterator[np.ndarray]:
    for ids in tok.encode_batch(texts) if texts else []:
        if ids:
            yield np.concatenate([np.asarray(ids, dtype=dtype), eos])


def _atomic_write(path: Path, write) -> None:
    """Call write(file) on a temporary file beside path, then rename it over path: readers
    (other ranks starting at the same time) see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_tokens(files: list[Path], out: Path, tok, text_field: str = "text") -> dict:
    """Tokenise files into out and write out.json; return the metadata."""
    dtype = dtype_for_vocab(tok.vocab_size)
    sources, totals = [], {"tokens": 0, "max": -1}
    digest = hashlib.sha256()

    def write(f):
        for path in files:
            source = {"path": str(path.resolve()), "documents": 0, "tokens": 0}
            for arr in _encoded(tok, read_documents(path, text_field), dtype):
                f.write(arr.tobytes())
                digest.update(arr.tobytes())
                source["documents"] += 1
                source["tokens"] += len(arr)
                totals["max"] = max(totals["max"], int(arr.max()))
            sources.append(source)
            totals["tokens"] += source["tokens"]

    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out, write)
    num_documents = sum(s["documents"] for s in sources)
    if num_documents == 0:
        out.unlink()
        raise ConfigError(f"inputs {', '.join(map(str, files))} hold no text; give files with "
                          f"text in them (or the right --text-field)")
    meta = {
        "format": FORMAT, "version": VERSION, "tokens_file": out.name,
        "dtype": dtype, "num_tokens": totals["tokens"],
        "num_bytes": totals["tokens"] * np.dtype(dtype).itemsize, "sha256": digest.hexdigest(),
        "max_token": totals["max"], "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
        "num_documents": num_documents, "separator": "eos_id after every document",
        "tokenizer": describe(tok, relative_to=out.parent), "text_field": text_field,
        "sources": sources,
    }
    text = (json.dumps(meta, indent=2) + "\n").encode()
    _atomic_write(meta_path(out), lambda f: f.write(text))
    return meta


def prepare(inputs: list[str], out: str, tokenizer: str = "byte",
            train_tokenizer: int | None = None, text_field: str = "text",
            overwrite: bool = False) -> dict:
    """Tokenise inputs into the token file out (+ out.json); return the metadata.

    tokenizer: "byte" or a tokenizer.json path. train_tokenizer: a vocabulary size; trains a
    byte-level BPE on the inputs first and saves it next to out as <stem>.tokenizer.json.
    """
    out_path = Path(out)
    if out_path.suffix == ".json":
        raise ConfigError(f"output {out} ends in .json, the metadata's suffix; name the token "
                          f"file e.g. tokens.bin")
    if out_path.is_dir():
        raise ConfigError(f"output {out} is a directory; give a file name such as {out}/tokens.bin")
    writable_file("-o/--out", out)
    written = [out_path, meta_path(out_path)]
    if train_tokenizer is not None:
        written.append(out_path.with_suffix(".tokenizer.json"))
    existing = [str(f) for f in written if f.exists()]
    if existing and not overwrite:
        raise ConfigError(f"{existing[0]} already exists; pass --overwrite to replace it, or "
                          f"give another -o/--out")
    files = expand_inputs(inputs)
    REPLACED.clear()
    if train_tokenizer is not None:
        if tokenizer != "byte":
            raise ConfigError("give either --tokenizer FILE or --train-tokenizer VOCAB, not both")
        docs = (d for f in files for d in read_documents(f, text_field) if d)
        tok = train_bpe(docs, train_tokenizer, out_path.with_suffix(".tokenizer.json"))
    else:
        tok = load_tokenizer(tokenizer)
    return write_tokens(files, out_path, tok, text_field)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="fivefold prepare",
        description="Tokenise text, jsonl or parquet files into one token file for training.")
    parser.add_argument("inputs", nargs="+", help=".txt, .jsonl, .json, .parquet files or dirs")
    parser.add_argument("-o", "--out", required=True,
                        help="token file to write, e.g. data/tokens.bin (+ data/tokens.bin.json)")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' (vocabulary 256, NUL between documents) or a tokenizer.json")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                        help="train a byte-level BPE of this vocabulary size on the inputs")
    parser.add_argument("--text-field", default="text", help="text column of jsonl/parquet rows")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing token file (and tokenizer) of the same name")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error, or the help
        return int(e.code or 0)
    try:
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer,
                       train_tokenizer=args.train_tokenizer, text_field=args.text_field,
                       overwrite=args.overwrite)
    except ConfigError as e:
        print(f"fivefold prepare: error: {e}", file=sys.stderr)
        return 2
    tok = meta["tokenizer"]
    for path, count in REPLACED.items():
        print(f"note: {path}: {count:,} bytes are not valid UTF-8 and were replaced by "
              f"U+FFFD (the replacement character) in the tokens")
    print(f"wrote {meta['num_tokens']:,} {meta['dtype']} tokens from {meta['num_documents']:,} "
          f"documents to {args.out} (tokenizer {tok['path'] or tok['kind']}, vocab "
          f"{meta['vocab_size']}, eos {meta['eos_id']}); metadata in {meta_path(args.out)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
