"""The pipeline's parameter layout: the blocks stacked into one `layers` tree, split over pp.

The layers are cut into p * v chunks of k layers; stage s holds chunks s, s+p, ... (local
chunk c is global chunk c*p + s). In the training state each block parameter is one leaf
with a leading axis of L rows split over pp, stage s holding rows s*v*k .. (s+1)*v*k - 1
(`stacked_layer_order`); the embedding, final norm and head stay as in the model's pytree.
`to_model_params` gives the model's pytree back (exports, checkpoints across layouts).
Inside the step the chunks read the stacked rows in their compute form (compute_rows, made
once a step: megajax.parallel.fused), their gradients taken back by parameter_rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megajax.model import ModelConfig
from megajax.parallel import fused, sharding

LAYERS = "layers"   # the stacked blocks' subtree in the pipeline layout


def stacked_layer_order(num_layers: int, stages: int, virtual_stages: int) -> list[int]:
  """The model layer at each row of the stacked leaves: row s*v*k + c*k + j (stage s, local
  chunk c, layer j of the chunk) holds layer (c*p + s)*k + j."""
  p, v = stages, virtual_stages
  if num_layers % (p * v):
    raise ValueError(f"{num_layers} layers do not cut into pp * virtual_stages = {p * v} equal chunks "
                     "(model.num_layers must be a multiple of it)")
  k = num_layers // (p * v)
  return [(c * p + s) * k + j for s in range(p) for c in range(v) for j in range(k)]


def to_pipeline_params(params: dict, stages: int, virtual_stages: int) -> dict:
  """The model's pytree (layer_0, layer_1, ...) -> the pipeline layout (one stacked `layers`)."""
  names = [name for name in params if name.startswith("layer_")]
  order = stacked_layer_order(len(names), stages, virtual_stages)
  layers = jax.tree.map(lambda *rows: jnp.stack(rows), *[params[f"layer_{i}"] for i in order])
  return {**{k: v for k, v in params.items() if k not in names}, LAYERS: layers}


def to_model_params(params: dict, stages: int, virtual_stages: int) -> dict:
  """The pipeline layout -> the model's pytree (for export, checkpoints, comparisons)."""
  rows = jax.tree.leaves(params[LAYERS])[0].shape[0]
  model = {k: v for k, v in params.items() if k != LAYERS}
  for row, layer in enumerate(stacked_layer_order(rows, stages, virtual_stages)):
    model[f"layer_{layer}"] = jax.tree.map(lambda x, row=row: x[row], params[LAYERS])
  return model


def pipeline_layouts(layouts: dict) -> dict:
  """The model's per-parameter layouts -> the pipeline layout's (stacked blocks split over pp)."""
  rest = {k: v for k, v in layouts.items() if not k.startswith("layer_")}
  return {**rest, LAYERS: sharding.stacked_layouts(layouts["layer_0"])}


def compute_rows(layers: dict, c: ModelConfig) -> dict:
  """Stacked layers [L, ...] -> every row's compute form, stacked (fused.to_compute_form, each
  operand [L, ...]): what a chunk's blocks read, made once a step instead of per microbatch."""
  return jax.vmap(lambda layer: fused.to_compute_form(layer, c))(layers)


def parameter_rows(form: dict, like: dict, c: ModelConfig) -> dict:
  """compute_rows' transpose: stacked compute-form rows (gradients w.r.t. them) -> the stacked
  layers', shaped like the rows of `like` (the stacked layers or their shapes)."""
  row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), like)
  return jax.vmap(lambda rows: fused.from_compute_form(rows, row, c))(form)
