r"""A small Cohere2-shaped model: configs/families.py's "cohere2" (the same config as
--config=configs/families.py:cohere2; the families and their notes are there).

  megajax-train --config=configs/cohere2.py --workdir=/tmp/cohere2
  megajax-export-hf --workdir=/tmp/cohere2 --out=/tmp/cohere2-hf     # Cohere2ForCausalLM
"""

import os

from megajax.config_checks import read_config_file


def get_config():
  return read_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "families.py"), "cohere2")
