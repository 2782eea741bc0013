"""A block's fused matmul operands (megajax.parallel.fused) and ZeRO moving them whole
(megajax.parallel.zero): the compute form multiplies as the members do, and the all-gather
of the members' shards is the operand, its gradient's reduce-scatter the members' shards."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from megajax.config import BLOCK_CHOICES, default_config
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import fused, make_mesh, sharding, zero
from megajax.parallel.mesh import DP


def small_model(block: str, mlp: str = "gelu") -> GPT:
  c = default_config()
  c.model.num_layers, c.model.hidden_dim, c.model.num_heads, c.model.num_kv_heads = 2, 16, 4, 2
  c.model.seq_len, c.model.vocab_size, c.model.block, c.model.mlp = 8, 32, block, mlp
  c.model.compute_dtype = "float32"
  return GPT(ModelConfig.from_config(c.model))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("block,mlp", [(b, "gelu") for b in BLOCK_CHOICES] + [("parallel", "swiglu")])
def test_the_compute_form_multiplies_as_its_members_do(block, mlp, groups):
  """Columns: x @ operand is every member's x @ kernel side by side. Rows: the members'
  activations interleaved (fused.interleave) @ the operand is the sum of their products,
  in `groups` row groups as in 1. Every kernel leaves its module; biases and norms stay."""
  model = small_model(block, mlp)
  c = model.config
  layer = init_params(model, jax.random.key(0))["layer_0"]
  operands = fused.operands(c)
  form = fused.to_compute_form(layer, c, groups={name: groups for name in operands})
  paths = {tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(form)[0]}
  assert not any(path[-1] == "kernel" for path in paths) and set(operands) <= {path[0] for path in paths}
  assert jax.tree.leaves(layer["attention"]["query"]["bias"]) == jax.tree.leaves(form["attention"]["query"]["bias"])
  x = jax.random.normal(jax.random.key(1), (2, 3, c.hidden_dim))
  for name, operand in operands.items():
    kernels = fused.kernels(layer, operand)
    if operand.rows:
      parts = [jax.random.normal(jax.random.key(i), (2, 3, k.size // k.shape[-1])) for i, k in enumerate(kernels)]
      got = fused.interleave(parts, groups) @ form[name].reshape(-1, c.hidden_dim)
      want = sum(p @ k.reshape(-1, c.hidden_dim) for p, k in zip(parts, kernels))
    else:
      got = x @ form[name]
      want = jnp.concatenate([x @ k.reshape(c.hidden_dim, -1) for k in kernels], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert fused.member_widths(operand, c, 1) == [k.size // (k.shape[-1] if operand.rows else k.shape[0])
                                                   for k in kernels]


def test_zero_gathers_each_operand_whole_and_scatters_its_gradient_back():
  """dp2 x tp2, the parallel block: gather_params(model=...) returns each layer's operands as
  one all-gather each, equal to the members gathered one by one and fused (the rows operand
  in dp groups); reduce_scatter_grads of compute-form gradients gives every member the shard
  a per-leaf reduce-scatter of its own gradient gives."""
  model = small_model("parallel")
  c = model.config
  config = default_config()
  config.parallel.dp, config.parallel.tp = 2, 2
  mesh = make_mesh(config.parallel, jax.devices()[:4])
  params = init_params(model, jax.random.key(0))
  layouts = sharding.param_layouts(model, params, 2, 2)
  specs = sharding.param_specs(layouts, params)
  operands = fused.operands(c)
  assert all(layouts["layer_0"][m][l]["kernel"].dp_dim == 0 for op in operands.values() for m, l in op.members)

  def body(shards):
    whole = zero.gather_params(shards, layouts, model=c)
    by_leaf = zero.gather_params(shards, layouts)
    want = {name: fused.to_compute_form(by_leaf[name], c, groups={"w_out": 2})
            for name in by_leaf if name.startswith("layer_")}
    errors = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), {n: whole[n] for n in want}, want)
    # Gradients: the same per-device values in both forms (distinct per device: dp rank + 1).
    scale = (jax.lax.axis_index(DP) + 1).astype(jnp.float32)
    grads = jax.tree.map(lambda x: x * scale, whole)
    leaf_grads = jax.tree.map(lambda x: x * scale, by_leaf)
    got = zero.reduce_scatter_grads(grads, layouts, shards=shards, model=c)
    ref = zero.reduce_scatter_grads(leaf_grads, layouts)
    scatter_errors = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), got, ref)
    return jax.tree.map(lambda e: jax.lax.pmax(e, ("dp", "pp", "tp")), (errors, scatter_errors))

  mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P()))
  errors, scatter_errors = mapped(params)
  assert max(jax.tree.leaves(errors)) == 0 and max(jax.tree.leaves(scatter_errors)) == 0
  # One all-gather returns each operand: w_in [hidden 16, q 8 + k 4 + v 4 + wi 32 columns of
  # this tp rank], w_out [2 dp groups, (out 8 + wo 32 rows) / 2, hidden 16].
  gathered = [line.split("=", 1)[1].split(" all-gather(")[0].strip()
              for line in mapped.lower(params).compile().as_text().splitlines() if " all-gather(" in line]
  assert gathered.count("f32[16,48]{1,0}") == gathered.count("f32[2,20,16]{2,1,0}") == c.num_layers, gathered
