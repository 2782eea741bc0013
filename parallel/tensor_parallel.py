"""The GPT forward pass with tensor + sequence parallelism, written for one device of the shard_map.

Layout on a device of a tp group of size n (Megatron-SP):
  residual stream x     [b, s/n, hidden]   sequence shard: LayerNorm and residual adds local
  attention, MLP        [b, s, heads/n, d], [b, s, mlp/n]   head / hidden-unit shard
  embedding, head       [vocab/n, hidden], [hidden, vocab/n]  vocab shard

Parallel block (MegaScale Fig. 3b): N(x) is all-gathered once and feeds one fused
column-parallel matmul [Q|K|V|MLP-in] (MLP-in: wi, or SwiGLU's wi_gate and wi_up); the
attention output and the MLP activation are concatenated into one fused row-parallel matmul
[Out; MLP-out] + reduce-scatter. One all-gather and one reduce-scatter on tp per layer; the
serial block needs two of each. The two-norm parallel block (GPT-NeoX) gathers its input x
once, not its two norms' outputs (half the bytes), and runs both norms on the gathered
tokens (elementwise, repeated on every tp rank) before the two column matmuls; then the same
fused row-parallel matmul: one all-gather, one reduce-scatter, like the parallel block.

The parameters are the model's own pytree (megajax.model), each leaf this device's tp shard,
a block's in its compute form (megajax.parallel.fused: the kernels of each fused matmul as
one operand, as ZeRO gathers them). The math and dtypes follow the Flax modules (the norms are the Flax modules themselves, the
MLP's activation megajax.layers.MLP_ACTIVATIONS), so the single-device model is the
reference this path is tested against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from megajax.layers import ATTENTION_IMPLS, MLP_ACTIVATIONS, rotary_embedding
from megajax.model import REMAT_POLICIES, ModelConfig, norm
from megajax.parallel.collective_matmul import column_parallel_apply, column_parallel_linear, row_parallel_linear
from megajax.parallel import collectives, context_parallel, fused
from megajax.parallel.mesh import CP, TP


@dataclasses.dataclass(frozen=True)
class Overlap:
  """How the tp collectives run: `mode` in megajax.config.TP_OVERLAP_CHOICES, `chunks` per ring step; ring=False
  (inside pipeline branches) runs collective matmul as chunked all-gathers / reduce-scatters."""
  mode: str
  chunks: int
  ring: bool = True

  def column(self, x, w, out_dtype=None):
    return column_parallel_linear(x, w, self.mode, self.chunks, out_dtype, self.ring)

  def column_apply(self, x, fn):
    return column_parallel_apply(x, fn, self.mode, self.chunks, self.ring)

  def row(self, x, w):
    return row_parallel_linear(x, w, self.mode, self.chunks, self.ring)


def _norm(params, x, c: ModelConfig):
  return norm(c, "norm").apply({"params": params}, x)


def _split(x, widths):
  offsets = [sum(widths[:i]) for i in range(1, len(widths))]
  return jnp.split(x, offsets, axis=-1)


def _side_by_side(biases: list, widths: list):
  """Biases [features] concatenated, zeros of its width for a part without one (model.qkv_bias:
  the MLP's inputs); None when no part has one."""
  present = next((b for b in biases if b is not None), None)
  if present is None:
    return None
  return jnp.concatenate([b.reshape(-1) if b is not None else jnp.zeros((width,), present.dtype)
                          for b, width in zip(biases, widths)])


def _column_operand(p, name: str, c: ModelConfig):
  """A columns operand of the layer's compute form (megajax.parallel.fused) in the compute
  dtype, its bias [features] (the members' side by side, zeros for a member without one:
  model.qkv_bias's MLP inputs; None when no member has one) and its members' widths on this
  tp rank."""
  operand = fused.operands(c)[name]
  widths = fused.member_widths(operand, c, lax.axis_size(TP))
  bias = _side_by_side([p[module][linear].get("bias") for module, linear in operand.members], widths)
  return p[name].astype(c.compute_dtype), None if bias is None else bias.astype(c.compute_dtype), widths


def _row_matmul(p, name: str, parts: list, c: ModelConfig, overlap: Overlap):
  """The activations `parts` (one per member of the rows operand `name`) times that operand,
  reduce-scattered over tp: the activations laid out as its rows (fused.interleave)."""
  kernel = p[name]                                                        # [groups, rows / groups, hidden]
  activations = fused.interleave(parts, kernel.shape[0])
  return overlap.row(activations, kernel.reshape(-1, kernel.shape[-1]).astype(c.compute_dtype))


def _attention(q, k, v, positions, window, c: ModelConfig, probe=None, captured=None, segment_ids=None, ring=True):
  """Local heads: q [b, s, h/n * d], k, v [b, s, kv/n * d] -> [b, s, h/n * d]. Every rank of
  the tp group sees its cp shard's whole sequence here (the row, or with cp > 1 its dual-chunk
  shard), so positions and segment_ids are that [b, s]. ring: Overlap.ring (False inside a
  pipeline stage's branch: no ppermute there, cp's exchanges all-gathered)."""
  b, s, _ = q.shape
  d = c.head_dim
  q, k = q.reshape(b, s, -1, d), k.reshape(b, s, -1, d)
  if window is not None or c.global_rope:          # model.global_rope=False: global layers NoPE
    q, k = rotary_embedding(q, positions, c.rope_theta), rotary_embedding(k, positions, c.rope_theta)
  if probe is not None and probe.wants("attn_probs"):   # recomputed: fused kernels never hold them
    captured["attn_probs"] = probe.capture_probs(q, k, window, segment_ids)
  v = v.reshape(b, s, -1, d)
  if collectives.live_axes(CP):       # the row's positions split over cp (megajax.parallel.context_parallel)
    out = context_parallel.attention(q, k, v, window, segment_ids, c.attention_impl,
                                     context_parallel.uses_dual_chunks(c), ring)
  else:
    out = ATTENTION_IMPLS[c.attention_impl](q, k, v, window, segment_ids)
  return out.reshape(b, s, -1)


def _observe(probe, captured: dict, tensor: str, x):
  """x, its statistics added to `captured` when the layer's probe (megajax.observe.probes) asks for them."""
  if probe is not None and probe.wants(tensor):
    captured[tensor] = probe.capture(tensor, x)
  return x


def _bias_sum(biases, c: ModelConfig):
  return sum(b.astype(c.compute_dtype) for b in biases) if c.use_bias else 0


def _mlp_activation(columns: list, c: ModelConfig):
  """The MLP's activation of its input projections' outputs, on this device's mlp units."""
  return MLP_ACTIVATIONS[c.mlp](*columns)


def _parallel_branches(p, x, projected, widths, positions, window, c: ModelConfig, overlap: Overlap, probe,
                       segment_ids):
  """Both parallel blocks from their column-parallel output [b, s, (q+k+v+mlp inputs)/n],
  bias added: attention and the MLP's activation -> one fused row-parallel matmul
  [Out; MLP-out] + reduce-scatter -> y = x + both branches. Returns (y, captured)."""
  attention, mlp = p["attention"], p["mlp"]
  captured = {}
  q, k, v, *mlp_columns = _split(projected, widths)
  attended = _attention(q, k, v, positions, window, c, probe, captured, segment_ids, overlap.ring)
  parts = [_observe(probe, captured, "attn_out", attended),
           _observe(probe, captured, "mlp_out", _mlp_activation(mlp_columns, c))]
  out = _row_matmul(p, "w_out", parts, c, overlap)                        # [b, s/n, hidden]
  return x + out + _bias_sum([attention["out"].get("bias"), mlp["wo"].get("bias")], c), captured


def parallel_block(p, x, positions, window, c: ModelConfig, overlap: Overlap, probe=None, segment_ids=None):
  """y = x + Attn(N(x)) + MLP(N(x)): one all-gather, one reduce-scatter on tp. `p`: the
  layer's compute form (megajax.parallel.fused). Returns (y, the statistics `probe`
  captured: {} without one)."""
  y = _norm(p["norm"], x, c)                                              # [b, s/n, hidden]
  kernel, bias, widths = _column_operand(p, "w_in", c)
  projected = overlap.column(y, kernel)                                   # [b, s, (q+k+v+mlp)/n]
  if bias is not None:
    projected = projected + bias
  return _parallel_branches(p, x, projected, widths, positions, window, c, overlap, probe, segment_ids)


def parallel_two_norms_block(p, x, positions, window, c: ModelConfig, overlap: Overlap, probe=None,
                             segment_ids=None):
  """y = x + Attn(N1(x)) + MLP(N2(x)): x all-gathered once, both norms on the gathered
  tokens, then the parallel block's fused row-parallel matmul: one all-gather, one
  reduce-scatter on tp. Returns (y, the statistics `probe` captured: {} without one)."""
  attention_kernel, attention_bias, attention_widths = _column_operand(p, "w_attention_in", c)
  mlp_kernel, mlp_bias, mlp_widths = _column_operand(p, "w_mlp_in", c)
  matmul = lambda a, w: jnp.einsum("bsk,kf->bsf", a, w)

  def branch_inputs(gathered):                                            # [b, tokens, hidden]
    return jnp.concatenate([matmul(_norm(p["attention_norm"], gathered, c), attention_kernel),
                            matmul(_norm(p["mlp_norm"], gathered, c), mlp_kernel)], axis=-1)

  projected = overlap.column_apply(x, branch_inputs)                      # [b, s, (q+k+v+mlp)/n]
  bias = _side_by_side([attention_bias, mlp_bias], [sum(attention_widths), sum(mlp_widths)])
  if bias is not None:
    projected = projected + bias
  return _parallel_branches(p, x, projected, attention_widths + mlp_widths, positions, window, c, overlap, probe,
                            segment_ids)


def serial_block(p, x, positions, window, c: ModelConfig, overlap: Overlap, probe=None, segment_ids=None):
  """z = x + Attn(N1(x)); y = z + MLP(N2(z)): two all-gathers, two reduce-scatters on tp.
  Returns (y, the statistics `probe` captured: {} without one)."""
  attention, mlp = p["attention"], p["mlp"]
  captured = {}
  kernel, bias, widths = _column_operand(p, "w_qkv", c)
  qkv = overlap.column(_norm(p["attention_norm"], x, c), kernel)
  if bias is not None:
    qkv = qkv + bias
  q, k, v = _split(qkv, widths)
  attended = _observe(probe, captured, "attn_out",
                      _attention(q, k, v, positions, window, c, probe, captured, segment_ids, overlap.ring))
  z = x + _row_matmul(p, "w_attention_out", [attended], c, overlap) + _bias_sum([attention["out"].get("bias")], c)
  kernel, bias, widths = _column_operand(p, "w_mlp_in", c)
  hidden = overlap.column(_norm(p["mlp_norm"], z, c), kernel)             # [b, s, (mlp inputs)/n]
  if bias is not None:
    hidden = hidden + bias
  activation = _observe(probe, captured, "mlp_out", _mlp_activation(_split(hidden, widths), c))
  out = _row_matmul(p, "w_mlp_out", [activation], c, overlap)
  return z + out + _bias_sum([mlp["wo"].get("bias")], c), captured


# model.block -> this device's block (keys: megajax.config.BLOCK_CHOICES, like megajax.model.BLOCK_MODULES).
BLOCK_FUNCTIONS = {"parallel": parallel_block, "parallel_two_norms": parallel_two_norms_block, "serial": serial_block}


@jax.named_scope("tp embedding")
def vocab_parallel_embed(table, tokens, c: ModelConfig):
  """table [vocab/n, hidden] (this rank's rows), tokens [b, s] -> x [b, s/n, hidden].

  Each rank looks up the tokens in its vocab slice (zeros elsewhere); the reduce-scatter
  sums the slices and leaves each rank its sequence shard.
  """
  if lax.axis_size(TP) == 1:
    # The whole vocabulary here: a plain gather (the tokens are in it: the launcher checks
    # the vocabulary). A masked one (the one below, or jnp.take's default out-of-bounds fill),
    # with no collective after it to materialize it, is fused again into every use of x.
    return table.at[tokens].get(mode="promise_in_bounds").astype(c.compute_dtype)
  rows = table.shape[0]
  local = tokens - collectives.axis_index(TP) * rows
  mine = (local >= 0) & (local < rows)
  x = jnp.take(table, jnp.where(mine, local, 0), axis=0) * mine[..., None]
  return collectives.psum_scatter(x.astype(c.compute_dtype), TP, scatter_dimension=1)


@jax.named_scope("tp cross-entropy")
def vocab_parallel_cross_entropy_sums(logits, targets, loss_mask, z_loss: float):
  """megajax.loss.cross_entropy_sums on logits split over vocab: [b, s, vocab/n] fp32.

  The max and the sum of exponentials are reduced over tp, so the full logits never meet
  on one device. Returns the same (objective sum, stats) on every rank of the tp group.
  """
  columns = logits.shape[-1]
  # The shift cancels in the value and the gradient of logsumexp; it only keeps exp() finite.
  shift = collectives.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), TP)        # [b, s]
  sum_exp = collectives.psum(jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1), TP)
  log_normalizer = jnp.log(sum_exp) + shift
  if lax.axis_size(TP) == 1:   # the whole vocabulary here (as in vocab_parallel_embed)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1, mode="promise_in_bounds")[..., 0]
  else:
    local = targets - collectives.axis_index(TP) * columns
    mine = (local >= 0) & (local < columns)
    picked = jnp.take_along_axis(logits, jnp.where(mine, local, 0)[..., None], axis=-1)[..., 0]
    target_logits = collectives.psum(jnp.where(mine, picked, 0.0), TP)
  mask = loss_mask.astype(jnp.float32)
  nll_sum = jnp.sum((log_normalizer - target_logits) * mask)
  z_sum = jnp.sum(jnp.square(log_normalizer) * mask)
  stats = {"nll_sum": nll_sum, "z_sum": z_sum, "tokens": jnp.sum(mask)}
  return nll_sum + z_loss * z_sum, stats


