"""Parameter initializers that also attach logical axis names (for the sharding rules)."""

import flax.linen as nn


def normal(std: float, logical_axes: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), logical_axes)


def zeros(logical_axes: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), logical_axes)


def ones(logical_axes: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.ones_init(), logical_axes)
