"""Checkpoints: the training checkpoint (async, resumable, onto any mesh), parameter export,
a fresh state from saved parameters (train.init_params), Hugging Face files (huggingface.py)."""

from megajax.checkpoint.hf_architectures import HfFormatError
from megajax.checkpoint.huggingface import export_hf, import_hf
from megajax.checkpoint.integrity import CheckpointError, IntegrityError
from megajax.checkpoint.manager import DataStateHandler, Restored, TrainingCheckpointer, check_compatible, layout_of
from megajax.checkpoint.params import load_params, save_params
from megajax.checkpoint.reshard import initial_state

__all__ = ["CheckpointError", "DataStateHandler", "HfFormatError", "IntegrityError", "Restored", "TrainingCheckpointer",
           "check_compatible", "export_hf", "import_hf", "initial_state", "layout_of", "load_params", "save_params"]
