"""What every section of megajax.config checks with: `ConfigError`, whose message is one line
(`field=value: problem; fix`), and the checks that raise it."""

from __future__ import annotations


class ConfigError(ValueError):
  """A config field has a bad value. `str(error)` is one line: field, problem, fix."""

  def __init__(self, field: str, value, problem: str, fix: str):
    self.field = field
    super().__init__(f"{field}={value!r}: {problem}; {fix}")


def require(ok: bool, field: str, value, problem: str, fix: str) -> None:
  if not ok:
    raise ConfigError(field, value, problem, fix)


def _value(config, field: str):
  group, name = field.split(".")
  return config[group][name]


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
  require(isinstance(value, (int, float)) and value > 0, field, value, "must be a positive number",
          f"set --config.{field} to a value > 0")


def choice(config, field: str, choices) -> None:
  value = _value(config, field)
  require(value in choices, field, value, "unknown name", f"choose one of {', '.join(choices)}")


def nearest_divisor(n: int, near: int) -> int:
  """The divisor of n closest to `near` (the larger on a tie): what an error suggests instead."""
  divisors = [k for k in range(1, n + 1) if n % k == 0]
  return min(divisors, key=lambda k: (abs(k - near), -k))
