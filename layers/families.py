"""The block families, stated once: what each `model.block`, `model.norm`, `model.mlp` and
`model.attention_impl` is.

Everything that depends on a family reads its row here instead of testing its name: the
config's choices are these tables' keys (megajax.config); the Flax model (megajax.model)
and the sharded forward (megajax.parallel.tensor_parallel, .fused) build a block from its
norms and fused operands; the planner (parallel/planner: parameters, operations, memory)
counts its norms, tp collectives and kept activations from it. The code of a family sits
under the same key beside the code it belongs with (model.BLOCK_MODULES,
tensor_parallel.BLOCK_FUNCTIONS, layers.NORM_MODULES, layers.MLP_ACTIVATIONS; tested equal to
these keys). Adding a family: its row here, its code under that key, its tests
(WORKSPACE.md, "add a block family").
"""

from __future__ import annotations

import dataclasses

# A fused operand's member groups (parallel.fused.Operand: the (module, linear) kernels in it).
QKV, MLP_IN, ATTENTION_OUT, MLP_OUT = "qkv", "mlp_in", "attention_out", "mlp_out"


@dataclasses.dataclass(frozen=True)
class BlockFamily:
  """A block's wiring (model.block)."""
  norms: tuple[str, ...]        # its norm modules by parameter name, in the order it applies them
  parallel: bool                # y = x + Attn(.) + MLP(.): both branches into one residual
  norms_on_gathered: bool       # its norms run on the tp-gathered sequence, not on a shard (under SP)
  # The matmuls its sharded forward runs, each one fused operand: (name, a row-parallel one?,
  # its member groups in order). One all-gather and one reduce-scatter per column / row pair.
  operands: tuple[tuple[str, bool, tuple[str, ...]], ...]

  @property
  def tp_pairs(self) -> int:
    """The tp all-gather / reduce-scatter pairs of its forward: one per column / row group."""
    return sum(1 for _, rows, _ in self.operands if rows)


BLOCK_FAMILIES = {
    # MegaScale's PTB: one norm, [Q|K|V|MLP-in] in one column matmul, [Out; MLP-out] in one row matmul.
    "parallel": BlockFamily(("norm",), True, False,
                            (("w_in", False, (QKV, MLP_IN)), ("w_out", True, (ATTENTION_OUT, MLP_OUT)))),
    # GPT-NeoX / GPT-J's parallel residual: a norm per branch, both on the once-gathered input.
    "parallel_two_norms": BlockFamily(("attention_norm", "mlp_norm"), True, True,
                                      (("w_attention_in", False, (QKV,)), ("w_mlp_in", False, (MLP_IN,)),
                                       ("w_out", True, (ATTENTION_OUT, MLP_OUT)))),
    # GPT / Megatron / Llama pre-norm: the attention's half, then the MLP's.
    "serial": BlockFamily(("attention_norm", "mlp_norm"), False, False,
                          (("w_qkv", False, (QKV,)), ("w_attention_out", True, (ATTENTION_OUT,)),
                           ("w_mlp_in", False, (MLP_IN,)), ("w_mlp_out", True, (MLP_OUT,)))),
}


@dataclasses.dataclass(frozen=True)
class NormFamily:
  """A norm (model.norm)."""
  leaves: tuple[str, ...]       # its parameters


NORM_FAMILIES = {
    "layernorm": NormFamily(("scale", "bias")),
    "layernorm_nobias": NormFamily(("scale",)),            # Cohere's
    "rmsnorm": NormFamily(("scale",)),
}


@dataclasses.dataclass(frozen=True)
class MlpFamily:
  """An MLP (model.mlp): act(x W_in ...) W_out."""
  inputs: tuple[str, ...]       # its input projections by parameter name (each [hidden, mlp_dim])
  # Bytes per output element of its activation, (forward: read, write | backward: read x and dy,
  # write dx), for the planner's memory-bound time (parallel/planner/operations.py).
  activation_bytes: tuple[int, int]

  @property
  def gated(self) -> bool:
    """Two input projections, one gating the other (its backward keeps both)."""
    return len(self.inputs) > 1


MLP_FAMILIES = {
    "gelu": MlpFamily(("wi",), (4, 6)),                 # the tanh form
    "gelu_exact": MlpFamily(("wi",), (4, 6)),           # the erf form
    "swiglu": MlpFamily(("wi_gate", "wi_up"), (6, 10)),
}

# model.attention_impl -> whether the kernel is fused (never holds the [s, s] scores: the
# planner's memory and time count them only where it is not).
ATTENTION_FUSED = {"xla": False, "pallas": True, "cudnn": True}
