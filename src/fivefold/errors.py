"""The errors every command turns into one line, and the argument parser that does the same.

They live apart from `config` so that any module (the HF config reader, the loaders, the
trainer) can raise them without importing the configuration schema. This module imports no
torch.
"""

from __future__ import annotations

import argparse


class ConfigError(ValueError):
    """A user-facing configuration problem: one line, naming the key and the fix."""


class RunError(RuntimeError):
    """A run that stopped for a reason it can name in one line (NaN weights, a lost rank).
    The CLI prints the message and exits with `exit_code`."""

    exit_code = 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad or missing argument in one line with exit code 2, like
    every other input error, instead of printing its usage block first (every command's
    parser is one of these)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")
