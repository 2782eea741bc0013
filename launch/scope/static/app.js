// MegaScope explorer: watch a GPT decode, inspect attention/activations, perturb it.
// Plain ES2020, no modules; Plotly (global) draws every chart. The JSON endpoints are
// described in the scope contract (GET /api/info, POST /api/generate|inspect|compare, ...).
"use strict";

const $ = (id) => document.getElementById(id);

const HEATMAPS = [
  ["q", "Q"], ["k", "K"], ["v", "V"],
  ["attn_out", "attention out"], ["mlp_out", "MLP out"], ["residual", "residual"],
];

// What #perturb-value means for each perturbation kind (the field sent, how it parses).
const PERTURB_FIELDS = {
  noise: { field: "std", list: false, hint: "std, e.g. 0.5", example: "0.5" },
  bitflip: { field: "rate", list: false, hint: "rate, e.g. 0.001", example: "0.001" },
  zero_heads: { field: "heads", list: true, hint: "heads, e.g. 0,1", example: "0,1" },
  mask_positions: { field: "positions", list: true, hint: "positions, e.g. 0,2", example: "0,2" },
  offset: { field: "offset", list: false, hint: "offset, e.g. 1.0", example: "1.0" },
};

const COLORS = { bar: "#93b4f5", chosen: "#f59e0b", prompt: "#b8bfcc", gen: "#2563eb", sel: "#f59e0b", bad: "#b42318" };
const PLOT_CONFIG = { responsive: true, displaylogo: false, displayModeBar: false };
const FONT = { family: "system-ui, sans-serif", size: 11 };

const state = {
  info: null,
  promptTokens: [],    // [{id, text}] of the current decode
  steps: [],           // "token" events, index = step
  doneTokens: null,    // ids from "done" (prompt + generated)
  selected: -1,        // selected decode step
  inspected: null,     // last /api/inspect reply drawn
  inspectCache: new Map(),
  inspectSeq: 0,       // drops replies of superseded inspect requests
  decoding: false,
  activations: null,   // /api/activations points, loaded on first open of the training tab
  activationsRequested: false,
};

// ---------- small helpers ----------

// Whitespace and control bytes made visible so "\n", a tab or a raw byte token does not vanish;
// other control characters read as escapes (\x01): the usual fonts lack "control pictures".
function visible(text) {
  if (text === "") return "∅";
  return text.replace(/\n/g, "⏎").replace(/\t/g, "⇥").replace(/\r/g, "\\r")
    .replace(/[\x00-\x1f\x7f]/g, (c) => `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`);
}

// Plotly renders a subset of HTML in labels, so token text is escaped for charts; a label of
// spaces only would be blank on an axis, so its spaces show as ␣.
function plotLabel(text) {
  const shown = text.trim() === "" ? visible(text).replace(/ /g, "␣") : visible(text);
  return shown.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
}

function clearError() {
  const box = $("error");
  box.textContent = "";
  box.hidden = true;
}

// The server's {"error"} text, or the HTTP status when the body is not that JSON.
async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error) return body.error;
  } catch (_) { /* not JSON */ }
  return `HTTP ${resp.status} ${resp.statusText}`.trim();
}

async function getJSON(url) {
  const resp = await fetch(url);
  if (!resp.ok) throw new Error(await errorText(resp));
  return resp.json();
}

async function postJSON(url, body) {
  const resp = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  if (!resp.ok) throw new Error(await errorText(resp));
  return resp.json();
}

function fillSelect(select, options) {
  select.replaceChildren(...options.map(([value, label]) => new Option(label, String(value))));
}

function layerLabel(layer) {
  return layer.kind === "local" ? `layer ${layer.index} (local, window ${layer.window})` : `layer ${layer.index} (global)`;
}

// Tick positions/labels for a token axis; numeric positions keep repeated tokens apart.
function tokenTicks(labels, maxTicks = 40) {
  const stride = Math.max(1, Math.ceil(labels.length / maxTicks));
  const vals = [];
  for (let i = 0; i < labels.length; i += stride) vals.push(i);
  return { tickmode: "array", tickvals: vals, ticktext: vals.map((i) => plotLabel(labels[i])), automargin: true };
}

