"""fivefold: plan and run LLM training with data, tensor, pipeline, context and expert
parallelism.

The library API (fivefold/api.py): `fivefold.Config`, `fivefold.Trainer`, `fivefold.train`.
They are imported on first use, so `import fivefold` (and the planner) stays light.
"""

__version__ = "0.1.0"

__all__ = ["Config", "Trainer", "make_config", "train"]


def __getattr__(name: str):
    if name == "Config":
        from fivefold.config import Config

        return Config
    if name in ("Trainer", "make_config"):
        from fivefold import api

        return getattr(api, name)
    if name == "train":  # the subpackage, callable as the training loop (train/__init__.py)
        import importlib

        return importlib.import_module("fivefold.train")
    raise AttributeError(f"module 'fivefold' has no attribute {name!r}")
