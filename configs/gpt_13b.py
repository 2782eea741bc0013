r"""MegaScale's 13B convergence model: configs/gpt.py's "13b" shape, under its old name (the same config as
--config=configs/gpt.py:13b, the spelling to use; the shapes and their notes are there)."""

import os

from megajax.config_checks import read_config_file


def get_config():
  return read_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.py"), "13b")