function range(n) {
  return Array.from({ length: n }, (_, i) => i);
}

function draw(id, traces, layout) {
  const base = { font: FONT, margin: { l: 50, r: 16, t: 34, b: 40 }, autosize: true, paper_bgcolor: "rgba(0,0,0,0)" };
  return Plotly.react($(id), traces, Object.assign(base, layout), PLOT_CONFIG);
}

// ---------- run info ----------

async function loadInfo() {
  try {
    const info = await getJSON("/api/info");
    state.info = info;
    $("info-workdir").textContent = info.workdir;
    $("info-params").textContent = info.params_source;
    $("info-model").textContent = `${info.num_layers} layers · ${info.num_heads} heads · d ${info.hidden_dim} · vocab ${info.vocab_size} · seq ${info.seq_len}`;
    const layers = info.layers.map((l) => [l.index, layerLabel(l)]);
    fillSelect($("layer"), layers);
    fillSelect($("perturb-layer"), layers);
    fillSelect($("head"), range(info.num_heads).map((h) => [h, `head ${h}`]));
    fillSelect($("perturb-kind"), info.perturbations.map((k) => [k, k]));
    updatePerturbHint();
    if (!$("panel-training").hidden) loadActivations();
  } catch (err) {
    showError(`could not load /api/info: ${err.message}`);
  }
}

// ---------- decode ----------

// The generate form as the /api/generate body; empty fields take their defaults.
function readForm() {
  const num = (id, fallback) => {
    const raw = $(id).value.trim();
    return raw === "" ? fallback : Number(raw);
  };
  return {
    prompt: $("prompt").value,
    max_new_tokens: num("max-tokens", 16),
    temperature: num("temperature", 0),
    top_k: num("top-k", 0),
    top_p: num("top-p", 1),
    seed: num("seed", 0),
  };
}

function currentTokenIds() {
  if (state.doneTokens) return state.doneTokens;
  return state.promptTokens.map((t) => t.id).concat(state.steps.map((s) => s.id));
}

function resetDecode() {
  state.promptTokens = [];
  state.steps = [];
  state.doneTokens = null;
  state.selected = -1;
  state.inspected = null;
  state.inspectCache.clear();
  state.inspectSeq += 1;
  $("tokens").replaceChildren();
  $("timeline").max = "0";
  $("timeline").value = "0";
  $("timeline-label").textContent = "–";
}

// One token as a span; data-id carries the token id (tests compare ids, not rendered text).
function tokenSpan(token, className, step) {
  const span = document.createElement("span");
  span.className = className;
  span.textContent = visible(token.text);
  span.title = `${JSON.stringify(token.text)} (id ${token.id})`;
  span.dataset.id = String(token.id);
  if (step !== undefined) span.dataset.step = String(step);
  return span;
}