def apply_block(p, x, positions, window, c: ModelConfig, overlap: Overlap, segment_ids=None):
  """One transformer block on this device's shards from the layer's compute form `p`
  (megajax.parallel.fused), recomputed in the backward if c.remat says so. segment_ids: None,
  or the packed documents' [b, s] (full sequence)."""
  return probed_block(p, x, positions, window, c, overlap, None, segment_ids)[0]


def probed_block(p, x, positions, window, c: ModelConfig, overlap: Overlap, probe, segment_ids=None):
  """One block from the layer's compute form `p`, with a megajax.observe.probes.LayerProbe (or
  None): (y, {tensor: statistics}). The perturbation and the residual's capture sit outside
  the remat: y is kept anyway."""
  block = lambda p, x: BLOCK_FUNCTIONS[c.block](p, x, positions, window, c, overlap, probe, segment_ids)
  if c.remat != "none":
    block = jax.checkpoint(block, policy=REMAT_POLICIES[c.remat])
  y, captured = block(p, x)
  if probe is not None and probe.perturbed:
    y = probe.perturb(y)
  return _observe(probe, captured, "residual", y), captured


def compute_form(params: dict, c: ModelConfig) -> dict:
  """The model's parameters with every layer in its compute form (fused.to_compute_form), as
  loss_sums reads them: for a caller holding whole parameters rather than ZeRO's gathers."""
  return {name: fused.to_compute_form(value, c) if name.startswith("layer_") else value
          for name, value in params.items()}


