"""megajax: MegaScale-style LLM training on JAX/XLA.

The Python API, in the order a user meets it:

    import jax, megajax
    config = megajax.load_config("configs/default.py", {"train.steps": 50})
    model = megajax.build_model(config)                     # a Flax GPT
    params = megajax.init_params(model, jax.random.key(0))  # a plain pytree, fp32
    logits = model.apply({"params": params}, tokens)        # f32[batch, seq, vocab]
    loss, stats = megajax.make_loss_fn(model)(params, batch)
    result = megajax.train(config, workdir="/tmp/run")      # result.state, result.history
    tokens = megajax.generate(params, config, [[1, 2, 3]], max_new_tokens=32, temperature=0.8)
    megajax.scope.serve("/tmp/run", port=8470)              # MegaScope's explorer of a run, on 127.0.0.1

This file is the facade over every layer of the package (WORKSPACE.md, "Layering"); code
inside megajax imports the module it needs, never this one.
"""

import gc as _gc
import importlib as _importlib

# Importing the package imports jax, flax, optax, orbax and grain: Python's automatic collections
# ran 376 times meanwhile, walking the objects the import had made so far and finding nothing to
# free. Paused while the package imports, as they were after. Then the objects made so far (the
# import's, mostly) go straight to the oldest generation (frozen, then unfrozen into it), where
# the first young collection would have moved them after walking all of them (0.1 s of CPU at
# every process's start); not when the process has frozen objects of its own (a pre-fork
# server): unfreezing would undo that.
# With the commands' own settings (launch.cli.freeze_imported_objects, runtime.gc_every_steps
# from the run's start) a small megajax-train job's collections took 0.95 -> 0.18 s of CPU.
_collecting = _gc.isenabled()
_gc.disable()
try:
  from megajax.checkpoint import load_params, save_params
  from megajax.config import ConfigError, default_config, load_config, validate
  from megajax.flops import training_flops_per_token
  from megajax.model import GPT, ModelConfig, count_params, init_params
  from megajax.optim import make_optimizer
  from megajax.reference_step import TrainState, init_train_state, make_loss_fn, make_reference_step
  from megajax.sampling import generate
  from megajax.trainer import TrainResult, build_model, train
finally:
  if _gc.get_freeze_count() == 0:
    _gc.freeze()
    _gc.unfreeze()
  if _collecting:
    _gc.enable()



def __getattr__(name: str):
  """megajax.scope (MegaScope's explorer: megajax.scope.serve(workdir, port)) loads on first use:
  its web stack (starlette, uvicorn, plotly) adds 0.24 s to an import no training job needs."""
  if name == "scope":
    return _importlib.import_module("megajax.launch.scope")
  raise AttributeError(f"module 'megajax' has no attribute {name!r}")


__all__ = [
    "ConfigError", "GPT", "ModelConfig", "TrainResult", "TrainState", "build_model", "count_params",
    "default_config", "generate", "init_params", "init_train_state", "load_config", "load_params", "make_loss_fn",
    "make_optimizer", "make_reference_step", "save_params", "train", "training_flops_per_token", "validate",
]