async function generate() {
  const body = readForm();
  resetDecode();
  state.decoding = true;
  $("generate").disabled = true;
  $("status").textContent = "starting…";
  try {
    const resp = await fetch("/api/generate", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    clearError();
    const finished = await readNdjson(resp, (event) => onDecodeEvent(event, body.max_new_tokens));
    if (!finished) $("status").textContent = `stopped after ${state.steps.length} tokens`;
  } catch (err) {
    showError(err.message);
    $("status").textContent = "failed";
  } finally {
    state.decoding = false;
    $("generate").disabled = false;
  }
}

// Reads an ndjson body line by line; returns whether a "done" line arrived.
async function readNdjson(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let done = false;
  const handle = (line) => {
    if (!line.trim()) return;
    const event = JSON.parse(line);
    if (event.type === "done") done = true;
    onEvent(event);
  };
  for (;;) {
    const { value, done: ended } = await reader.read();
    if (ended) break;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();  // a partial last line waits for the next chunk
    lines.forEach(handle);
  }
  handle(buffer + decoder.decode());
  return done;
}

function onDecodeEvent(event, maxTokens) {
  if (event.type === "prompt") {
    state.promptTokens = event.tokens;
    $("tokens").replaceChildren(...event.tokens.map((t) => tokenSpan(t, "prompt-token")));
    $("status").textContent = `decoding 0 / ${maxTokens}`;
  } else if (event.type === "token") {
    state.steps[event.step] = event;
    $("tokens").append(tokenSpan(event, "token", event.step));
    $("tokens").scrollTop = $("tokens").scrollHeight;
    $("status").textContent = `decoding ${event.step + 1} / ${maxTokens}`;
    $("timeline").max = String(event.step);
    selectStep(event.step);
  } else if (event.type === "done") {
    state.doneTokens = event.tokens;
    const ms = Number(event.per_token_ms);
    $("status").textContent = `done: ${state.steps.length} tokens, ${ms.toFixed(1)} ms/token`;
    inspect();
  } else if (event.type === "error") {
    showError(event.error);
    $("status").textContent = `failed after ${state.steps.length} tokens`;
    if (state.steps.length) inspect();  // the tokens so far are still worth a look
  }
}

// ---------- step selection & top-k ----------

function selectStep(step) {
  const event = state.steps[step];
  if (!event) return;
  state.selected = step;
  $("timeline").value = String(step);
  $("timeline-label").textContent = `${step} / ${$("timeline").max}`;
  document.querySelectorAll("#tokens .token").forEach((span) => {
    span.classList.toggle("selected", Number(span.dataset.step) === step);
  });
  drawTopk(event);
  if (state.inspected) drawInspect(state.inspected);
}

// Sequence position of the selected step's token (its query row in the attention map).
function selectedPosition() {
  const event = state.steps[state.selected];
  if (!event) return -1;
  return Number.isInteger(event.position) ? event.position : state.promptTokens.length + state.selected;
}

function drawTopk(event) {
  const topk = event.topk || [];
  const chosenIn = topk.some((t) => t.id === event.id);
  const labels = topk.map((t) => t.text);
  draw("topk-chart", [{
    type: "bar",
    orientation: "h",
    x: topk.map((t) => t.prob),
    y: range(topk.length),
    marker: { color: topk.map((t) => (t.id === event.id ? COLORS.chosen : COLORS.bar)) },
    text: topk.map((t) => t.prob.toFixed(3)),
    textposition: "auto",
    hovertemplate: "%{x:.4f}<extra></extra>",
  }], {
    title: { text: `step ${event.step}: top ${topk.length}, chose "${plotLabel(event.text)}"${chosenIn ? "" : " (not in top-k)"}`, font: { size: 12 } },
    xaxis: { title: { text: "probability" }, rangemode: "tozero" },
    yaxis: Object.assign(tokenTicks(labels), { autorange: "reversed" }),
    margin: { l: 70, r: 12, t: 30, b: 36 },
  });
}

// ---------- inspect: attention, activation heatmaps, PCA ----------

async function inspect() {
  const tokens = currentTokenIds();
  if (!tokens.length || !$("layer").value) return;
  const layer = Number($("layer").value);
  const head = Number($("head").value);
  const key = `${layer}/${head}/${tokens.length}`;
  const seq = ++state.inspectSeq;
  try {
    let data = state.inspectCache.get(key);
    if (!data) {
      data = await postJSON("/api/inspect", { tokens, layer, head });
      state.inspectCache.set(key, data);
    }
    if (seq !== state.inspectSeq) return;  // a newer request (or decode) took over
    clearError();
    state.inspected = data;
    drawInspect(data);
  } catch (err) {
    if (seq === state.inspectSeq) showError(err.message);
  }
}

function drawInspect(data) {
  drawAttention(data);
  HEATMAPS.forEach(([name, title]) => drawHeatmap(name, title, data.heatmaps[name], data.labels));
  drawPca(data);
}

// Closed staircase around the cells a local layer can see: key j for query i when i-w < j <= i.
function windowOutline(n, window) {
  const xs = [];
  const ys = [];
  for (let i = 0; i < n; i++) { xs.push(i + 0.5, i + 0.5); ys.push(i - 0.5, i + 0.5); }
  for (let i = n - 1; i >= 0; i--) {
    const left = Math.max(0, i - window + 1) - 0.5;
    xs.push(left, left);
    ys.push(i + 0.5, i - 0.5);
  }
  xs.push(xs[0]);
  ys.push(ys[0]);
  return xs.length > 1 ? { xs, ys } : null;
}

function drawAttention(data) {
  const n = data.labels.length;
  const local = data.kind === "local";
  const traces = [{
    type: "heatmap",
    z: data.attention,
    x: range(n),
    y: range(n),
    colorscale: "Viridis",
    zmin: 0,
    colorbar: { thickness: 10, len: 0.9 },
    hovertemplate: "query %{y} → key %{x}<br>weight %{z:.4f}<extra></extra>",
  }];
  if (local && data.window) {
    const outline = windowOutline(n, data.window);
    traces.push({
      type: "scatter", mode: "lines", x: outline.xs, y: outline.ys,
      line: { color: "#ffffff", width: 1.5, dash: "dot" },
      name: `window ${data.window}`, hoverinfo: "skip", showlegend: false,
    });
  }
  const row = selectedPosition();
  const shapes = row >= 0 && row < n ? [{
    type: "rect", xref: "x", yref: "y", x0: -0.5, x1: n - 0.5, y0: row - 0.5, y1: row + 0.5,
    line: { color: COLORS.sel, width: 2 },
  }] : [];
  const kind = local ? `local, window ${data.window}` : "global";
  const ticks = tokenTicks(data.labels);
  draw("attention-chart", traces, {
    title: { text: `layer ${data.layer} head ${data.head}: ${kind}`, font: { size: 13 } },
    xaxis: Object.assign({ title: { text: "key position" }, tickangle: -60, range: [-0.5, n - 0.5] }, ticks),
    yaxis: Object.assign({ title: { text: "query position" }, autorange: "reversed" }, ticks),
    shapes,
    margin: { l: 70, r: 10, t: 34, b: 70 },
  });
}

function drawHeatmap(name, title, heat, labels) {
  if (!heat) return;
  const n = heat.values.length;
  draw(`heatmap-${name}`, [{
    type: "heatmap",
    z: heat.values,
    x: range(heat.features),
    y: range(n),
    colorscale: "RdBu",
    reversescale: true,  // red positive, blue negative
    zmid: 0,
    colorbar: { thickness: 8, len: 0.9 },
    hovertemplate: "position %{y}, feature %{x}<br>%{z:.4f}<extra></extra>",
  }], {
    title: { text: `${title} (first ${heat.features} of ${heat.of} features)`, font: { size: 12 } },
    xaxis: { title: { text: "feature" } },
    yaxis: Object.assign({ autorange: "reversed" }, tokenTicks(labels, 14)),  // short chart: fewer labels
    margin: { l: 60, r: 8, t: 28, b: 34 },
  });
}

// "explained" may come as a fraction or as a percentage; both read as a percentage here.
function percent(value) {
  const v = Number(value) || 0;
  return (v <= 1 ? v * 100 : v).toFixed(1);
}

function drawPca(data) {
  const coords = data.pca.coords;  // [layer][position] -> [x, y]
  const n = data.labels.length;
  const promptLen = state.promptTokens.length || n;
  const selected = selectedPosition();
  const layerNames = coords.map((_, l) => (l === 0 ? "embedding" : `after layer ${l - 1}`));
  const traces = range(n).map((p) => {
    const generated = p >= promptLen;
    const isSel = p === selected;
    return {
      type: "scatter",
      mode: "lines+markers",
      x: coords.map((layer) => layer[p][0]),
      y: coords.map((layer) => layer[p][1]),
      name: `${p}: ${plotLabel(data.labels[p])}`,
      customdata: layerNames,
      hovertemplate: `${p}: ${plotLabel(data.labels[p])}<br>%{customdata}<extra></extra>`,
      line: { color: isSel ? COLORS.sel : generated ? COLORS.gen : COLORS.prompt, width: isSel ? 4 : generated ? 2 : 1 },
      marker: { size: coords.map((_, l) => (l === coords.length - 1 ? 8 : 4)) },
      opacity: isSel || generated ? 1 : 0.6,
      showlegend: false,
    };
  });
  // Selected trace last so it is drawn on top.
  if (selected >= 0 && selected < n) traces.push(traces.splice(selected, 1)[0]);
  const [e1, e2] = data.pca.explained;
  draw("pca-chart", traces, {
    title: {
      text: "residual stream across layers (PCA)<br><sub>embedding → last layer · grey: prompt · blue: generated · orange: selected</sub>",
      font: { size: 12 },
    },
    xaxis: { title: { text: `PC1 (${percent(e1)}%)` }, zeroline: false },
    yaxis: { title: { text: `PC2 (${percent(e2)}%)` }, zeroline: false },
    hovermode: "closest",
    margin: { l: 50, r: 16, t: 46, b: 40 },
  });
}

// ---------- perturbation compare ----------

function updatePerturbHint() {
  const spec = PERTURB_FIELDS[$("perturb-kind").value];
  $("perturb-value").placeholder = spec ? spec.hint : "value";
}

// The "perturbation" object; an empty value takes the example in the placeholder.
function readPerturbation() {
  const kind = $("perturb-kind").value;
  const perturbation = { layer: Number($("perturb-layer").value), kind };
  const spec = PERTURB_FIELDS[kind];
  if (!spec) return perturbation;
  const raw = $("perturb-value").value.trim() || spec.example;
  if (spec.list) {
    const items = raw.split(/[\s,]+/).filter(Boolean).map(Number);
    if (!items.length || !items.every(Number.isInteger)) {
      throw new Error(`${spec.field}=${raw}: not a comma list of integers; write e.g. ${spec.example}`);
    }
    perturbation[spec.field] = items;
  } else {
    const value = Number(raw);
    if (!Number.isFinite(value)) throw new Error(`${spec.field}=${raw}: not a number; write e.g. ${spec.example}`);
    perturbation[spec.field] = value;
  }
  return perturbation;
}

// #divergence holds only a result (it stays empty while a comparison runs).
async function compare() {
  $("compare").disabled = true;
  $("divergence").textContent = "";
  try {
    const body = Object.assign(readForm(), { perturbation: readPerturbation() });
    $("compare-status").textContent = "comparing…";
    const data = await postJSON("/api/compare", body);
    clearError();
    renderCompare(data);
    $("kl-chart").scrollIntoView({ block: "nearest" });  // the result may be below the fold
  } catch (err) {
    showError(err.message);
  } finally {
    $("compare-status").textContent = "";
    $("compare").disabled = false;
  }
}

// Token spans of one side; generated tokens from the divergence step on are marked.
function compareSpans(tokens, promptCount, divergedAt) {
  return tokens.map((t, i) => {
    if (i < promptCount) return tokenSpan(t, "prompt-token");
    const step = i - promptCount;
    const span = tokenSpan(t, "token", step);
    if (divergedAt !== null && step >= divergedAt) span.classList.add("diverged");
    return span;
  });
}

function renderCompare(data) {
  const kl = data.kl || [];
  const diverged = data.diverged_at === null || data.diverged_at === undefined ? null : data.diverged_at;
  // The server lists generated tokens only (prompt_tokens counts the prompt); should a list
  // ever include the prompt it is longer than the KL list, and its first tokens render as prompt.
  const promptCount = data.base.tokens.length > kl.length ? (data.prompt_tokens || 0) : 0;
  $("compare-base").replaceChildren(...compareSpans(data.base.tokens, promptCount, diverged));
  $("compare-perturbed").replaceChildren(...compareSpans(data.perturbed.tokens, promptCount, diverged));
  $("divergence").textContent = diverged === null ? "no divergence" : `first divergence at step ${diverged}`;
  drawKl(kl, diverged);
}

function drawKl(kl, diverged) {
  const shapes = diverged === null ? [] : [{
    type: "line", xref: "x", yref: "paper", x0: diverged, x1: diverged, y0: 0, y1: 1,
    line: { color: COLORS.bad, width: 2, dash: "dash" },
  }];
  const annotations = diverged === null ? [] : [{
    x: diverged, y: 1, xref: "x", yref: "paper", text: `diverged at ${diverged}`,
    showarrow: false, xanchor: "left", yanchor: "top", font: { color: COLORS.bad },
  }];
  draw("kl-chart", [{
    type: "scatter", mode: "lines+markers", x: range(kl.length), y: kl,
    line: { color: COLORS.gen }, hovertemplate: "step %{x}: KL %{y:.4g}<extra></extra>",
  }], {
    title: { text: "KL(base ‖ perturbed) of the next-token distributions per step (gap: non-finite)", font: { size: 12 } },
    xaxis: { title: { text: "decode step" }, dtick: kl.length > 30 ? undefined : 1 },
    yaxis: { title: { text: "KL (nats)" }, rangemode: "tozero" },
    shapes,
    annotations,
  });
}

// ---------- training tab: activation statistics ----------

async function loadActivations() {
  if (state.activationsRequested || !state.info) return;  // loadInfo calls again once it has info
  state.activationsRequested = true;
  if (!state.info.has_activations) {
    $("activations-note").textContent = "this run has no activations.jsonl (observe.capture was off)";
    $("activation-point").disabled = true;
    return;
  }
  $("activations-note").textContent = "loading…";
  try {
    const data = await getJSON("/api/activations");
    clearError();
    state.activations = data.points;
    const names = Object.keys(data.points).sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    fillSelect($("activation-point"), names.map((n) => [n, n]));
    $("activations-note").textContent = `${names.length} capture points`;
    drawActivations();
  } catch (err) {
    state.activationsRequested = false;  // allow a retry on the next open
    $("activations-note").textContent = "";
    showError(err.message);
  }
}

function drawActivations() {
  const name = $("activation-point").value;
  const rows = (state.activations && state.activations[name]) || [];
  const steps = rows.map((r) => r.step);
  const line = (key, color, axis, label = key) => ({
    type: "scatter", mode: "lines", name: label, x: steps, y: rows.map((r) => r[key]),
    yaxis: axis, line: { color, width: 1.6 },
  });
  draw("activations-chart", [
    line("mean", "#2563eb", "y"),
    line("std", "#16a34a", "y"),
    line("absmax", "#b42318", "y2", "absmax (right axis)"),  // absmax dwarfs mean/std, so it gets its own axis
  ], {
    title: { text: `${name}: mean, std and absmax over training steps`, font: { size: 13 } },
    xaxis: { title: { text: "step" } },
    yaxis: { title: { text: "mean / std" } },
    yaxis2: { title: { text: "absmax" }, overlaying: "y", side: "right", showgrid: false },
    legend: { orientation: "h", y: 1.02, yanchor: "bottom", x: 1, xanchor: "right" },
    margin: { l: 60, r: 60, t: 50, b: 40 },
  });
}

// ---------- tabs ----------

function showTab(name) {
  ["decode", "training"].forEach((tab) => {
    const active = tab === name;
    $(`tab-${tab}`).classList.toggle("active", active);
    $(`panel-${tab}`).hidden = !active;
  });
  // Plots drawn while their panel was hidden have the wrong size until resized.
  $(`panel-${name}`).querySelectorAll(".js-plotly-plot").forEach((div) => {
    Plotly.Plots.resize(div).catch(() => {});
  });
  if (name === "training") loadActivations();
}

// ---------- wiring ----------

function wire() {
  $("generate").addEventListener("click", generate);
  $("timeline").addEventListener("input", (e) => selectStep(Number(e.target.value)));
  $("tokens").addEventListener("click", (e) => {
    const span = e.target.closest(".token");
    if (span) selectStep(Number(span.dataset.step));
  });
  $("layer").addEventListener("change", inspect);
  $("head").addEventListener("change", inspect);
  $("perturb-kind").addEventListener("change", updatePerturbHint);
  $("compare").addEventListener("click", compare);
  $("tab-decode").addEventListener("click", () => showTab("decode"));
  $("tab-training").addEventListener("click", () => showTab("training"));
  $("activation-point").addEventListener("change", drawActivations);
}

wire();
loadInfo();
