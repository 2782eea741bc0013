"""megajax-scope in a real browser: Debian's Chromium, headless, driven by Selenium through its
ChromeDriver, on a tiny trained run served by the explorer on 127.0.0.1.

Needs the packages chromium and chromium-driver (the README's test command installs them:
tests/support/install_browser.sh); without them these tests fail and say so. Screenshots go
to $MEGAJAX_SCOPE_SCREENSHOTS when set (docs/images/ holds the ones docs/scope.md shows)."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

import megajax
from megajax.launch.scope.server import listening_socket, server
from megajax.model import ModelConfig
from megajax.sampling import generate
from megajax.tokenizer import ByteTokenizer
from tests.support.processes import child_env, run_module

pytestmark = pytest.mark.e2e

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TINY = {"model.num_layers": 3, "model.hidden_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.seq_len": 64, "model.vocab_size": 256, "model.window": 16, "model.window_pattern": "LLG",
        "train.batch_size": 8, "train.steps": 30, "checkpoint.every_steps": 0, "train.log_every": 10,
        "observe.capture": "*:residual", "parallel.dp": 1, "parallel.pp": 1, "parallel.tp": 1,
        "parallel.virtual_stages": 1}
NEW = 8
WAIT_S = 120         # generous: a loaded 2-core machine compiles the decode step in the first request


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("scope") / "run")
  megajax.train(megajax.load_config("configs/default.py", TINY), workdir=workdir, devices=jax.devices()[:1])
  return workdir


class _Served:
  """An explorer served on a free 127.0.0.1 port in a thread of this process."""

  def __init__(self, workdir: str):
    sock = listening_socket(0)
    self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    self.server = server(workdir, sock)
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + WAIT_S
    while not self.server.started:
      assert time.monotonic() < deadline and self.thread.is_alive(), "the explorer did not start"
      time.sleep(0.05)

  def request(self, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    try:
      with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data), timeout=WAIT_S) as reply:
        return reply.status, json.loads(reply.read().decode().splitlines()[-1])
    except urllib.error.HTTPError as error:
      return error.code, json.loads(error.read())

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(run):
  explorer = _Served(run)
  yield explorer
  explorer.stop()


@pytest.fixture(scope="module")
def browser():
  missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
  assert not missing, (f"{', '.join(missing)} missing: install Debian's chromium and chromium-driver "
                       "(sh tests/support/install_browser.sh, which the README's test command runs)")
  os.environ.setdefault("SE_OFFLINE", "true")      # Selenium Manager: never download a driver
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                   "--window-size=1280,900", "--lang=en-US"):
    options.add_argument(argument)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
  driver.set_script_timeout(WAIT_S)
  yield driver
  driver.quit()


def _wait(driver, condition, what: str):
  from selenium.webdriver.support.ui import WebDriverWait
  return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: condition(d), message=what)


def _css(driver, selector):
  from selenium.webdriver.common.by import By
  return driver.find_elements(By.CSS_SELECTOR, selector)


def _drawn(driver, chart_id: str) -> bool:
  return bool(_css(driver, f"#{chart_id} .main-svg"))


def _set(driver, element_id: str, value) -> None:
  driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                        "e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change'));",
                        element_id, str(value))


def _severe_console_entries(driver) -> list:
  return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _screenshot(driver, name: str) -> None:
  folder = os.environ.get("MEGAJAX_SCOPE_SCREENSHOTS")
  if folder:
    os.makedirs(folder, exist_ok=True)
    driver.save_screenshot(os.path.join(folder, f"scope-{name}.png"))


def _open(driver, served) -> None:
  driver.get(served.url + "/")
  _wait(driver, lambda d: len(_css(d, "#layer option")) == 3 and len(_css(d, "#head option")) == 4,
        "the page filled its layer and head choices from /api/info")


def _decode(driver, prompt: str, new: int = NEW) -> None:
  _set(driver, "prompt", prompt)
  _set(driver, "max-tokens", new)
  _css(driver, "#generate")[0].click()
  _wait(driver, lambda d: d.find_element("id", "status").text.startswith("done"), "decoding finished")


def test_the_page_decodes_token_by_token_and_shows_the_model_inside(run, served, browser):
  _open(browser, served)
  _decode(browser, "The quick brown fox")
  # The same tokens as megajax.generate (greedy) on the run's own parameters, in decode order.
  params = megajax.load_params(os.path.join(run, "params"))
  model = ModelConfig.from_config(megajax.load_config("configs/default.py", TINY).model)
  ids = list(ByteTokenizer().encode("The quick brown fox"))
  expected = generate(params, model, [ids], NEW, temperature=0.0)[0]
  spans = _css(browser, "#tokens .token")
  assert [int(span.get_attribute("data-step")) for span in spans] == list(range(NEW))
  assert [int(span.get_attribute("data-id")) for span in spans] == expected.tolist()
  for chart in ("topk-chart", "attention-chart", "pca-chart", "heatmap-q", "heatmap-k", "heatmap-v",
                "heatmap-attn_out", "heatmap-mlp_out", "heatmap-residual"):
    _wait(browser, lambda d, c=chart: _drawn(d, c), f"#{chart} drawn")
  # Another layer and head: the attention map is computed for them, on request.
  _set(browser, "layer", 2)
  _set(browser, "head", 3)
  _wait(browser, lambda d: "layer 2 head 3" in d.find_element("id", "attention-chart").text, "the map redrawn")
  assert "global" in browser.find_element("id", "attention-chart").text
  _set(browser, "timeline", 3)
  _wait(browser, lambda d: bool(_css(d, "#tokens .token.selected")), "a step selected on the timeline")
  _screenshot(browser, "decode")
  assert _severe_console_entries(browser) == []


def test_the_pages_numbers_are_megajax_generates_logits(run, served, browser):
  """Read back through the page's own endpoint (fetched by the page): the distribution of
  every new token equals megajax.generate's with_logits for the same prompt and seed."""
  _open(browser, served)
  body = {"prompt": "Once upon a time", "max_new_tokens": 6, "temperature": 0.8, "top_k": 40, "top_p": 0.95,
          "seed": 5}
  reply = browser.execute_async_script(
      "const done = arguments[arguments.length - 1];"
      "fetch('/api/logits', {method: 'POST', body: JSON.stringify(arguments[0])}).then(r => r.json()).then(done);",
      body)
  params = megajax.load_params(os.path.join(run, "params"))
  model = ModelConfig.from_config(megajax.load_config("configs/default.py", TINY).model)
  ids = list(ByteTokenizer().encode(body["prompt"]))
  tokens, logits = generate(params, model, [ids], 6, 0.8, 40, 0.95, seed=5, with_logits=True)
  assert reply["prompt"] == ids and reply["tokens"] == tokens[0].tolist()
  np.testing.assert_allclose(np.array(reply["logits"], np.float32), logits[0], rtol=1e-6, atol=1e-6)


