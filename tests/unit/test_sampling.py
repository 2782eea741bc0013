"""megajax.sampling: the KV cache decodes exactly what the full forward computes, at every
position (windows shorter than the generation, GQA, both paddings, every block kind), a local
layer's cache does not grow with the generation, the sampling knobs, the tp mesh, the errors,
and a run's files (megajax.launch.run_files) that megajax-sample reads."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax import sampling as gen
from megajax.config import ConfigError, load_config, read_run_config
from megajax.launch.run_files import run_config, run_params, workdir_tokenizer
from megajax.model import GPT, ModelConfig, init_params
from megajax.tokenizer import ByteTokenizer


def _model(tiny_config, **fields):
  tiny_config.model.update({"num_layers": 3, "window": 4, "window_pattern": "LG", "num_kv_heads": 2, **fields})
  config = ModelConfig.from_config(tiny_config.model)
  return config, init_params(GPT(config), jax.random.key(1))


def _full_forward_logits(params, config, prompt, new):
  """The logits each new token was drawn from, by the full forward of prompt + new tokens."""
  sequence = jnp.asarray([list(prompt) + list(new)], jnp.int32)
  logits = GPT(dataclasses.replace(config, remat="none")).apply({"params": params}, sequence)[0]
  return np.asarray(logits[len(prompt) - 1: len(prompt) - 1 + len(new)])


CASES = [  # (the model's block family, the prompts' padding)
    ({"block": "parallel"}, "left"), ({"block": "parallel"}, "right"), ({"block": "serial"}, "right"),
    ({"block": "parallel_two_norms"}, "left"),
    ({"block": "serial", "norm": "rmsnorm", "mlp": "swiglu", "use_bias": False}, "left"),   # Llama / Mistral
]


@pytest.mark.parametrize("fields, padding", CASES, ids=lambda c: "-".join(str(v) for v in c.values())
                         if isinstance(c, dict) else c)
def test_cached_decoding_equals_the_full_forward_at_every_position(tiny_config, fields, padding):
  """Greedy decoding of 20 tokens (5x the window) for prompts of different lengths: each step's
  logits equal the full forward's at that position, so the tokens are identical (past the
  model's seq_len too: the cache's mechanics, allowed explicitly)."""
  config, params = _model(tiny_config, **fields)
  prompts = [[3, 9, 1, 7, 2, 8, 5], [11, 4]]
  tokens, mask = gen.pad_prompts(prompts, padding=padding)
  new, logits = gen.generate(params, config, tokens, 20, temperature=0, prompt_mask=mask, with_logits=True,
                             allow_past_seq_len=True)
  assert new.shape == (2, 20) and logits.shape == (2, 20, config.vocab_size)
  for row, prompt in enumerate(prompts):
    reference = _full_forward_logits(params, config, prompt, new[row])
    np.testing.assert_allclose(logits[row], reference, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(new[row], reference.argmax(-1))


def test_a_local_layers_cache_is_its_window_whatever_the_generated_length(tiny_config):
  config, params = _model(tiny_config)
  tokens, mask = gen.pad_prompts([[1, 2, 3]])
  for max_len in (16, 512):
    state = jax.eval_shape(lambda: gen._prefill(params, tokens, mask, config, max_len))
    shapes = {name: layer["attention"]["key"].shape for name, layer in state.cache.items()}
    assert shapes == {"layer_0": (1, 4, 2, 8), "layer_1": (1, max_len, 2, 8), "layer_2": (1, 4, 2, 8)}


def test_sampling_knobs(tiny_config):
  config, params = _model(tiny_config)
  prompts = [[5, 6, 7], [1]]
  greedy = gen.generate(params, config, prompts, 12, temperature=0)
  np.testing.assert_array_equal(gen.generate(params, config, prompts, 12, temperature=1.0, top_k=1, seed=4), greedy)
  np.testing.assert_array_equal(gen.generate(params, config, prompts, 12, temperature=1.0, top_p=1e-6, seed=4), greedy)
  drawn = gen.generate(params, config, prompts, 12, temperature=1.5, seed=4)
  np.testing.assert_array_equal(gen.generate(params, config, prompts, 12, temperature=1.5, seed=4), drawn)
  assert not np.array_equal(gen.generate(params, config, prompts, 12, temperature=1.5, seed=5), drawn)
  # Chunked as megajax-sample streams it: the same draws (each token's key is its index's).
  chunks = list(gen.stream(params, config, prompts, 12, temperature=1.5, seed=4, chunk=6))
  assert [c.shape[1] for c in chunks] == [6, 6]
  np.testing.assert_array_equal(np.concatenate(chunks, axis=1), drawn)
  # top_k keeps the k most likely: every draw is among the full forward's top 3 there.
  drawn = gen.generate(params, config, prompts[:1], 6, temperature=2.0, top_k=3, seed=1)[0]
  top3 = np.argsort(_full_forward_logits(params, config, prompts[0], drawn), axis=-1)[:, -3:]
  assert all(token in top for token, top in zip(drawn, top3))
  # A row that samples eos_id repeats it.
  eos = int(greedy[0, 2])
  after = gen.generate(params, config, prompts[:1], 12, temperature=0, eos_id=eos)[0]
  assert list(after[:3]) == list(greedy[0, :3]) and set(after[3:]) == {eos}


def test_tp_mesh_splits_the_heads_and_decodes_the_same(tiny_config):
  config, params = _model(tiny_config)
  prompts = [[5, 6, 7, 8], [1, 2]]
  single, single_logits = gen.generate(params, config, prompts, 10, temperature=0, with_logits=True)
  mesh = gen.tp_mesh(2)
  placed, _ = gen._mesh_shardings(params, config, mesh)
  assert placed["layer_0"]["attention"]["query"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
  assert placed["layer_0"]["mlp"]["wo"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("tp", None)
  split, split_logits = gen.generate(params, config, prompts, 10, temperature=0, mesh=mesh, with_logits=True)
  np.testing.assert_array_equal(split, single)
  np.testing.assert_allclose(split_logits, single_logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens=0: must be a positive integer"),
    ({"temperature": -1}, "temperature=-1.0: must be >= 0"),
    ({"top_k": 1000}, "top_k=1000: must be between 0 and the vocabulary (64)"),
    ({"top_p": 0}, "top_p=0.0: must be in (0, 1]"),
    ({"prompts": [[1, 2], []]}, "prompts=[1]: has no token"),
    ({"prompts": [[1, 70]]}, "prompts[0][1]=70: is not a token id of the model's vocabulary [0, 64)"),
    ({"mesh": "tp3"}, "mesh=tp=3: does not divide model.num_heads=4"),
])
def test_bad_arguments_are_one_line_naming_them(tiny_config, kwargs, message):
  config, params = _model(tiny_config)
  arguments = {"prompts": [[1, 2]], "max_new_tokens": 4, **kwargs}
  if arguments.get("mesh") == "tp3":
    arguments["mesh"] = gen.tp_mesh(3)
  with pytest.raises(gen.GenerationError) as error:
    gen.generate(params, config, **arguments)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_load_config_reads_a_workdir_or_its_config_json(tmp_path, tiny_config):
  tiny_config.model.num_layers = 3
  (tmp_path / "config.json").write_text(tiny_config.to_json())
  assert load_config(str(tmp_path)).model.num_layers == 3
  assert load_config(str(tmp_path / "config.json"), {"model.num_layers": 5}).model.num_layers == 5
  with pytest.raises(ConfigError, match="not found; pass a run's workdir"):
    read_run_config(str(tmp_path / "missing"))
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ConfigError, match="unreadable"):
    load_config(str(tmp_path / "bad.json"))


def test_a_runs_params_are_the_newest_of_its_export_and_its_checkpoints(two_checkpoints):
  """megajax-sample's and megajax-export-hf's source: WORKDIR/params once training ended, the
  latest checkpoint (restored on one device, out of the step's layout) when it is newer."""
  workdir, config, _ = two_checkpoints
  exported, source = run_params(str(workdir), run_config(str(workdir)))
  assert source == str(workdir / "params")
  shutil.rmtree(workdir / "params")
  restored, source = run_params(str(workdir), run_config(str(workdir)))
  assert source == str(workdir / "checkpoints" / "6")
  jax.tree.map(np.testing.assert_array_equal, restored, exported)
  assert isinstance(workdir_tokenizer(str(workdir)), ByteTokenizer)


def test_sampling_past_seq_len_is_refused_with_a_global_layer_unless_allowed(tiny_config, caplog):
  """Global layers past model.seq_len attend over distances training never saw: refused with one
  line (how many tokens fit, how to allow it); allowed, a warning. Every layer local: fine (a
  rotary model sees only offsets, never more than its window)."""
  config, params = _model(tiny_config)            # layers L G L, seq_len 16
  prompt = [[3, 9, 1, 7]]
  assert gen.generate(params, config, prompt, 12, temperature=0).shape == (1, 12)     # to position 16: fine
  with pytest.raises(gen.GenerationError, match=r"^max_new_tokens=13: .* reach position 17, past the "
                                                r"model.seq_len=16 .*; ask for at most 12 new tokens, or allow it"):
    gen.generate(params, config, prompt, 13, temperature=0)
  with caplog.at_level("WARNING"):
    assert gen.generate(params, config, prompt, 13, temperature=0, allow_past_seq_len=True).shape == (1, 13)
  assert "past model.seq_len=16" in caplog.text
  local, local_params = _model(tiny_config, window_pattern="L")
  assert gen.past_seq_len_ok(local) and not gen.past_seq_len_ok(config)
  assert gen.generate(local_params, local, prompt, 30, temperature=0).shape == (1, 30)
