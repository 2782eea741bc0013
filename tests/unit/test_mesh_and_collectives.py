"""The (dp, pp, tp) mesh builder and the collective matmuls, on 8 CPU devices."""

import contextlib
import io

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from megajax.config import ConfigError, default_config
from megajax.model import REMAT_POLICIES
from megajax.parallel.collective_matmul import column_parallel_linear, row_parallel_linear
from megajax.parallel import TP, all_gather_matmul, local_batch_slice, make_mesh, matmul_reduce_scatter
from megajax.parallel.mesh import DP, _host_split, after_by_one_element
from megajax.parallel.sharding import Layout
from megajax.parallel.zero import gather_params, reduce_scatter_grads


def mesh_config(dp, pp, tp, cp=1):
  """A parallel section of dp x pp x cp x tp (make_mesh's argument)."""
  parallel = default_config().parallel
  parallel.dp, parallel.pp, parallel.cp, parallel.tp = dp, pp, cp, tp
  return parallel


def test_an_order_through_one_element_keeps_every_bit_and_the_gradient():
  """after_by_one_element(x, deps, never) is x bit for bit (-0.0 and NaN kept: -0.0 is what it
  adds), its gradient w.r.t. x the cotangent itself, none into deps, as after()'s. (No select
  of a layer's input in the compiled step: tests/unit/test_parallel.py.)"""
  x = jnp.array([[-0.0, 1.5], [jnp.nan, -2.0]])
  deps, never = jnp.full((3,), 7.0), jnp.array(False)
  out = jax.jit(after_by_one_element)(x, deps, never)
  np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(x).view(np.uint32))
  assert float(jax.jit(after_by_one_element)(x, deps, jnp.array(True))[0, 0]) == 7.0   # the dependency is real
  weights = jnp.arange(4.0).reshape(2, 2)
  loss = lambda x, deps: jnp.sum(jnp.sin(after_by_one_element(x, deps, never)) * weights)
  gx, gdeps = jax.grad(loss, argnums=(0, 1))(jnp.ones((2, 2)), deps)
  np.testing.assert_array_equal(gx, jnp.cos(1.0) * weights)
  np.testing.assert_array_equal(gdeps, 0)


def test_tp_is_innermost_and_dp_before_pp():
  mesh = make_mesh(mesh_config(2, 2, 2))
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert mesh.axis_names == ("dp", "pp", "cp", "tp")
  # Physical order (pp, dp, cp, tp): a tp group is adjacent devices, then dp neighbours, then pp.
  np.testing.assert_array_equal(ids, np.arange(8).reshape(2, 2, 1, 2).transpose(1, 0, 2, 3))
  assert local_batch_slice(mesh, 16) == (0, 1)  # one process holds every row


def test_cp_sits_between_tp_and_dp():
  """Physical order (pp, dp, cp, tp): a cp group is tp groups side by side, inside a dp replica."""
  mesh = make_mesh(mesh_config(2, 1, 2, cp=2))
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  np.testing.assert_array_equal(ids, np.arange(8).reshape(1, 2, 2, 2).transpose(1, 0, 2, 3))
  assert local_batch_slice(mesh, 16) == (0, 1)
  with pytest.raises(ConfigError, match=r"^parallel='dp=2 pp=1 cp=3 tp=2': the mesh has 12 devices but the job has "
                                        r"8; choose dp \* pp \* cp \* tp = 8"):
    make_mesh(mesh_config(2, 1, 2, cp=3))


def test_mesh_size_must_match_the_devices():
  with pytest.raises(ConfigError, match=r"^parallel='dp=2 pp=1 cp=1 tp=2': the mesh has 4 devices but the job has "
                                        r"8; choose dp \* pp \* cp \* tp = 8"):
    make_mesh(mesh_config(2, 1, 2))
  assert make_mesh(mesh_config(2, 1, 2), jax.devices()[:4]).devices.shape == (2, 1, 1, 2)


