"""Config validation: every bad field is named in a one-line error with its fix, and so is
every fault of a config file."""

import re

import pytest

from megajax.config import (ATTENTION_IMPL_CHOICES, BLOCK_CHOICES, FAIL_MODES, MLP_CHOICES, NORM_CHOICES,
                            REMAT_CHOICES, ConfigError, default_config, load_config, parse_mixture,
                            validate)
from megajax.sections import section
from megajax.launch import train as train_command
from megajax.layers import (ATTENTION_FUSED, ATTENTION_IMPLS, BLOCK_FAMILIES, MLP_ACTIVATIONS, MLP_FAMILIES,
                            NORM_FAMILIES, NORM_MODULES)
from megajax.model import BLOCK_MODULES, REMAT_POLICIES
from megajax.parallel.tensor_parallel import BLOCK_FUNCTIONS
from megajax.trainer.drills import FAIL_SIGNALS
from tests.support import REPO

CONFIG_FILES = ["default", "gpt_125m", "gpt_1p3b", "gpt_13b", "gpt_175b", "gpt_530b", "cohere2"]

# (field to set, value, field the message must name)
INVALID = [
    ("model.num_heads", 5, "model.num_heads"),              # 64 hidden not divisible by 5
    ("model.num_heads", 0, "model.num_heads"),
    ("model.num_kv_heads", 3, "model.num_kv_heads"),        # 4 heads not divisible by 3
    ("model.hidden_dim", 36, "model.num_heads"),            # head dim 9 is odd (rotary)
    ("model.window", 500, "model.window"),                  # larger than seq_len
    ("model.window", -1, "model.window"),
    ("model.window_pattern", "LXG", "model.window_pattern"),
    ("model.block", "sandwich", "model.block"),
    ("model.norm", "batchnorm", "model.norm"),
    ("model.mlp", "geglu", "model.mlp"),
    ("model.attention_impl", "flash3", "model.attention_impl"),
    ("model.compute_dtype", "fp8", "model.compute_dtype"),
    ("model.remat", "some", "model.remat"),
    ("optimizer.name", "sgdm", "optimizer.name"),
    ("optimizer.learning_rate", 0.0, "optimizer.learning_rate"),       # a run that trains nothing
    ("optimizer.learning_rate", float("inf"), "optimizer.learning_rate"),  # every update skipped
    ("optimizer.learning_rate", float("nan"), "optimizer.learning_rate"),
    ("optimizer.learning_rate", -1e-3, "optimizer.learning_rate"),
    ("optimizer.eps", float("inf"), "optimizer.eps"),
    ("optimizer.b1", float("nan"), "optimizer.b1"),
    ("optimizer.weight_decay", float("inf"), "optimizer.weight_decay"),
    ("optimizer.weight_decay", -0.1, "optimizer.weight_decay"),
    ("optimizer.grad_clip_norm", float("nan"), "optimizer.grad_clip_norm"),
    ("optimizer.grad_clip_norm", float("inf"), "optimizer.grad_clip_norm"),
    ("optimizer.end_lr_ratio", float("nan"), "optimizer.end_lr_ratio"),
    ("train.z_loss", float("inf"), "train.z_loss"),
    ("model.init_std", float("nan"), "model.init_std"),
    ("model.rope_theta", float("inf"), "model.rope_theta"),
    ("model.layernorm_epsilon", -1e-5, "model.layernorm_epsilon"),
    ("supervisor.startup_timeout_s", float("inf"), "supervisor.startup_timeout_s"),
    ("optimizer.b2", 1.0, "optimizer.b2"),
    ("optimizer.warmup_steps", 500, "optimizer.warmup_steps"),
    ("train.microbatches", 3, "train.microbatches"),       # 16 not divisible by 3
    ("train.batch_size", 0, "train.batch_size"),
    ("train.steps", 0, "train.steps"),
    ("data.source", "web", "data.source"),
    ("model.mlp_dim", -8, "model.mlp_dim"),
    ("parallel.grad_sync", "bucket", "parallel.grad_sync"),
    ("parallel.dp_bucket_mb", -1.0, "parallel.dp_bucket_mb"),
    ("parallel.dp_bucket_mb", float("nan"), "parallel.dp_bucket_mb"),
    ("parallel.tp_overlap", "async", "parallel.tp_overlap"),
    ("parallel.tp_overlap_chunks", 0, "parallel.tp_overlap_chunks"),
    ("parallel.tp_overlap_chunks", 3, "parallel.tp_overlap_chunks"),  # 128-token sequence: 3 does not divide
]

