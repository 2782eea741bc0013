"""A run's config resolved once: the checked ConfigDict as frozen, typed sections.

The ConfigDict is the file and flag format (megajax.config); `RunConfig.resolve` checks it and
turns it into the sections of megajax.sections, the model into its resolved
megajax.model.ModelConfig (widths filled in, dtypes), once, where a run starts (the trainer,
the tools). The layers below take the section they need (`run.parallel`, `run.data`, ...),
never the whole dict; the values derived from several fields are the sections' properties
(`run.parallel.mesh_shape`, `run.data.packs_documents`, `run.observe.wants_probes`).
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from megajax.config import validate
from megajax.model import ModelConfig
from megajax.sections import (SECTION_TYPES, CheckpointSection, DataSection, DebugSection, ObserveSection,
                              OptimizerSection, ParallelSection, RuntimeSection, SupervisorSection, TrainSection,
                              from_config_dict)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig
  train: TrainSection
  optimizer: OptimizerSection
  parallel: ParallelSection
  data: DataSection
  checkpoint: CheckpointSection
  runtime: RuntimeSection
  supervisor: SupervisorSection
  observe: ObserveSection
  debug: DebugSection
  # The config as its file and flags gave it (JSON): what config.json, a checkpoint's metadata
  # and the trackers record, and what a resumed run is compared with.
  json: str

  @classmethod
  def resolve(cls, config: ml_collections.ConfigDict, check: bool = True) -> "RunConfig":
    """The run of `config`, checked first (megajax.config.validate: a ConfigError names the
    field); check=False for a config checked already, or read back from a run (whose data files
    a reader of its checkpoints does not need)."""
    if check:
      validate(config)
    sections = {name: from_config_dict(section_type, config[name]) for name, section_type in SECTION_TYPES.items()}
    sections["model"] = ModelConfig.from_config(sections["model"])
    return cls(**sections, json=config.to_json(indent=2))

  @classmethod
  def of(cls, config: "ml_collections.ConfigDict | RunConfig") -> "RunConfig":
    """`config` as it is when it is a RunConfig already, else resolved unchecked (the library's
    constructors take either; the trainer and the tools check the file once, where they read it)."""
    return config if isinstance(config, RunConfig) else cls.resolve(config, check=False)

  @property
  def record(self) -> dict:
    """The config as plain JSON values, {"model": {...}, ...}."""
    return json.loads(self.json)
