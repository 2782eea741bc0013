"""Checkpoints. Today: parameter export/import; the async training checkpoint builds here."""

from megajax.checkpoint.params import load_params, save_params

__all__ = ["load_params", "save_params"]
