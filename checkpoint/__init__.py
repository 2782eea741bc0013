"""Checkpoints: the training checkpoint (async, resumable, onto any mesh) and parameter export."""

from megajax.checkpoint.integrity import CheckpointError, IntegrityError
from megajax.checkpoint.manager import DataStateHandler, Restored, TrainingCheckpointer, check_compatible, layout_of
from megajax.checkpoint.params import load_params, save_params

__all__ = ["CheckpointError", "DataStateHandler", "IntegrityError", "Restored", "TrainingCheckpointer", "check_compatible",
           "layout_of", "load_params", "save_params"]
