"""The whole configuration: one typed section per TOML table. A new section is a dataclass
in its own module beside its rules, added here as a field and in `validate.py`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fivefold.config.data import DataSection
from fivefold.config.lora import LoraSection
from fivefold.config.model import ModelSection
from fivefold.config.optim import OptimSection
from fivefold.config.output import CheckpointSection, LogSection
from fivefold.config.parallel import ParallelSection
from fivefold.config.train import TrainSection


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    lora: LoraSection = field(default_factory=LoraSection)
    optim: OptimSection = field(default_factory=OptimSection)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = {"preset": self.model.preset, "hf_path": self.model.hf_path,
                        "init_from": self.model.init_from, **self.model.overrides}
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def section_class(name: str) -> type:
    """The dataclass of section `name` (KeyError for an unknown one)."""
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}[name]


def given_keys(cfg: Config) -> set[str]:
    """The `section.key`s a TOML file or an override set (at any value, defaults included):
    under parallel.layout = auto the parallel ones are constraints (plan/auto_layout.py)."""
    given = cfg.__dict__.get("_given")
    if given is None:
        given = cfg.__dict__["_given"] = set()
    return given
