"""The README's Python API example runs as written (it trains 8 steps on the default mesh)."""

import re

import jax.numpy as jnp

from tests.support import REPO


def test_readme_api_example(tmp_path, monkeypatch):
  """The README's Python example runs as written."""
  readme = open(f"{REPO}/README.md").read()
  example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
  monkeypatch.chdir(REPO)
  namespace = {}
  exec(compile(example.replace("/tmp/megajax-api", str(tmp_path / "api")), "README.md", "exec"), namespace)
  result = namespace["result"]
  assert int(result.state.step) == 8
  assert result.history[-1]["loss"] < result.history[0]["loss"]
  assert bool(jnp.isfinite(namespace["loss"]))