# Tensor + sequence parallelism over tp=4 with one dimension that does not split.
INVALID_FOR_TP = [
    ("model.vocab_size", 257, "model.vocab_size"),
    ("model.seq_len", 130, "model.seq_len"),
    ("model.mlp_dim", 250, "model.mlp_dim"),
    ("model.num_kv_heads", 2, "model.num_kv_heads"),
    ("parallel.tp_overlap_chunks", 64, "parallel.tp_overlap_chunks"),  # 32-token shards
]


@pytest.mark.parametrize("field,value,named", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_config_names_the_field(field, value, named):
  config = default_config()
  group, name = field.split(".")
  config[group][name] = value
  with pytest.raises(ConfigError) as error:
    validate(config)
  message = str(error.value)
  assert message.startswith(named + "="), message
  assert "\n" not in message
  assert ";" in message  # problem; fix


def test_cudnn_attention_in_float32_is_refused_before_the_trace():
  """cuDNN's kernel takes half precision only; jax would raise deep inside the step's trace."""
  config = default_config()
  config.model.attention_impl = "cudnn"
  assert_refused(config, "model.compute_dtype", "float32", "model.attention_impl")


@pytest.mark.parametrize("field,value,named", INVALID_FOR_TP, ids=[f"{f}={v}" for f, v, _ in INVALID_FOR_TP])
def test_tensor_parallel_splits_are_checked(field, value, named):
  config = default_config()
  config.parallel.tp = 4
  validate(config)
  group, name = field.split(".")
  config[group][name] = value
  with pytest.raises(ConfigError) as error:
    validate(config)
  message = str(error.value)
  assert message.startswith(named + "=") and "parallel.tp" in message and "\n" not in message, message


# MegaFBD (parallel.fbd.enabled=True with a forward group of 1 x 2): what it refuses, one line each.
INVALID_FOR_FBD = [
    ("parallel.fbd.forward_tp", 3, "parallel.fbd.forward_tp"),           # heads do not split
    ("parallel.fbd.forward_dp", 0, "parallel.fbd.forward_dp"),
    ("parallel.fbd.forward_dp", 32, "parallel.fbd.forward_dp"),          # 16-row microbatch
    ("observe.perturb", "noise", "observe.perturb"),
    ("parallel.pp", 2, "parallel.pp"),
    ("observe.capture", "0:attn_probs", "observe.capture"),
    ("observe.trace_every", 10, "observe.trace_every"),
    ("debug.slow_rank", "0,0,0", "debug.slow_rank"),
]


def assert_refused(config, field: str, value, named: str):
  """`config` validates; with `field` set to `value` it fails with one line naming `named`, the problem and a fix."""
  validate(config)
  *parents, name = field.split(".")
  node = config
  for parent in parents:
    node = node[parent]
  node[name] = value
  with pytest.raises(ConfigError) as error:
    validate(config)
  message = str(error.value)
  assert message.startswith(named + "=") and "\n" not in message and ";" in message, message


@pytest.mark.parametrize("field,value,named", INVALID_FOR_FBD, ids=[f"{f}={v}" for f, v, _ in INVALID_FOR_FBD])
def test_megafbd_refuses_what_it_cannot_run(field, value, named):
  config = default_config()
  config.parallel.fbd.enabled, config.parallel.fbd.forward_tp = True, 2
  assert_refused(config, field, value, named)


# Context parallelism (cp = 2, tp = 2, a window of 16 on 128-position rows): one line each.
INVALID_FOR_CP = [
    ("parallel.cp", 0, "parallel.cp"),
    ("model.seq_len", 100, "model.seq_len"),             # not 2 * cp chunks split over tp
    ("model.window", 40, "model.window"),                # beyond one 32-position chunk + 1
    ("observe.capture", "0:residual", "observe.capture"),
    ("observe.perturb", "noise", "observe.perturb"),
    ("parallel.fbd.enabled", True, "parallel.cp"),
]


@pytest.mark.parametrize("field,value,named", INVALID_FOR_CP, ids=[f"{f}={v}" for f, v, _ in INVALID_FOR_CP])
def test_context_parallel_refuses_what_it_cannot_run(field, value, named):
  config = default_config()
  config.parallel.cp, config.parallel.tp = 2, 2
  config.model.window, config.model.window_pattern = 16, "LG"
  assert_refused(config, field, value, named)


def test_heads_must_split_over_tp():
  config = default_config()
  config.model.hidden_dim, config.parallel.tp = 96, 4
  config.model.num_heads = 6
  with pytest.raises(ConfigError, match=r"^model\.num_heads=6: not divisible by parallel\.tp=4"):
    validate(config)


def test_slow_rank_is_a_rank_of_the_mesh():
  """debug.slow_rank: "dp,pp,cp,tp" (MESH_AXES' order) or the 3-value "dp,pp,tp" (cp 0), each
  below its axis' size."""
  config = default_config()
  config.parallel.dp, config.parallel.cp, config.parallel.tp = 2, 2, 2
  for rank in ("1,0,1,1", "0,0,0,0", "1,0,1"):
    config.debug.slow_rank = rank
    validate(config)
  for rank in ("0,0,2,0", "0,1,0,0", "0,0,0,2", "2,0,0", "0,0", "0,0,0,0,0", "0,0,x,0"):
    config.debug.slow_rank = rank
    with pytest.raises(ConfigError, match=r"^debug\.slow_rank='[^']*': must be 'dp,pp,cp,tp'.*dp=2 pp=1 cp=2 tp=2"):
      validate(config)


def test_every_3d_mesh_validates():
  config = default_config()
  config.model.num_layers, config.train.batch_size, config.train.microbatches = 4, 16, 2
  for dp, pp, tp in [(8, 1, 1), (2, 2, 2), (1, 4, 1), (1, 2, 4)]:
    config.parallel.dp, config.parallel.pp, config.parallel.tp = dp, pp, tp
    validate(config)


def test_token_source_needs_an_existing_file(tmp_path):
  config = default_config()
  config.data.source = "tokens"
  config.data.path = str(tmp_path / "missing.bin")
  with pytest.raises(ConfigError, match=r"^data\.path=.*file not found"):
    validate(config)


def _token_data_config(tmp_path, **data_fields):
  """A token-data config over two tiny files a.bin and b.bin (their sidecars are not read here)."""
  for name in ("a.bin", "b.bin"):
    (tmp_path / name).write_bytes(b"\0\0")
  config = default_config()
  config.data.source = "tokens"
  config.data.path = str(tmp_path / "a.bin")
  for name, value in data_fields.items():
    config.data[name] = value
  return config


# (data fields, over two files a.bin and b.bin in tmp_path; the field and fix the message must name)
INVALID_DATA = [
    ({"source": "synthetic"}, r"^data\.path='.*a\.bin': set while data\.source='synthetic'.*--config\.data\.source=tokens$"),
    ({"source": "synthetic", "path": "", "mixture": "{a}:1"}, r"^data\.mixture=.*--config\.data\.source=tokens$"),
    ({"source": "synthetic", "path": "", "eval_path": "{b}"}, r"^data\.eval_path=.*--config\.data\.source=tokens$"),
    ({"mixture": "{a}:0.5,{b}:0.5"}, r"^data\.mixture=.*set together with data\.path"),
    ({"path": "", "mixture": "{a}:0.7,{b}"}, r"^data\.mixture=.*is not FILE:WEIGHT; write it as FILE:WEIGHT"),
    ({"path": "", "mixture": "{a}:0.7,{b}:0"}, r"^data\.mixture=.*b\.bin is 0\.0, not a finite number > 0"),
    ({"path": "", "mixture": "{a}:0.7,{b}:-1"}, r"^data\.mixture=.*not a finite number > 0"),
    ({"path": "", "mixture": "{a}:0.7,{a}:0.3"}, r"^data\.mixture=.*a\.bin is in it twice"),
    ({"path": "", "mixture": "{a}:0.7,{tmp}/c.bin:0.3"}, r"^data\.mixture=.*c\.bin is not an existing"),
    ({"path": "", "mixture": "  "}, r"^data\.mixture=.*no token files in it"),
    ({"eval_fraction": 0.5}, r"^data\.eval_fraction=0\.5: must be in \[0, 0\.5\)"),
    ({"eval_fraction": -0.1}, r"^data\.eval_fraction="),
    ({"eval_fraction": float("nan")}, r"^data\.eval_fraction="),
    ({"eval_fraction": 0.1, "eval_path": "{b}"}, r"^data\.eval_fraction=0\.1: set together with data\.eval_path"),
    ({"eval_path": "{tmp}/missing.bin"}, r"^data\.eval_path=.*file not found"),
    ({"eval_path": "{tmp}/eval.txt"}, r"^data\.eval_path=.*not a \.bin or \.npy token file"),
]


@pytest.mark.parametrize("fields,message", INVALID_DATA, ids=[str(f) for f, _ in INVALID_DATA])
def test_invalid_data_fields_are_one_line_naming_the_field_and_fix(tmp_path, fields, message):
  names = {"a": tmp_path / "a.bin", "b": tmp_path / "b.bin", "tmp": tmp_path}
  config = _token_data_config(tmp_path, **{k: v.format(**names) if isinstance(v, str) else v
                                           for k, v in fields.items()})
  with pytest.raises(ConfigError, match=message) as error:
    validate(config)
  assert "\n" not in str(error.value)


def test_valid_data_fields_and_document_masking(tmp_path):
  config = _token_data_config(tmp_path, eval_fraction=0.01)
  validate(config)
  assert section(config, "data").packs_documents
  config.data.document_masking = False
  assert not section(config, "data").packs_documents
  config = _token_data_config(tmp_path, path="", mixture=f"{tmp_path}/a.bin:0.7, {tmp_path}/b.bin:0.3",
                              eval_path=str(tmp_path / "b.bin"))
  validate(config)
  assert parse_mixture(config.data.mixture) == [(f"{tmp_path}/a.bin", 0.7), (f"{tmp_path}/b.bin", 0.3)]
  default = default_config()
  assert default.data.source == "synthetic" and default.data.document_masking and not section(default, "data").packs_documents


def test_evaluating_token_data_needs_eval_data(tmp_path):
  config = _token_data_config(tmp_path)
  with config.train.unlocked():
    config.train.eval_every = 50
  with pytest.raises(ConfigError, match=r"^data\.eval_path='': train\.eval_every=50 evaluates.*eval_fraction=0\.01$"):
    validate(config)
  config.data.eval_fraction = 0.01
  validate(config)


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_files_validate(name):
  config = load_config(f"{REPO}/configs/{name}.py")
  assert config.model.num_layers >= 1


def test_the_gpt_shapes_are_one_file_and_the_old_names_still_load():
  """configs/gpt.py:<shape> (big_vision's get_config(arg)); configs/gpt_<shape>.py is the same
  config; an unknown shape is one line naming the shapes."""
  shapes = ("125m", "1p3b", "13b", "175b", "530b")
  for shape in shapes:
    config = load_config(f"{REPO}/configs/gpt.py:{shape}")
    assert config.to_json() == load_config(f"{REPO}/configs/gpt_{shape}.py").to_json(), shape
  assert load_config(f"{REPO}/configs/gpt.py:1p3b").model.num_layers == 24
  with pytest.raises(ConfigError) as error:
    load_config(f"{REPO}/configs/gpt.py:7b")
  message = str(error.value)
  assert "\n" not in message and "no shape '7b'" in message and all(shape in message for shape in shapes)


def test_the_family_presets_are_one_file_and_their_old_names_still_load():
  """configs/families.py:<family>; configs/cohere2.py is the same config as its cohere2; an
  unknown family is one line naming the families."""
  families = ("cohere2", "llama", "qwen2")
  for family in families:
    config = load_config(f"{REPO}/configs/families.py:{family}")
    assert config.model.mlp == "swiglu" and config.model.tie_embeddings, family
  assert load_config(f"{REPO}/configs/cohere2.py").to_json() == load_config(f"{REPO}/configs/families.py:cohere2").to_json()
  assert load_config(f"{REPO}/configs/families.py:qwen2").model.qkv_bias
  with pytest.raises(ConfigError) as error:
    load_config(f"{REPO}/configs/families.py:gemma")
  message = str(error.value)
  assert "\n" not in message and "no family 'gemma'" in message and all(family in message for family in families)


def test_paper_table1_shapes():
  c175 = load_config(f"{REPO}/configs/gpt_175b.py")
  assert (c175.model.num_layers, c175.model.hidden_dim, c175.model.num_heads) == (96, 12288, 128)
  assert (c175.parallel.tp, c175.parallel.pp, c175.model.seq_len, c175.model.vocab_size) == (8, 8, 2048, 64000)
  c530 = load_config(f"{REPO}/configs/gpt_530b.py")
  assert (c530.model.num_layers, c530.model.hidden_dim, c530.model.num_heads) == (105, 20480, 160)
  assert (c530.parallel.tp, c530.parallel.pp) == (8, 35)


def test_load_config_overrides_and_rejects_unknown_fields():
  config = load_config(f"{REPO}/configs/default.py", {"model.num_layers": 8})
  assert config.model.num_layers == 8
  with pytest.raises(ConfigError, match=r"^model\.num_layer="):
    load_config(f"{REPO}/configs/default.py", {"model.num_layer": 3})


def test_every_name_a_choice_field_accepts_is_implemented():
  """The config's *_CHOICES, the family rows (megajax.layers.families) and the registries that
  implement them hold the same names."""
  assert set(BLOCK_CHOICES) == set(BLOCK_FAMILIES) == set(BLOCK_MODULES) == set(BLOCK_FUNCTIONS)
  assert set(REMAT_CHOICES) == set(REMAT_POLICIES) | {"none"}
  assert set(ATTENTION_IMPL_CHOICES) == set(ATTENTION_FUSED) == set(ATTENTION_IMPLS)
  assert set(NORM_CHOICES) == set(NORM_FAMILIES) == set(NORM_MODULES)
  assert set(MLP_CHOICES) == set(MLP_FAMILIES) == set(MLP_ACTIVATIONS)
  assert set(FAIL_MODES) == set(FAIL_SIGNALS)


# Every way a config file can fail to give a config: (file text or None for no file, what the
# one line must say besides the file's name).
CONFIG_FILE_FAULTS = {
    "missing": (None, "no such config file"),
    "syntax error": ("def get_config(:\n", "syntax error at line 1"),
    "get_config raises": ("def get_config():\n  raise ValueError('no such preset\\nsecond line')\n",
                          "get_config() raised ValueError: no such preset;"),
    "no get_config": ("from megajax.config import default_config\n", "defines no get_config()"),
    "import fails": ("import megajax_no_such_module\n", "loading it raised ModuleNotFoundError"),
    "returns None": ("def get_config():\n  pass\n", "get_config() returned NoneType, not a ConfigDict"),
}


@pytest.mark.parametrize("fault", CONFIG_FILE_FAULTS)
def test_config_file_faults_are_one_line_and_exit_2(fault, tmp_path, capsys):
  """What every command with --config (train, supervise, diagnose, plan) parses its flags with:
  `megajax-<cmd>: config error: config='FILE': ...`, one line, exit code 2."""
  text, expected = CONFIG_FILE_FAULTS[fault]
  path = tmp_path / "experiment.py"
  if text is not None:
    path.write_text(text)
  with pytest.raises(ConfigError, match=r"^config='.*experiment\.py': " + re.escape(expected)):
    load_config(str(path))
  with pytest.raises(SystemExit) as exit:
    train_command.parse_flags(["megajax-train", "--config", str(path), f"--workdir={tmp_path}/run"])
  assert exit.value.code == 2
  stderr = capsys.readouterr().err
  assert stderr.startswith(f"megajax-train: config error: config='{path}': ") and expected in stderr, stderr
  assert stderr.count("\n") == 1 and "Traceback" not in stderr
  assert not (tmp_path / "run").exists()
