"""The typed config sections (megajax.sections): every field stated once, the ConfigDict of
the files and flags built from them, a run's sections resolved once and frozen."""

import dataclasses

import jax.numpy as jnp
import pytest

from megajax.config import default_config
from megajax.sections import SECTION_TYPES, ModelConfig, RunConfig, section


def test_the_config_dict_has_exactly_the_sections_fields_typed_by_their_defaults():
  config = default_config()
  assert set(config) == set(SECTION_TYPES)          # (a ConfigDict lists its keys sorted)
  for name, section_type in SECTION_TYPES.items():
    assert set(config[name]) == {f.name for f in dataclasses.fields(section_type)}, name
  with pytest.raises(TypeError):
    config.train.steps = "ten"                       # typed by its default
  config.parallel.tp_overlap = "xla"                 # an optional field: a placeholder of its type
  with pytest.raises(TypeError):
    config.parallel.tp_overlap = 3


def test_a_run_resolves_once_into_frozen_sections_with_their_derived_values():
  config = default_config()
  config.parallel.dp, config.parallel.tp, config.model.num_kv_heads = 2, 2, 0
  run = RunConfig.of(config)
  assert RunConfig.of(run) is run
  assert run.parallel.mesh_shape == (2, 1, 1, 2) and run.parallel.device_count == 4
  assert run.parallel.tp_overlap_on("cpu") == "none" and run.parallel.tp_overlap_on("cuda") == "collective_matmul"
  assert run.model.num_kv_heads == run.model.num_heads and run.model.window is None
  assert run.model.compute_dtype == jnp.bfloat16 and run.model.mlp_dim == 4 * run.model.hidden_dim
  assert not run.data.packs_documents               # synthetic data has no documents
  assert run.record["parallel"]["dp"] == 2
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.train.steps = 5
  config.parallel.dp = 4                             # the file's dict changes; the run does not
  assert run.parallel.dp == 2 and section(config, "parallel").dp == 4


def test_the_resolved_model_is_its_own_resolution():
  model = RunConfig.of(default_config()).model
  assert ModelConfig.from_config(model) == model and hash(ModelConfig.from_config(model)) == hash(model)
  assert dataclasses.replace(model, window_pattern="LG").num_kv_heads == model.num_kv_heads
