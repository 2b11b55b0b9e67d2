"""Typed configuration: TOML sections, `--section.key value` overrides, validation in one place.

One module per section holds its keys and the rules for them (model.py, parallel.py,
train.py, data.py, output.py); schema.py gathers the sections into `Config`; load.py turns
TOML and command-line overrides into one; validate.py runs every section's rules in one order,
before any process group exists. A bad value raises `ConfigError`, whose message is one line
naming the key, the value and the fix; the CLI prints it and exits with code 2.
This package imports no torch.
"""

from fivefold.config.data import CORPUS_BPE_VOCAB, CORPUS_TOKENIZERS, DataSection, corpus_tokenizer
from fivefold.config.load import (
    apply_overrides,
    check_options,
    coerce,
    from_dict,
    load,
    read,
    run_name_overrides,
    set_value,
)
from fivefold.config.model import ModelSection
from fivefold.config.output import RESUME_MODES, CheckpointSection, LogSection
from fivefold.config.parallel import AUTO_MBS_TOKENS, ParallelSection, resolve_mbs
from fivefold.config.rules import choice, positive, suggest, writable_dir, writable_file
from fivefold.config.schema import SECTIONS, Config, given_keys, section_class
from fivefold.config.train import TrainSection
from fivefold.config.validate import engine_refusal, validate, validate_layout
from fivefold.errors import ArgumentParser, ConfigError, RunError

__all__ = [
    "AUTO_MBS_TOKENS", "CORPUS_BPE_VOCAB", "CORPUS_TOKENIZERS", "RESUME_MODES", "SECTIONS",
    "ArgumentParser", "CheckpointSection", "Config", "ConfigError", "DataSection", "LogSection",
    "ModelSection", "ParallelSection", "RunError", "TrainSection", "apply_overrides",
    "check_options", "choice", "coerce", "corpus_tokenizer", "engine_refusal", "from_dict",
    "given_keys", "load",
    "positive", "read", "resolve_mbs", "run_name_overrides", "section_class", "set_value",
    "suggest", "validate", "validate_layout", "writable_dir", "writable_file",
]