@pytest.mark.parametrize("shape,per_host,in_host,across", [   # (dp, pp, cp, tp); physical (pp, dp, cp, tp)
    ((4, 2, 1, 8), 8, (1, 1, 1, 8), (2, 4, 1, 1)),   # 64 GPUs: tp fills a host, dp across hosts before pp
    ((8, 1, 1, 2), 4, (1, 2, 1, 2), (1, 4, 1, 1)),   # a host holds 2 tp groups of one dp group each
    ((2, 4, 1, 1), 4, (2, 2, 1, 1), (2, 1, 1, 1)),   # dp fills the host first, then pp
    ((2, 1, 4, 2), 8, (1, 1, 4, 2), (1, 2, 1, 1)),   # cp beside tp in a host, dp across hosts
    ((2, 1, 4, 4), 8, (1, 1, 2, 4), (1, 2, 2, 1)),   # a cp group across two hosts, before dp
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
    _host_split(1, 1, 1, 16, 8)


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


def _bucketing_case():
  """Leaves split over dp on dim 0, on a dim also split over tp, on a middle dim, unsplit,
  bf16, and tp-replicated ones (which must stay tp-replicated): (mesh, layouts, per-device
  keys, per-dp-rank keys, dtypes)."""
  mesh = make_mesh(mesh_config(4, 1, 2))
  per_device = {"a": ((8, 6), Layout(None, 0)), "b": ((4, 8), Layout(1, 1)), "c": ((3, 5), Layout(None, None)),
                "d": ((2, 8, 4), Layout(None, 1)), "e": ((4, 3), Layout(None, 0))}
  per_dp_rank = {"f": ((4, 6), Layout(None, 0)), "g": ((5,), Layout(None, None))}
  return mesh, per_device, per_dp_rank, {"d": jnp.bfloat16}


# Bucket sizes: one per leaf; some leaves of a kind together; every leaf of a kind in one.
BUCKETS = (0, 200, 1 << 20)


def test_bucketed_gradient_reduce_scatter_equals_one_per_leaf():
  """ZeRO's gradient reduce-scatter packed into buckets (parallel.dp_bucket_mb), in order or
  not, keeps each dp rank the same shard of the same sum as one collective per leaf."""
  mesh, per_device, per_dp_rank, dtypes = _bucketing_case()
  layouts = {k: layout for k, (_, layout) in (per_device | per_dp_rank).items()}
  keys = iter(jax.random.split(jax.random.key(0), len(layouts)))
  # Small integers: every order of summation gives the same floats, so the two must match exactly.
  def make(shapes, n):
    return {k: jax.random.randint(next(keys), (n, *shape), -8, 8).astype(dtypes.get(k, jnp.float32))
            for k, (shape, _) in shapes.items()}
  grads = (make(per_device, 8), make(per_dp_rank, 4))
  specs = ({k: P((DP, TP)) for k in per_device}, {k: P(DP) for k in per_dp_rank})

  def run(bucket_bytes, ordered=False):
    def body(tree):
      local = jax.tree.map(lambda x: x[0], tree)
      out = reduce_scatter_grads(local[0] | local[1], layouts, bucket_bytes, ordered=ordered)
      return jax.tree.map(lambda x: x[None], ({k: out[k] for k in per_device}, {k: out[k] for k in per_dp_rank}))
    compiled = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs)).lower(grads).compile()
    return compiled(grads), compiled.as_text().count(" reduce-scatter(")

  (one_per_leaf, leaves), *packed = [run(0)] + [run(b, ordered) for b in BUCKETS[1:] for ordered in (False, True)]
  for bucketed, collectives in packed:
    assert collectives < leaves
    for got, want in zip(jax.tree.leaves(bucketed), jax.tree.leaves(one_per_leaf)):
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # Kinds: fp32 on (dp, tp) [a, b, e], bf16 on (dp, tp) [d], fp32 on dp [f]; 200 bytes: [e, b], [a].
  assert [n for _, n in packed] == [4, 4, 3, 3]
  # And the values are the dp sums: leaf "a" (split on dim 0) on dp rank 1, tp rank 0.
  total = grads[0]["a"].reshape(4, 2, 8, 6)[:, 0].sum(0)
  np.testing.assert_array_equal(one_per_leaf[0]["a"][1 * 2 + 0], total[2:4])


