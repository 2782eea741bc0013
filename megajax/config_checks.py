"""What every section of megajax.config checks with: `ConfigError`, whose message is one line
(`field=value: problem; fix`), the checks that raise it, and the config file itself
(`read_config_file`: each way a file can fail to give a config is one ConfigError)."""

from __future__ import annotations

import importlib.util
import math
import os

import ml_collections


class ConfigError(ValueError):
  """A config field has a bad value. `str(error)` is one line: field, problem, fix."""

  def __init__(self, field: str, value, problem: str, fix: str):
    self.field = field
    super().__init__(f"{field}={value!r}: {problem}; {fix}")


def require(ok: bool, field: str, value, problem: str, fix: str) -> None:
  if not ok:
    raise ConfigError(field, value, problem, fix)


def _value(config, field: str):
  for name in field.split("."):     # "section.field", or deeper: "parallel.fbd.forward_dp"
    config = config[name]
  return config


def finite(value) -> bool:
  """A real number that is neither inf nor nan (bools are not numbers here)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(config, field: str) -> None:
  value = _value(config, field)
  require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, field, value,
          "must be a positive integer", f"set --config.{field} to 1 or more")


def non_negative_int(config, field: str) -> None:
  value = _value(config, field)
  require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, field, value,
          "must be an integer >= 0", f"set --config.{field} to 0 or more")


def positive_number(config, field: str) -> None:
  value = _value(config, field)
  require(finite(value) and value > 0, field, value, "must be a finite number > 0",
          f"set --config.{field} to a value > 0")


def non_negative_number(config, field: str, fix: str) -> None:
  value = _value(config, field)
  require(finite(value) and value >= 0, field, value, "must be a finite number >= 0", fix)


def boolean(config, field: str) -> None:
  value = _value(config, field)
  require(isinstance(value, bool), field, value, "must be True or False", f"set --config.{field}=true or false")


def choice(config, field: str, choices) -> None:
  value = _value(config, field)
  require(value in choices, field, value, "unknown name", f"choose one of {', '.join(choices)}")


def nearest_divisor(n: int, near: int) -> int:
  """The divisor of n closest to `near` (the larger on a tie): what an error suggests instead."""
  divisors = [k for k in range(1, n + 1) if n % k == 0]
  return min(divisors, key=lambda k: (abs(k - near), -k))


# --- The config file ----------------------------------------------------------------------------

def read_config_file(path: str, argument: str | None = None) -> ml_collections.ConfigDict:
  """`get_config()` (or `get_config(argument)`: ml_collections' `file.py:argument`) of a config
  file. A missing file, a syntax error, an exception while loading it or inside get_config, no
  get_config, or one returning something else than a ConfigDict: a ConfigError naming the
  file and, for an exception, its type and the first line of its message."""
  fix = "fix the file (configs/default.py is an example)"
  if not os.path.isfile(path):
    raise ConfigError("config", path, "no such config file", "pass a path such as configs/default.py")
  try:
    with open(path, encoding="utf-8") as f:
      code = compile(f.read(), path, "exec")
  except SyntaxError as error:
    raise ConfigError("config", path, f"syntax error at line {error.lineno}: {error.msg}", fix) from None
  except (OSError, ValueError) as error:       # unreadable, or not text
    raise ConfigError("config", path, f"cannot be read: {one_line(error)}", fix) from None
  spec = importlib.util.spec_from_file_location("megajax_user_config", path)
  module = importlib.util.module_from_spec(spec)
  try:
    exec(code, module.__dict__)
  except Exception as error:                   # the file's own code: anything can go wrong in it
    raise ConfigError("config", path, f"loading it raised {one_line(error)}", fix) from None
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise ConfigError("config", path, "defines no get_config()",
                      "define get_config() returning the config, as configs/default.py does")
  try:
    config = get_config() if argument is None else get_config(argument)
  except Exception as error:
    raise ConfigError("config", path, f"get_config() raised {one_line(error)}", fix) from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError("config", path, f"get_config() returned {type(config).__name__}, not a ConfigDict",
                      "return megajax.config.default_config() with your changes, as configs/default.py does")
  return config


def one_line(error: BaseException) -> str:
  """`Type: the first non-empty line of its message` (just the type when it has none)."""
  first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
  return f"{type(error).__name__}: {first}" if first else type(error).__name__
