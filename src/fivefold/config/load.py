"""From TOML and `--section.key value` to a Config: type coercion with one-line errors."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from pathlib import Path

from fivefold.config.parallel import offload_value
from fivefold.config.rules import suggest
from fivefold.config.schema import SECTIONS, Config, given_keys
from fivefold.config.validate import validate
from fivefold.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def coerce(key: str, value, typ):
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    if isinstance(typ, str):
        typ = eval(typ, {"dict": dict, "float": float, "int": int, "str": str, "bool": bool,
                         "None": type(None), "list": list})
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or value == "none":
            return None
        typ = args[0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key} = {value!r} is not a boolean; use true or false")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not an integer; give a whole number")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} = {value!r} is not an integer; give a whole number") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not a number; give a number such as 3e-4")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{key} = {value!r} is not a number; give a number such as 3e-4") from None
        if not math.isfinite(number):  # nan passes every `<` check, inf overflows later
            raise ConfigError(f"{key} = {value!r} is not a finite number; give e.g. 3e-4")
        return number
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not a string; quote it")
        return str(value)
    if typ is list:  # a list of whole numbers: a TOML array, or "3,4,4,3" on the command line
        items = value.replace(" ", "").strip("[]").split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{key} = {value!r} is not a list; write e.g. [3, 4, 4, 3]")
        return [coerce(key, v, int) for v in items if v != ""]
    if typ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} is not a table")
        return value
    return value


def _model_override(key: str, value):
    from fivefold.models.presets import MODEL_FIELDS

    if key not in MODEL_FIELDS or key == "name":
        allowed = ["preset", "hf_path", "init_from", *MODEL_FIELDS]
        raise ConfigError(f"unknown key model.{key}{suggest(key, allowed)}; "
                          f"model takes preset, hf_path, init_from or a model field")
    return coerce(f"model.{key}", value, MODEL_FIELDS[key].type)


def set_value(cfg: Config, dotted: str, value) -> None:
    """Set `section.key` on cfg from a TOML or command-line value, with type checks."""
    if "." not in dotted:
        raise ConfigError(f"override '{dotted}' needs the form --section.key value; "
                          f"sections: {', '.join(SECTIONS)}")
    section, key = dotted.split(".", 1)
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}'{suggest(section, SECTIONS)}; "
                          f"sections: {', '.join(SECTIONS)}")
    obj = getattr(cfg, section)
    if section == "model" and key not in ("preset", "hf_path", "init_from"):
        obj.overrides[key] = _model_override(key, value)
        return
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields or key == "overrides":
        names = [n for n in fields if n != "overrides"]
        raise ConfigError(f"unknown key {section}.{key}{suggest(key, names)}; "
                          f"{section} takes: {', '.join(names)}")
    if dotted == "parallel.offload":  # a tier name that also takes its old booleans
        value = offload_value(value)
    if dotted == "train.compile":  # auto, or its old booleans
        from fivefold.config.train import compile_value

        value = compile_value(value)
    setattr(obj, key, coerce(dotted, value, fields[key].type))
    given_keys(cfg).add(dotted)



def from_dict(data: dict, cfg: Config | None = None) -> Config:
    cfg = cfg or Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]{suggest(section, SECTIONS)}; "
                              f"sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}' must be a [section] table, not a value")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value)
    return cfg


def read(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """A TOML file (optional) with `--section.key value` overrides applied, each value type
    checked, but not validated as a whole (the planner reads configs it may not launch)."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise ConfigError(f"config file {p} {what}; give the path of a .toml file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML ({e}); fix the syntax") from None
        from_dict(data, cfg)
    apply_overrides(cfg, overrides or [])
    return cfg


def load(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (optional), apply `--section.key value` overrides, validate."""
    cfg = read(path, overrides)
    cap_steps(cfg)
    validate(cfg)
    return cfg


def run_name_overrides(name: str) -> list[str]:
    """`fivefold train --run-name NAME`: the run's directories under runs/NAME, as overrides
    that the user's own --log.dir and --checkpoint.dir (given after them) still replace."""
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"--run-name {name!r} is not a run name; give a plain name such as "
                          f"fp8-test (it becomes runs/NAME)")
    return ["--log.dir", f"runs/{name}", "--checkpoint.dir", f"runs/{name}/checkpoints"]


STEPS_CAP_ENV = "FIVEFOLD_MAX_STEPS"


def cap_steps(cfg: Config) -> None:
    """Shorten train.steps to $FIVEFOLD_MAX_STEPS when it is set: the docs test runs every
    documented command as written, and a smoke run of a command needs its path taken, not its
    450 steps. Said in one line, so a capped run is never mistaken for the real one."""
    cap = os.environ.get(STEPS_CAP_ENV)
    if not cap:
        return
    if not cap.isdigit() or int(cap) < 1:
        raise ConfigError(f"{STEPS_CAP_ENV} = {cap!r} is not a positive whole number; "
                          f"unset it or give e.g. 20")
    if cfg.train.steps > int(cap):
        print(f"note: {STEPS_CAP_ENV} = {cap} shortens train.steps from {cfg.train.steps}",
              file=sys.stderr)
        cfg.train.steps = int(cap)


def check_options(args: list[str], parser) -> None:
    """The arguments a command's parser left over are --section.key overrides: one without a
    dot is an option the parser does not know (`--overwite`), named with the closest one,
    not taken for an override that lacks its value."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name.startswith("--") and "." not in name:
            raise ConfigError(f"unknown option {name}{suggest(name, options)}; options: "
                              f"{', '.join(options)}, or --section.key VALUE")
        i += 1 if "=" in args[i] or not name.startswith("--") else 2


def apply_overrides(cfg: Config, args: list[str]) -> None:
    """Apply ['--train.lr', '1e-3', '--parallel.dp=2', ...] to cfg."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --train.lr 1e-3")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value; write {arg} VALUE")
            key, value = arg[2:], args[i + 1]
            i += 2
        set_value(cfg, key, value)
