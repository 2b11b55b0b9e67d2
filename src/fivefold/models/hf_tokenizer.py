"""The tokenizer files of an exported model, as transformers' AutoTokenizer reads them.

`fivefold convert --checkpoint C --to-hf OUT` writes beside config.json and the weights:

    tokenizer.json           the run's tokenizer (the bundled `corpus-bpe` resolved to its
                             file), or for a byte-level run a byte-level BPE without merges
                             whose id of every byte is the byte's value
    tokenizer_config.json    the tokenizer class, bos/eos/pad tokens, model_max_length
                             (the model's max_seq_len), no special tokens added on encode
    special_tokens_map.json  the same bos/eos/pad
    generation_config.json   bos/eos/pad token ids, for transformers' generate

fivefold models are trained on documents separated by the end-of-text token and have no
separate beginning-of-text token, so bos, eos and pad are all that token (GPT-2's layout):
lm-eval's HFLM then starts a scored text with it, as fivefold's own lm-eval model does
(evaluate/lm.py), and `generate` stops on it. A model made from a Hugging Face directory
whose tokenizer the run used keeps that directory's files instead (its chat template too).

Byte-level runs: token b is byte b, and byte 0 (NUL) is the end-of-text separator
(data/tokenizer.py). GPT-2's byte-to-character map shows byte 0 as "Ā" (U+0100), which is
therefore the eos token's text; the one difference from fivefold's byte tokenizer is that a
literal "Ā" in a prompt encodes to the separator instead of its two UTF-8 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (openai/gpt-2
    src/encoder.py, the map Hugging Face tokenizers' ByteLevel pre-tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


def byte_tokenizer_json(path: Path) -> str:
    """Write a tokenizers file equal to ByteTokenizer on text (ids = UTF-8 bytes); returns
    the end-of-text token's text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = chars[ByteTokenizer.eos_id]  # already in the vocabulary: it keeps id 0
    tok.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    tok.save(str(path))
    return eos


def write_tokenizer_files(spec, max_seq_len: int, outdir: Path) -> dict:
    """Write the four files into `outdir` for the tokenizer `spec` (a run's tokenizer as
    checkpoints record it: 'byte', a shipped name, a path, or token-file metadata); returns
    the token ids config.json should carry."""
    if isinstance(spec, dict):
        spec = spec.get("path") or "byte"
    tok = load_tokenizer(spec)
    if isinstance(tok, BPETokenizer):
        (outdir / "tokenizer.json").write_bytes(Path(tok.path).read_bytes())
        eos_text = tok._tok.id_to_token(tok.eos_id)
    else:
        eos_text = byte_tokenizer_json(outdir / "tokenizer.json")
    specials = {"bos_token": eos_text, "eos_token": eos_text, "pad_token": eos_text}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
              "model_max_length": max_seq_len, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    ids = {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id}
    for name, content in zip(CONFIG_FILES, (config, specials, ids)):
        (outdir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return ids


def base_tokenizer_dir(spec, hf_path: str) -> Path | None:
    """The run's model.hf_path when the run used that directory's own tokenizer.json (its
    files, chat template included, then travel with the export); else None."""
    if not hf_path:
        return None
    base = Path(hf_path) / "tokenizer.json"
    if isinstance(spec, dict):
        spec = spec.get("path") or "byte"
    try:
        tok = load_tokenizer(spec)
    except Exception:  # noqa: BLE001 - a spec that no longer loads is write_tokenizer_files'
        return None
    if base.is_file() and tok.path is not None and Path(tok.path).read_bytes() == \
            base.read_bytes():
        return base.parent
    return None
