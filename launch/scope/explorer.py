"""One run opened for the explorer: its config, trained parameters and tokenizer (as
megajax-sample reads them), and every request the page makes, checked before any compile.

A run that cannot be opened (no workdir, no trained parameters, a bad config or tokenizer) is
kept as `problem`: the page still loads and every request answers it (404), so an operator
reads one line instead of a traceback."""

from __future__ import annotations

import math
import os
import threading
from typing import Iterator

from absl import logging
import numpy as np

from megajax.checkpoint import CheckpointError
from megajax.config import ConfigError
from megajax.launch.run_files import run_config, run_params, workdir_tokenizer
from megajax.model import ModelConfig
from megajax.observe import scope
from megajax.observe.probes import read_activations
from megajax.observe.records import ACTIVATIONS
from megajax.sampling import Sampling
from megajax.tokenizer import TokenizerError

TOP_K_SHOWN = 10


class RunMissing(Exception):
  """The run could not be opened; its message says why and what to do."""


def _field(body: dict, name: str, kind, default=None, low=None, high=None):
  """body[name] as `kind` (int / float / str), within [low, high]: a ScopeError otherwise."""
  value = body.get(name, default)
  if value is None:
    raise scope.ScopeError(name, value, "missing", f"send {name}")
  try:
    if kind is int and (isinstance(value, bool) or float(value) != int(value)):
      raise ValueError
    value = kind(value)
  except (TypeError, ValueError):
    raise scope.ScopeError(name, value, f"not {'an integer' if kind is int else 'a number' if kind is float else 'text'}",
                           f"send a {kind.__name__}") from None
  if kind is float and not math.isfinite(value):
    raise scope.ScopeError(name, value, "not finite", "send a finite number")
  if (low is not None and value < low) or (high is not None and value > high):
    raise scope.ScopeError(name, value, f"outside [{low}, {high}]", f"use a value from {low} to {high}")
  return value


