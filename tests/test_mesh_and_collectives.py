"""The (dp, pp, tp) mesh builder and the collective matmuls, on 8 CPU devices."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from megajax.config import ConfigError, default_config
from megajax.parallel import TP, all_gather_matmul, local_batch_slice, make_mesh, matmul_reduce_scatter
from megajax.parallel.mesh import _host_split


def mesh_config(dp, pp, tp):
  config = default_config()
  config.parallel.dp, config.parallel.pp, config.parallel.tp = dp, pp, tp
  return config


def test_tp_is_innermost_and_dp_before_pp():
  mesh = make_mesh(mesh_config(2, 2, 2))
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert mesh.axis_names == ("dp", "pp", "tp")
  # Physical order (pp, dp, tp): a tp group is adjacent devices, then dp neighbours, then pp.
  np.testing.assert_array_equal(ids, np.arange(8).reshape(2, 2, 2).transpose(1, 0, 2))
  assert local_batch_slice(mesh, 16) == (0, 1)  # one process holds every row


def test_mesh_size_must_match_the_devices():
  with pytest.raises(ConfigError, match=r"^parallel='dp=2 pp=1 tp=2': the mesh has 4 devices but the job has 8; "
                                        r"choose dp \* pp \* tp = 8"):
    make_mesh(mesh_config(2, 1, 2))
  assert make_mesh(mesh_config(2, 1, 2), jax.devices()[:4]).devices.shape == (2, 1, 2)


@pytest.mark.parametrize("shape,per_host,in_host,across", [
    ((4, 2, 8), 8, (1, 1, 8), (2, 4, 1)),   # 64 GPUs: tp fills a host, dp across hosts before pp
    ((8, 1, 2), 4, (1, 2, 2), (1, 4, 1)),   # a host holds 2 tp groups of one dp group each
    ((2, 4, 1), 4, (2, 2, 1), (2, 1, 1)),   # dp fills the host first, then pp
])
def test_multi_host_placement(shape, per_host, in_host, across):
  assert _host_split(*shape, per_host) == (in_host, across)


def test_chunks_must_divide_the_sequence_shard():
  mesh = make_mesh(mesh_config(2, 1, 4))
  ring = jax.shard_map(lambda x, w: all_gather_matmul(x, w, 3), mesh=mesh, in_specs=(P(None, TP), P(None, TP)),
                       out_specs=P(None, None, TP))
  with pytest.raises(ValueError, match="chunks=3 does not divide the 8-token sequence shard"):
    ring(jnp.ones((1, 32, 8)), jnp.ones((8, 8)))


def test_tp_must_stay_inside_a_host():
  with pytest.raises(ConfigError, match=r"^parallel\.tp=16: a tensor-parallel group must fit on one host"):
    _host_split(1, 1, 16, 8)


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_collective_matmuls_equal_the_plain_collectives(tp, chunks):
  """Values and gradients of both ring matmuls equal gather-then-matmul / matmul-then-scatter."""
  mesh = make_mesh(mesh_config(8 // tp, 1, tp))
  keys = jax.random.split(jax.random.key(tp * 10 + chunks), 5)
  b, s, k, f = 2, 32, 16, 8 * tp
  x = jax.random.normal(keys[0], (b, s, k))
  w_column = jax.random.normal(keys[1], (k, f))
  w_row = jax.random.normal(keys[2], (f, k))
  y = jax.random.normal(keys[3], (b, s, f))
  cot_column = jax.random.normal(keys[4], (b, s, f))

  def column(x, w):  # x split over seq, w over its output features
    return all_gather_matmul(x, w, chunks)

  def row(y, w):     # y split over features, w over its input features; output split over seq
    return matmul_reduce_scatter(y, w, chunks)

  column_fn = jax.shard_map(column, mesh=mesh, in_specs=(P(None, TP), P(None, TP)), out_specs=P(None, None, TP))
  row_fn = jax.shard_map(row, mesh=mesh, in_specs=(P(None, None, TP), P(TP)), out_specs=P(None, TP))

  np.testing.assert_allclose(jax.jit(column_fn)(x, w_column), x @ w_column, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(jax.jit(row_fn)(y, w_row), y @ w_row, rtol=1e-5, atol=1e-4)

  def column_loss(fn):
    return lambda a, w: jnp.sum(fn(a, w) * cot_column)

  def row_loss(fn):
    return lambda a, w: jnp.sum(jnp.sin(fn(a, w)))

  for got, want in zip(jax.jit(jax.grad(column_loss(column_fn), argnums=(0, 1)))(x, w_column),
                       jax.grad(column_loss(lambda a, w: a @ w), argnums=(0, 1))(x, w_column)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  for got, want in zip(jax.jit(jax.grad(row_loss(row_fn), argnums=(0, 1)))(y, w_row),
                       jax.grad(row_loss(lambda a, w: a @ w), argnums=(0, 1))(y, w_row)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
