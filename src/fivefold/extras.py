"""Optional dependencies: a missing one is one line naming the pip extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from fivefold.config import ConfigError


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import `module`, or raise a ConfigError saying `pip install 'fivefold[extra]'`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise ConfigError(f"{purpose} needs the {top} package, which is not installed: "
                          f"pip install 'fivefold[{extra}]'") from None