class Explorer:
  """The run behind one megajax-scope server."""

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.problem = None
    self._lock = threading.Lock()       # one decode or forward at a time: memory stays bounded
    self._inspected = (None, None)      # (tokens, internals) of the last sequence inspected
    try:
      if not os.path.isdir(self.workdir):
        raise RunMissing(f"workdir={workdir!r}: no such directory; pass the workdir a megajax-train run wrote")
      self.config = run_config(self.workdir)
      self.model = ModelConfig.from_config(self.config.model)
      self.tokenizer = workdir_tokenizer(self.workdir)
      self.params, self.source = run_params(self.workdir, self.config)
    except (RunMissing, ConfigError, CheckpointError, TokenizerError) as error:
      self.problem = str(error)
      logging.error("megajax-scope: %s", self.problem)

  # --- What the run is.

  def _ready(self) -> None:
    if self.problem is not None:
      raise RunMissing(self.problem)

  def info(self) -> dict:
    self._ready()
    m = self.model
    return {"workdir": self.workdir, "params_source": self.source, "num_layers": m.num_layers,
            "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "hidden_dim": m.hidden_dim, "mlp_dim": m.mlp_dim, "vocab_size": m.vocab_size, "seq_len": m.seq_len,
            "block": m.block, "mlp": m.mlp,
            "layers": [{"index": i, "window": m.layer_window(i), "kind": "global" if m.layer_window(i) is None else "local"}
                       for i in range(m.num_layers)],
            "perturbations": list(scope.PERTURBATIONS),
            "has_activations": os.path.exists(os.path.join(self.workdir, ACTIVATIONS))}

  def text(self, token: int) -> str:
    return self.tokenizer.decode([int(token)])

  # --- Requests.

  def _decoding(self, body: dict) -> tuple[list[int], int, Sampling, int]:
    """(prompt ids, new tokens, sampling, seed) of a generate / compare / logits body."""
    self._ready()
    m = self.model
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
      raise scope.ScopeError("prompt", prompt, "empty", "type some text to continue")
    ids = [int(i) for i in self.tokenizer.encode(prompt)]
    outside = [i for i in ids if i >= m.vocab_size]
    if outside:
      raise scope.ScopeError("prompt", prompt[:40], f"encodes to id {outside[0]}, outside the model's vocabulary "
                             f"({m.vocab_size})", "use text the run's tokenizer covers")
    new = _field(body, "max_new_tokens", int, 16, 1, m.seq_len)
    if len(ids) + new > m.seq_len:
      raise scope.ScopeError("prompt", f"{len(ids)} tokens", f"with max_new_tokens={new} it runs past the model's "
                             f"context (seq_len {m.seq_len})", f"shorten the prompt or ask for at most "
                             f"{max(0, m.seq_len - len(ids))} new tokens")
    sampling = Sampling(_field(body, "temperature", float, 0.0, 0.0, 100.0),
                        _field(body, "top_k", int, 0, 0, m.vocab_size),
                        _field(body, "top_p", float, 1.0, 1e-6, 1.0))
    return ids, new, sampling, _field(body, "seed", int, 0, 0, 2**31 - 1)

  def _tokens(self, ids) -> list[dict]:
    return [{"id": int(i), "text": self.text(i)} for i in ids]

  def _topk(self, logits: np.ndarray) -> list[dict]:
    probs = scope.softmax(logits)
    best = np.argsort(-probs)[:TOP_K_SHOWN]
    return [{"id": int(i), "text": self.text(i), "prob": float(probs[i])} for i in best]

  def generate(self, body: dict) -> Iterator[dict]:
    """The page's decode events (the prompt's, one per new token, done): checked now, decoded
    as iterated."""
    ids, new, sampling, seed = self._decoding(body)

    def events():
      yield {"type": "prompt", "tokens": self._tokens(ids)}
      made, seconds = [], 0.0
      with self._lock:
        for step in scope.decode(self.params, self.model, ids, new, sampling, seed):
          made.append(step.token)
          seconds += step.seconds
          yield {"type": "token", "step": len(made) - 1, "id": step.token, "text": self.text(step.token),
                 "position": len(ids) + len(made) - 1, "topk": self._topk(step.logits), "seconds": step.seconds}
      yield {"type": "done", "tokens": ids + made, "per_token_ms": 1000 * seconds / max(1, len(made))}

    return events()

  def logits(self, body: dict) -> dict:
    ids, new, sampling, seed = self._decoding(body)
    with self._lock:
      steps = list(scope.decode(self.params, self.model, ids, new, sampling, seed))
    return {"prompt": ids, "tokens": [s.token for s in steps], "logits": [s.logits.tolist() for s in steps]}

  def compare(self, body: dict) -> dict:
    ids, new, sampling, seed = self._decoding(body)
    spec = body.get("perturbation")
    if not isinstance(spec, dict):
      raise scope.ScopeError("perturbation", spec, "missing", "send {layer, kind, and its value}")
    kind = spec.get("kind")
    perturbation = scope.Perturbation(
        layer=_field(spec, "layer", int, None), kind=str(kind),
        std=_field(spec, "std", float, 0.0), rate=_field(spec, "rate", float, 0.0),
        heads=tuple(_field({"head": h}, "head", int) for h in spec.get("heads") or ()),
        positions=tuple(_field({"position": p}, "position", int) for p in spec.get("positions") or ()),
        offset=_field(spec, "offset", float, 0.0), seed=seed)
    perturbation.check(self.model)
    with self._lock:
      base = list(scope.decode(self.params, self.model, ids, new, sampling, seed))
      perturbed = list(scope.decode(self.params, self.model, ids, new, sampling, seed, perturbation))
    run = lambda steps: {"tokens": self._tokens([s.token for s in steps]),
                         "text": self.tokenizer.decode([s.token for s in steps])}
    return {"base": run(base), "perturbed": run(perturbed), "prompt_tokens": len(ids),
            "diverged_at": scope.first_divergence([s.token for s in base], [s.token for s in perturbed]),
            "kl": [scope.kl_divergence(a.logits, b.logits) for a, b in zip(base, perturbed)]}

  def inspect(self, body: dict) -> dict:
    self._ready()
    m = self.model
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens or len(tokens) > m.seq_len:
      raise scope.ScopeError("tokens", f"{len(tokens) if isinstance(tokens, list) else tokens}",
                             f"send 1 .. {m.seq_len} token ids", "send the ids the done event gave")
    tokens = [_field({"token": t}, "token", int, None, 0, m.vocab_size - 1) for t in tokens]
    layer = _field(body, "layer", int, None, 0, m.num_layers - 1)
    head = _field(body, "head", int, None, 0, m.num_heads - 1)
    with self._lock:
      if self._inspected[0] != tokens:
        self._inspected = (tokens, scope.internals(self.params, m, tokens))
      inside = self._inspected[1]
      attention = scope.attention_map(m, inside, layer, head)
      coords, share = scope.residual_pca(m, inside)
    heatmaps = {}
    for tensor in scope.TENSORS:
      values, width = scope.heatmap(inside, m, layer, tensor, head)
      heatmaps[tensor] = {"values": values.tolist(), "features": int(values.shape[1]), "of": int(width)}
    window = m.layer_window(layer)
    return {"layer": layer, "head": head, "window": window, "kind": "global" if window is None else "local",
            "labels": [self.text(t) for t in tokens], "attention": attention.tolist(), "heatmaps": heatmaps,
            "pca": {"coords": coords.tolist(), "explained": [float(x) for x in share]}}

  def activations(self) -> dict:
    self._ready()
    path = os.path.join(self.workdir, ACTIVATIONS)
    if not os.path.exists(path):
      raise RunMissing(f"{path}: none; train with observe.capture set (e.g. --config.observe.capture='*:residual') "
                       "to record activations")
    return {"points": read_activations(path)}