def test_bucketed_parameter_gather_equals_one_per_leaf():
  """ZeRO's parameter all-gather packed into buckets gives every leaf exactly as one
  all-gather per leaf does, and fewer collectives."""
  mesh, per_device, per_dp_rank, dtypes = _bucketing_case()
  layouts = {k: layout for k, (_, layout) in (per_device | per_dp_rank).items()}
  dp = mesh.shape[DP]
  shard = lambda shape, layout: tuple(n // dp if i == layout.dp_dim else n for i, n in enumerate(shape))
  keys = iter(jax.random.split(jax.random.key(1), len(layouts)))
  shards = ({k: jax.random.normal(next(keys), (8, *shard(*per_device[k]))).astype(dtypes.get(k, jnp.float32))
             for k in per_device},
            {k: jax.random.normal(next(keys), (4, *shard(*per_dp_rank[k]))) for k in per_dp_rank})
  in_specs = ({k: P((DP, TP)) for k in per_device}, {k: P(DP) for k in per_dp_rank})

  def run(bucket_bytes):
    def body(tree):
      local = jax.tree.map(lambda x: x[0], tree)
      out = gather_params(local[0] | local[1], layouts, bucket_bytes=bucket_bytes)
      return jax.tree.map(lambda x: x[None], ({k: out[k] for k in per_device}, {k: out[k] for k in per_dp_rank}))
    compiled = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=in_specs)).lower(shards).compile()
    return compiled(shards), compiled.as_text().count(" all-gather(")

  (one_per_leaf, leaves), *packed = [run(b) for b in BUCKETS]
  assert leaves == 5 and [n for _, n in packed] == [4, 3]   # 200 gathered bytes: [a], [b, e], [d], [f]
  for bucketed, _ in packed:
    for got, want in zip(jax.tree.leaves(bucketed), jax.tree.leaves(one_per_leaf)):
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # Leaf "d" (split on its middle dim): dp rank r's shard is rows r*2 .. r*2+1 of that dim.
  for r in range(dp):
    np.testing.assert_array_equal(np.asarray(one_per_leaf[0]["d"][0][:, 2 * r:2 * r + 2], np.float32),
                                  np.asarray(shards[0]["d"][r * 2], np.float32))


@pytest.mark.parametrize("mode", ["none", "collective_matmul"])
def test_remat_dots_keeps_the_parallel_linears_outputs(mode):
  """model.remat="dots" keeps what a column-parallel linear computes for the backward, full
  keeps nothing but the inputs: the linears' backward is written out (a custom_vjp, which the
  dots policy cannot see into), so they name their outputs for the policy. Without the name,
  dots kept nothing, as full."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (TP,))

  def saved(policy):
    def block(x, w_in, w_out):
      hidden = jnp.tanh(column_parallel_linear(x, w_in, mode, 2))
      return row_parallel_linear(hidden, w_out, mode, 2)
    sharded = jax.shard_map(lambda *a: jax.checkpoint(block, policy=REMAT_POLICIES[policy])(*a), mesh=mesh,
                            in_specs=(P(None, TP), P(None, TP), P(TP, None)), out_specs=P(None, TP))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      jax.ad_checkpoint.print_saved_residuals(lambda *a: jnp.sum(sharded(*a)), jnp.ones((2, 8, 4)),
                                              jnp.ones((4, 16)), jnp.ones((16, 4)))
    return [line for line in printed.getvalue().splitlines() if line and "from the argument" not in line]

  assert saved("full") == []
  assert len(saved("dots")) == 1 and "output of shard_map" in saved("dots")[0]
