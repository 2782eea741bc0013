"""The memory check before anything compiles (megajax.parallel.planner.fits): a model that
cannot fit its devices is one ConfigError line with the estimate and the device's memory,
raised before the workdir or any compile; every config in configs/ passes on its intended
hardware, and the tests' tiny configs on CPU."""

import os
import time

import jax
import pytest

from megajax.config import CONFIGS_DIR, ConfigError, default_config, load_config
from megajax.parallel.planner import HARDWARE, memory
from megajax.parallel.planner.cost_model import GB
from megajax.parallel.planner.fits import check_fits, device_memory, estimate, refuse_or_warn
from megajax.trainer import train

# Each config on the hardware it is meant for: its own mesh where the file sets one (175B,
# 530B), the docs' recipe (13B: 4 x 8 GPUs, docs/robust-training.md; its tp=8 alone would run
# microbatches of 128 sequences), else one node of 8 as data parallelism. 125M on 8 GPUs needs a fused attention (cudnn, as on a GPU one runs it):
# XLA's unfused attention keeps fp32 scores of 32 sequences x 12 heads x 2048^2 per layer,
# about 240 GB per device, which is refused, and rightly.
INTENDED = [
    ("gpt_125m", {"parallel.dp": 8, "model.attention_impl": "cudnn"}, "a100-80g"),
    ("gpt_1p3b", {"parallel.dp": 8}, "a100-80g"),
    ("gpt_13b", {"parallel.dp": 4}, "a100-80g"),
    ("gpt_175b", {}, "a100-80g"),                                              # 64 GPUs
    ("gpt_175b", {"parallel.dp": 4, "train.microbatches": 192}, "a100-80g"),   # 256 GPUs, Table 2
    ("gpt_530b", {}, "a100-80g"),                                              # 280 GPUs
]
# XLA's allocator takes 75% of a GPU's memory by default; these configs are run with
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 (docs/launch.md), the bytes_limit a job then sees.
MEMORY_FRACTION = 0.92


@pytest.mark.parametrize("name,overrides,hardware", INTENDED, ids=[f"{n} {o}" for n, o, _ in INTENDED])
def test_configs_fit_their_intended_hardware(name, overrides, hardware):
  config = load_config(os.path.join(CONFIGS_DIR, f"{name}.py"), overrides)
  needed = estimate(config, "gpu")
  bytes_limit = MEMORY_FRACTION * HARDWARE[hardware].memory_gb * GB
  refuse_or_warn(needed, bytes_limit, f"{hardware}: bytes_limit")        # raises if refused


@pytest.mark.parametrize("field,value", [("model.hidden_dim", 1_000_000), ("model.vocab_size", 100_000_000)])
def test_a_model_that_cannot_fit_is_one_line_before_the_workdir(field, value, tiny_config, tmp_path):
  group, name = field.split(".")
  tiny_config[group][name] = value
  devices = jax.devices()[:1]
  have, where = device_memory(devices)
  start = time.perf_counter()
  with pytest.raises(ConfigError) as error:
    train(tiny_config, str(tmp_path / "run"), devices=devices)
  assert time.perf_counter() - start < 5       # arithmetic, nothing materialized
  message = str(error.value)
  assert message.startswith("memory per device='") and "\n" not in message, message
  estimated = float(message.split("'")[1].split(" GB")[0].replace(",", ""))
  assert estimated * GB > have
  assert f"{have / GB:,.1f} GB a device has ({where})" in message, message
  assert not (tmp_path / "run").exists()


def test_tiny_configs_fit_on_cpu(tiny_config):
  check_fits(tiny_config, jax.devices()[:1])
  default = load_config(os.path.join(CONFIGS_DIR, "default.py"))
  assert check_fits(default, jax.devices()).total < 100e6


def test_cpu_memory_is_shared_by_the_devices():
  one, where = device_memory(jax.devices()[:1])
  eight, _ = device_memory(jax.devices()[:8])
  assert one == pytest.approx(8 * eight) and "CPU" in where


def test_over_the_device_is_refused_unless_forced(caplog):
  """Over 1x the device's memory by the estimate: one line with the estimate, the ratio and the
  ways out; train.force_memory=True runs it anyway, with a warning. Fitting by less than
  the estimate's margin (its held-out errors lean negative): a warning."""
  needed = estimate(default_config(), "cpu")
  refuse_or_warn(needed, needed.total * (1 + memory.ESTIMATE_MARGIN), "test")     # fits with the margin: nothing said
  assert not caplog.text
  refuse_or_warn(needed, needed.total, "test")           # exactly fits: inside the estimate's error, said
  assert "fits by less than the estimate's error" in caplog.text
  caplog.clear()
  with pytest.raises(ConfigError, match=r"^memory per device='.* GB estimated, .* of it .*': 1.20 x the .* a device "
                                        r"has \(test\); use .* or --config.train.force_memory=true to run anyway$"):
    refuse_or_warn(needed, needed.total / 1.2, "test")
  refuse_or_warn(needed, needed.total / 1.2, "test", force=True)
  assert "running anyway (train.force_memory)" in caplog.text


def test_the_estimate_follows_the_grad_sync_the_config_trains_with():
  """parallel.grad_sync="step" holds full fp32 gradient sums per device, "microbatch" does not:
  the memory check estimates the mode the config asks for."""
  config = default_config()
  config.parallel.dp, config.train.microbatches = 2, 4
  by_mode = {}
  for mode in ("step", "microbatch"):
    config.parallel.grad_sync = mode
    by_mode[mode] = estimate(config, "gpu").total
  assert by_mode["step"] > by_mode["microbatch"]