def test_a_perturbation_run_shows_where_the_decodes_diverge(served, browser):
  _open(browser, served)
  _set(browser, "prompt", "The quick brown fox")
  _set(browser, "max-tokens", NEW)
  _set(browser, "perturb-layer", 0)
  _set(browser, "perturb-kind", "noise")
  _set(browser, "perturb-value", 8)
  _css(browser, "#compare")[0].click()
  _wait(browser, lambda d: d.find_element("id", "divergence").text.strip() != "", "the comparison shown")
  assert browser.find_element("id", "divergence").text.startswith("first divergence at step")
  _wait(browser, lambda d: _drawn(d, "kl-chart"), "#kl-chart drawn")
  assert _css(browser, "#compare-perturbed .diverged")
  _screenshot(browser, "perturb")
  assert _severe_console_entries(browser) == []


def test_the_training_tab_plots_the_runs_captures(served, browser):
  _open(browser, served)
  _css(browser, "#tab-training")[0].click()
  _wait(browser, lambda d: len(_css(d, "#activation-point option")) >= 3, "the captured points listed")
  _wait(browser, lambda d: _drawn(d, "activations-chart"), "#activations-chart drawn")
  _screenshot(browser, "training")
  assert _severe_console_entries(browser) == []


@pytest.mark.parametrize("prompt, new, said", [("", 4, "prompt=''"), ("x" * 70, 4, "past the model's context")])
def test_bad_input_is_a_message_on_the_page_and_a_4xx(served, browser, prompt, new, said):
  _open(browser, served)
  _set(browser, "prompt", prompt)
  _set(browser, "max-tokens", new)
  _css(browser, "#generate")[0].click()
  _wait(browser, lambda d: said in d.find_element("id", "error").text, f"#error says {said!r}")
  status, reply = served.request("/api/generate", {"prompt": prompt, "max_new_tokens": new})
  assert status == 400 and said in reply["error"]


