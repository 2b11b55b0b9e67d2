"""Generation tasks: greedy continuations of prompts, written out and scored against references.

A task file is JSON lines, one `{"prompt": ..., "reference": ...}` object a line (other keys
are kept and written back). Each prompt is encoded with the model's tokenizer and continued
greedily (the argmax at every step, through the model's KV cache: train/generate.py) for at
most `max_new_tokens` tokens or until the end-of-text token, which is not part of the
prediction. The predictions file is the task file with `"prediction"` added to every line,
so `--predictions` can score it again later without a model.

Every line is read and checked, and every prompt encoded and measured against the model's
context, before the first token is generated; a bad line is one error naming its number.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from fivefold.config import ConfigError


def read_jsonl(path: str | Path, required: tuple[str, ...]) -> list[dict]:
    """The objects of a JSON-lines file, each checked to hold `required` string fields and
    given its line number as `_line` (never written back). Blank lines are skipped; line
    numbers count from 1, as an editor shows them."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; give a JSON-lines file")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {number} is not JSON ({e.msg}); write one "
                                  f"JSON object a line") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path} line {number} is not a JSON object; write "
                                  f"{{{', '.join(repr(k) for k in required)}}} a line")
            for key in required:
                if key not in record:
                    raise ConfigError(f"{path} line {number} has no \"{key}\"; every line "
                                      f"needs {', '.join(repr(k) for k in required)}")
                if not isinstance(record[key], str):
                    raise ConfigError(f"{path} line {number}: \"{key}\" is "
                                      f"{type(record[key]).__name__}, not a string")
            records.append({**record, "_line": number})
    if not records:
        raise ConfigError(f"{path} holds no lines to evaluate")
    return records


def encode_prompts(tasks: list[dict], encode: Callable[[str], list[int]], max_new_tokens: int,
                   max_seq_len: int, path: str | Path) -> list[list[int]]:
    """Each task's prompt tokens, checked to leave room for `max_new_tokens`."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    prompts = []
    for task in tasks:
        ids = encode(task["prompt"])
        if not ids:
            raise ConfigError(f"{path}: the prompt of line {task['_line']} encodes to no "
                              f"tokens; give a non-empty prompt")
        if len(ids) + max_new_tokens > max_seq_len:
            raise ConfigError(f"{path} line {task['_line']}: prompt of {len(ids)} tokens + "
                              f"--max-new-tokens {max_new_tokens} exceeds the model's "
                              f"max_seq_len = {max_seq_len}; shorten one of them")
        prompts.append(ids)
    return prompts


def greedy_predictions(model, codec, prompts: list[list[int]],
                       max_new_tokens: int) -> list[str]:
    """The decoded greedy continuation of each prompt (the end-of-text token dropped)."""
    from fivefold.train.generate import generate

    eos = getattr(codec, "eos_id", None)
    stop = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    texts = []
    for ids in prompts:
        new = generate(model, ids, max_new_tokens, greedy=True, eos_id=eos)
        if new and new[-1] in stop:
            new = new[:-1]
        texts.append(codec.decode(new))
    return texts


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    """Write atomically (a temporary file beside it, then a rename): a failed or interrupted
    run leaves any earlier file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                clean = {k: v for k, v in record.items() if k != "_line"}
                f.write(json.dumps(clean, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