def positions_of(batch):
  """The rotary positions of a (micro)batch dict: its "positions" when packed, else 0 .. s - 1
  (also for a bare tokens array [b, s])."""
  if isinstance(batch, dict) and "positions" in batch:
    return batch["positions"]
  batch_size, seq = (batch["inputs"] if isinstance(batch, dict) else batch).shape
  return jnp.broadcast_to(jnp.arange(seq), (batch_size, seq))


def head_loss_sums(params, x, batch, c: ModelConfig, overlap: Overlap, z_loss: float):
  """Final norm -> vocab-parallel head -> cross-entropy sums; `params` has final_norm and the head."""
  y = _norm(params["final_norm"], x, c)
  head = params["embedding"].T if c.tie_embeddings else params["head"]   # [hidden, vocab/n]
  logits = overlap.column(y, head.astype(c.compute_dtype), out_dtype=jnp.float32)  # [b, s, vocab/n]
  if c.logit_scale != 1.0:
    logits = logits * c.logit_scale
  return vocab_parallel_cross_entropy_sums(logits, batch["targets"], batch["loss_mask"], z_loss)


def loss_sums(params, batch, c: ModelConfig, overlap: Overlap, z_loss: float = 0.0, probes=None,
              gather_ahead=None):
  """This device's (objective sum, stats) for its dp shard of the batch: embed -> blocks -> head.
  `params`: each layer in its compute form (compute_form, or ZeRO's gathers). A packed batch
  has "positions" and "segment_ids" [b, s] too (megajax.model.GPT).

  The pipeline (megajax.parallel.pipeline) runs the same pieces split into stages. With
  `probes` (megajax.observe.probes.Probes, bound to the step; the batch then has "rows") the stats
  also hold the captured statistics under "capture", {"<layer>:<tensor>": {...}}.
  `gather_ahead` (megajax.parallel.zero.layer_ahead_gathers): `params` starts empty and
  each leaf is gathered one layer ahead of its use, issued after the input of the layer
  before (which it returns, on XLA:CPU made to wait for the gathers).
  """
  ahead = gather_ahead or (lambda params, names, issued_after: (params, issued_after))
  tokens = batch["inputs"]                                                # [b, s], every tp rank
  params, tokens = ahead(params, ("embedding", "layer_0"), tokens)
  x = vocab_parallel_embed(params["embedding"], tokens, c)                # [b, s/n, hidden]
  positions, segment_ids = positions_of(batch), batch.get("segment_ids")
  captured = {}
  for layer in range(c.num_layers):
    following = (f"layer_{layer + 1}",) if layer + 1 < c.num_layers else ("final_norm", "head")
    params, x = ahead(params, following, x)   # issued as this layer starts, used by the next
    probe = probes.at_layer(layer, batch["rows"]) if probes is not None else None
    x, stats = probed_block(params[f"layer_{layer}"], x, positions, c.layer_window(layer), c, overlap, probe,
                            segment_ids)
    captured.update({f"{layer}:{tensor}": s for tensor, s in stats.items()})
  total, stats = head_loss_sums(params, x, batch, c, overlap, z_loss)
  if probes is not None and probes.capturing:
    stats = {**stats, "capture": captured}
  return total, stats