@pytest.mark.parametrize("path, body, status, said", [
    ("/api/inspect", {"tokens": [1, 2, 3], "layer": 9, "head": 0}, 400, "layer=9"),
    ("/api/inspect", {"tokens": [1, 2, 300], "layer": 0, "head": 0}, 400, "token=300"),
    ("/api/compare", {"prompt": "ab", "perturbation": {"layer": 0, "kind": "swap"}}, 400, "perturbation.kind='swap'"),
    ("/api/generate", {"prompt": "ab", "max_new_tokens": "many"}, 400, "max_new_tokens='many'"),
])
def test_bad_requests_are_4xx_and_the_server_keeps_serving(served, path, body, status, said):
  got, reply = served.request(path, body)
  assert got == status and said in reply["error"], reply
  assert served.request("/api/info")[0] == 200


@pytest.mark.parametrize("what", ["no parameters", "no workdir"])
def test_a_run_that_cannot_be_opened_is_a_message_not_a_traceback(run, tmp_path, browser, what):
  """The page still loads and says why; every endpoint answers 404 with that line."""
  workdir = tmp_path / "run"
  if what == "no parameters":            # trained config, but params/ and checkpoints/ gone
    workdir.mkdir()
    shutil.copy(os.path.join(run, "config.json"), workdir / "config.json")
    said = "no trained parameters"
  else:
    said = "no such directory"
  empty = _Served(str(workdir))
  try:
    for path, body in (("/api/info", None), ("/api/generate", {"prompt": "ab"}),
                       ("/api/inspect", {"tokens": [1], "layer": 0, "head": 0})):
      status, reply = empty.request(path, body)
      assert status == 404 and said in reply["error"], (path, reply)
    browser.get(empty.url + "/")
    _wait(browser, lambda d: said in d.find_element("id", "error").text, "the page says why")
  finally:
    empty.stop()


def test_the_command_serves_on_loopback_and_prints_its_url(run):
  """megajax-scope as an operator starts it: one line with the URL (127.0.0.1, a free port
  with --port=0), the page and the API there; bad flags are one line and exit 2."""
  process = subprocess.Popen([sys.executable, "-m", "megajax.launch.scope.cli", f"--workdir={run}", "--port=0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
  try:
    line = process.stdout.readline()          # printed before it serves; the process ends if it cannot
    match = re.search(r"on (http://127\.0\.0\.1:\d+/) \(this machine only\)", line)
    assert match, (line, process.poll() is not None and process.stderr.read())
    url = match.group(1)
    deadline = time.monotonic() + WAIT_S
    while True:
      try:
        with urllib.request.urlopen(url + "api/info", timeout=5) as reply:
          info = json.loads(reply.read())
        break
      except (urllib.error.URLError, ConnectionError):
        assert time.monotonic() < deadline and process.poll() is None, "megajax-scope did not answer"
        time.sleep(0.1)
    assert info["num_layers"] == 3 and [layer["kind"] for layer in info["layers"]] == ["local", "local", "global"]
    with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
      assert "MegaScope" in reply.read().decode()
  finally:
    process.terminate()
    process.wait(timeout=30)
  result = run_module(["-m", "megajax.launch.scope.cli", f"--workdir={run}", "--port=70000"])
  assert result.returncode == 2 and result.stderr.strip() == \
      "megajax-scope: flag error: --port=70000: not a port; use 1 .. 65535, or 0 for any free one", result.stderr
