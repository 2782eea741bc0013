"""Checkpoints: the training checkpoint (async, resumable) and parameter export/import."""

from megajax.checkpoint.manager import DataStateHandler, Restored, TrainingCheckpointer, layout_of
from megajax.checkpoint.params import load_params, save_params

__all__ = ["DataStateHandler", "Restored", "TrainingCheckpointer", "layout_of", "load_params", "save_params"]
