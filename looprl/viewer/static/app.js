// looprl view: the page over /api (looprl/viewer/app.py). Plain JS, inline SVG plots.
// Overview: plots of metrics.jsonl and the config; Steps: one step's groups and their
// rollouts token by token; Compare: two steps (of one run or two) side by side. The
// overview is polled, so a run in progress fills in as it goes.
"use strict";

const POLL_MS = 3000;
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
const PLOTS = [
  {
    id: "reward",
    title: () => "Train rollouts (sampled)",
    kind: "train",
    keys: ["reward_mean", "accuracy"],
    labels: { reward_mean: "train reward", accuracy: "train success (sampled)" },
    always: true,
  },
  {
    id: "accuracy",
    title: (overview) => `Held-out success (${evalDecoding(overview)})`,
    kind: "eval",
    keys: ["accuracy"],
    labels: { accuracy: "held-out success" },
    always: true,
  },
  { id: "kl", title: "KL", kind: "train", keys: ["approx_kl", "kl"] },
  {
    id: "mismatch",
    title: "Engine vs trainer mismatch",
    kind: "train",
    keys: ["mismatch_logprob_abs_mean", "mismatch_kl_k3", "mismatch_ratio_outside_frac"],
  },
  { id: "staleness", title: "Staleness (versions)", kind: "train", keys: ["staleness_mean", "staleness_max"] },
  { id: "throughput", title: "Throughput (tokens/s)", kind: "train", keys: ["rollout_tokens_per_s", "tokens_per_s"] },
  { id: "loss", title: "Loss", kind: "train", keys: ["loss"] },
  { id: "length", title: "Response length (tokens)", kind: "train", keys: ["response_length"] },
  { id: "step-time", title: "Step time (s)", kind: "train", keys: ["step_time_s"] },
];
const FLAGS = [
  ["zero", "reward = 0", (r) => r.reward === 0],
  ["errors", "errors", (r) => r.error != null],
  ["truncated", "truncated", (r) => r.truncated],
  ["stale", "stale", (r) => r.staleness > 0],
];

const state = { runs: [], run: 0, overlay: "", extra: [], overviews: {}, banners: {} };

// ---------------------------------------------------------------- small helpers

function el(tag, props = {}, ...kids) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value == null || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const kid of kids.flat()) if (kid != null && kid !== false) node.append(kid);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function duration(seconds) {
  if (seconds < 120) return `${Math.max(0, Math.round(seconds))} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)} h`;
  return `${Math.round(seconds / 86400)} days`;
}

function fmt(value) {
  if (value == null) return "—";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  if (Math.abs(value) >= 1000) return value.toFixed(0);
  return String(Number(value.toPrecision(4)));
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-cache" });
  let body;
  try {
    body = await response.json();
  } catch {
    throw new Error(`${url}: the server answered ${response.status} without JSON`);
  }
  if (!response.ok) throw new Error(body.error || `${url}: HTTP ${response.status}`);
  return body;
}

function setBanners(key, messages, level = "error") {
  if (messages && messages.length) state.banners[key] = { messages, level };
  else delete state.banners[key];
  const box = document.getElementById("banners");
  box.replaceChildren(
    ...Object.values(state.banners).flatMap(({ messages, level }) =>
      messages.map((m) => el("div", { class: `banner ${level}`, role: "alert", text: m })),
    ),
  );
}

const tooltip = document.getElementById("tooltip");
function showTooltip(text, event) {
  tooltip.textContent = text;
  tooltip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
  const y = Math.min(event.clientY + 14, window.innerHeight - tooltip.offsetHeight - 8);
  tooltip.style.left = `${x}px`;
  tooltip.style.top = `${y}px`;
}
function hideTooltip() {
  tooltip.hidden = true;
}

window.addEventListener("error", (e) => setBanners("page", [`the page failed: ${e.message}`]));
window.addEventListener("unhandledrejection", (e) =>
  setBanners("page", [`the page failed: ${e.reason && e.reason.message ? e.reason.message : e.reason}`]),
);

// ---------------------------------------------------------------- plots

const W = 480;
const H = 190;
const M = { l: 50, r: 10, t: 8, b: 22 };

function niceTicks(lo, hi, count) {
  const span = hi - lo;
  const rough = span / count;
  const magnitude = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => span / s <= count) || rough;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(v);
  return ticks;
}

function nearest(xs, x) {
  let lo = 0;
  let hi = xs.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid;
    else hi = mid;
  }
  return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
}

// A plot's box: its title and legend ([{label, color}]) above the drawing.
function plotBox(id, title, legend) {
  const box = el("div", { class: "plot", "data-plot-box": id });
  box.append(el("h3", { text: title }));
  box.append(
    el(
      "div",
      { class: "legend" },
      legend.map((s) => el("span", {}, el("i", { style: `background:${s.color}` }), s.label)),
    ),
  );
  return box;
}

// The svg of plot `id` over steps x0..x1 and values y0..y1, with its grid and tick labels;
// sx and sy map a step and a value to the drawing.
function plotAxes(id, x0, x1, y0, y1) {
  const sx = (x) => M.l + ((x - x0) / (x1 - x0)) * (W - M.l - M.r);
  const sy = (y) => H - M.b - ((y - y0) / (y1 - y0)) * (H - M.t - M.b);
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-plot": id, role: "img" });
  for (const v of niceTicks(y0, y1, 4)) {
    plot.append(svg("line", { class: "grid", x1: M.l, x2: W - M.r, y1: sy(v), y2: sy(v) }));
    const label = svg("text", { x: M.l - 4, y: sy(v) + 3, "text-anchor": "end" });
    label.textContent = fmt(v);
    plot.append(label);
  }
  for (const v of niceTicks(x0, x1, 5)) {
    const label = svg("text", { x: sx(v), y: H - 6, "text-anchor": "middle" });
    label.textContent = fmt(v);
    plot.append(label);
  }
  return { plot, sx, sy };
}

// Hovering the plot shows a cursor and the tooltip of describe(x) ({step, lines}) for
// the step x under the mouse; a click calls onClick(that step).
function addHover(plot, x0, x1, sx, describe, onClick) {
  const cursor = svg("line", { class: "cursor", y1: M.t, y2: H - M.b, visibility: "hidden" });
  plot.append(cursor);
  const hover = svg("rect", { x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b, fill: "transparent" });
  plot.append(hover);
  const stepAt = (event) => {
    const point = plot.createSVGPoint();
    point.x = event.clientX;
    point.y = event.clientY;
    const local = point.matrixTransform(plot.getScreenCTM().inverse());
    return x0 + ((local.x - M.l) / (W - M.l - M.r)) * (x1 - x0);
  };
  hover.addEventListener("mousemove", (event) => {
    const { step, lines } = describe(stepAt(event));
    cursor.setAttribute("x1", sx(step));
    cursor.setAttribute("x2", sx(step));
    cursor.setAttribute("visibility", "visible");
    showTooltip([`step ${step}`, ...lines].join("\n"), event);
  });
  hover.addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden");
    hideTooltip();
  });
  if (onClick) {
    hover.style.cursor = "pointer";
    hover.addEventListener("click", (event) => onClick(describe(stepAt(event)).step));
  }
}

// spec: {id, title, series: [{label, xs, ys, color, dashed}], onClick(step)}
function linePlot(spec) {
  const box = plotBox(spec.id, spec.title, spec.series);
  const series = spec.series.filter((s) => s.ys.some((y) => y != null));
  if (!series.length) {
    box.append(el("div", { class: "empty", text: "no data yet" }));
    return box;
  }
  let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];
  for (const s of series) {
    s.xs.forEach((x, i) => {
      if (s.ys[i] == null) return;
      x0 = Math.min(x0, x);
      x1 = Math.max(x1, x);
      y0 = Math.min(y0, s.ys[i]);
      y1 = Math.max(y1, s.ys[i]);
    });
  }
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  if (y0 === y1) [y0, y1] = [y0 - (Math.abs(y0) || 1) * 0.1, y1 + (Math.abs(y1) || 1) * 0.1];
  const { plot, sx, sy } = plotAxes(spec.id, x0, x1, y0, y1);
  for (const s of series) {
    let d = "";
    let pen = false;
    let points = 0;
    s.xs.forEach((x, i) => {
      const y = s.ys[i];
      if (y == null) {
        pen = false;
        return;
      }
      d += `${pen ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`;
      pen = true;
      points += 1;
    });
    const attrs = { class: "series", d, stroke: s.color, "data-label": s.label, "data-points": points };
    if (s.dashed) attrs["stroke-dasharray"] = "5 3";
    plot.append(svg("path", attrs));
    if (points <= 60) {
      s.xs.forEach((x, i) => {
        if (s.ys[i] != null) plot.append(svg("circle", { cx: sx(x), cy: sy(s.ys[i]), r: 2.2, fill: s.color }));
      });
    }
  }
  const describe = (x) => {
    const lines = [];
    let shown = null;
    for (const s of series) {
      const i = nearest(s.xs, x);
      if (shown == null) shown = s.xs[i];
      lines.push(`${s.label}: ${fmt(s.ys[i])}` + (s.xs[i] !== shown ? ` (step ${s.xs[i]})` : ""));
    }
    return { step: shown, lines };
  };
  addHover(plot, x0, x1, sx, describe, spec.onClick);
  box.append(plot);
  return box;
}

// Shares stacked from 0 to 1: one band per label, the first at the bottom.
// spec: {id, title, xs, bands: [{label, ys, color}], onClick(step)}; ys has no nulls.
function stackPlot(spec) {
  const box = plotBox(spec.id, spec.title, spec.bands);
  if (!spec.xs.length) {
    box.append(el("div", { class: "empty", text: "no data yet" }));
    return box;
  }
  let [x0, x1] = [spec.xs[0], spec.xs[spec.xs.length - 1]];
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  const { plot, sx, sy } = plotAxes(spec.id, x0, x1, 0, 1);
  let below = spec.xs.map(() => 0);
  for (const band of spec.bands) {
    const above = below.map((b, i) => b + band.ys[i]);
    const upper = spec.xs.map((x, i) => `${sx(x).toFixed(1)},${sy(above[i]).toFixed(1)}`);
    const lower = spec.xs.map((x, i) => `${sx(x).toFixed(1)},${sy(below[i]).toFixed(1)}`).reverse();
    plot.append(
      svg("path", {
        class: "area",
        d: `M${upper.join("L")}L${lower.join("L")}Z`,
        fill: band.color,
        "data-label": band.label,
        "data-points": spec.xs.length,
      }),
    );
    below = above;
  }
  const describe = (x) => {
    const i = nearest(spec.xs, x);
    return { step: spec.xs[i], lines: spec.bands.map((b) => `${b.label}: ${fmt(b.ys[i])}`).reverse() };
  };
  addHover(plot, x0, x1, sx, describe, spec.onClick);
  box.append(plot);
  return box;
}

// ---------------------------------------------------------------- overview

// How the held-out rollouts were decoded: greedy unless eval.temperature says otherwise.
function evalDecoding(overview) {
  const temperature = ((overview.config || {}).eval || {}).temperature || 0;
  return temperature > 0 ? `sampled at ${temperature}` : "greedy";
}

// The run's warnings (records of kind "warning", e.g. diagnostics/learning.py's): the
// latest of each name, oldest first, as banner lines.
function warningLines(overview) {
  const latest = {};
  for (const warning of overview.warnings || []) latest[warning.name] = warning;
  return Object.values(latest)
    .sort((a, b) => a.step - b.step)
    .map((warning) => `${overview.name}: ${warning.message}`);
}

function plotSeries(overview, kind, keys, offset, dashed, prefix, labels = {}) {
  const columns = overview.metrics[kind] || {};
  return keys
    .filter((key) => columns[key])
    .map((key, i) => ({
      label: prefix + (labels[key] || key),
      xs: columns.step,
      ys: columns[key],
      color: COLORS[(i + offset) % COLORS.length],
      dashed,
    }));
}

function renderOverview() {
  const overview = state.overviews[state.run];
  if (!overview) return;
  const other = state.overlay !== "" ? state.overviews[state.overlay] : null;
  const specs = PLOTS.filter((p) => p.always || p.keys.some((k) => (overview.metrics[p.kind] || {})[k]));
  for (const key of state.extra) {
    const [kind, name] = key.split(":");
    specs.push({ id: `extra-${kind}-${name}`, title: `${name} (${kind})`, kind, keys: [name] });
  }
  const plots = specs.map((p) => {
    const series = plotSeries(overview, p.kind, p.keys, 0, false, "", p.labels);
    if (other) series.push(...plotSeries(other, p.kind, p.keys, 3, true, `${other.name}: `, p.labels));
    if (!series.length) series.push(...p.keys.map((k, i) => ({ label: k, xs: [], ys: [], color: COLORS[i] })));
    return linePlot({
      id: p.id,
      title: typeof p.title === "function" ? p.title(overview) : p.title,
      series,
      onClick: p.kind === "train" ? (step) => openStep(state.run, step) : null,
    });
  });
  document.getElementById("plots").replaceChildren(...plots);
  renderTurns(overview);
  renderExtraChoices(overview);
  renderConfig(overview);
  renderStatus(overview);
}

function renderExtraChoices(overview) {
  const select = document.getElementById("extra-metric");
  const shown = new Set(PLOTS.flatMap((p) => p.keys.map((k) => `${p.kind}:${k}`)).concat(state.extra));
  const options = [];
  for (const kind of ["train", "eval"]) {
    for (const key of Object.keys(overview.metrics[kind] || {})) {
      if (key === "step" || key === "time" || shown.has(`${kind}:${key}`)) continue;
      if (kind === "train" && isTurnPanelKey(key)) continue;
      options.push(el("option", { value: `${kind}:${key}`, text: `${key} (${kind})` }));
    }
  }
  select.replaceChildren(el("option", { value: "", text: "(metric)" }), ...options);
}

function renderConfig(overview) {
  const box = document.getElementById("config");
  if (!overview.config) {
    box.replaceChildren(
      overview.config_text
        ? el("pre", { text: overview.config_text })
        : el("div", { class: "message", text: "No config.yaml in this run directory." }),
    );
    return;
  }
  const sections = Object.entries(overview.config).map(([section, values]) => {
    const rows = [];
    const walk = (prefix, value) => {
      if (value && typeof value === "object" && !Array.isArray(value)) {
        for (const [k, v] of Object.entries(value)) walk(prefix ? `${prefix}.${k}` : k, v);
      } else {
        rows.push(el("tr", {}, el("td", { text: prefix }), el("td", { text: JSON.stringify(value) })));
      }
    };
    walk("", values);
    return el("details", { open: true }, el("summary", { text: section }), el("table", {}, rows));
  });
  box.replaceChildren(...sections);
}

function renderStatus(overview) {
  const train = overview.metrics.train || {};
  const steps = train.step || [];
  const last = steps.length ? steps[steps.length - 1] : 0;
  const times = train.time || [];
  const total = overview.total_steps ? ` / ${overview.total_steps}` : "";
  let phase = "finished";
  if (!overview.finished) {
    const ago = times.length ? Date.now() / 1000 - times[times.length - 1] : null;
    phase = ago == null ? "no steps yet" : `last step ${duration(ago)} ago`;
  }
  document.getElementById("status").textContent = `${overview.name} · step ${last}${total} · ${phase}`;
}

async function refreshOverview(run) {
  try {
    const overview = await getJSON(`/api/runs/${run}/overview`);
    setBanners("connection", []);
    const before = state.overviews[run];
    state.overviews[run] = overview;
    setBanners(`overview-${run}`, overview.errors.map((e) => `${overview.name}: ${e}`));
    setBanners(`warnings-${run}`, warningLines(overview), "warn");
    return !before || before.stamp !== overview.stamp;
  } catch (error) {
    setBanners("connection", [`cannot read run ${run} from the viewer server: ${error.message}`]);
    return false;
  }
}

async function poll() {
  const runs = new Set([state.run, ...panels.map((p) => p.run)]);
  if (state.overlay !== "") runs.add(Number(state.overlay));
  let changed = false;
  for (const run of runs) changed = (await refreshOverview(run)) || changed;
  if (changed) {
    renderOverview();
    for (const panel of panels) panel.stepsChanged();
  } else if (state.overviews[state.run]) {
    renderStatus(state.overviews[state.run]);
  }
}

// ---------------------------------------------------------------- turns (multi-turn runs)
// The multi-turn diagnostics of the train records, as in the run's reward.png: per turn
// position k (turn{k}_*: the k-th model call of an episode), the collapse signals and
// the first words of the replies (action_share_<word>). Hidden for a run without them.

const TURN_KEY = /^turn(\d+)_(.+)$/;
const TURN_METRICS = ["return_mean", "advantage_abs_mean", "entropy", "loss_share"];
const COLLAPSE_KEYS = ["degenerate_group_share", "action_top_share"];
const ACTION_PREFIX = "action_share_";
const MAX_ACTION_WORDS = 8; // rarer first words join "other", as in reward.png
const WORD_COLORS = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896"];
const OTHER_COLOR = "#d3d3d3";

function turnColor(k) {
  return COLORS[(k - 1) % COLORS.length];
}

function turnPositions(columns) {
  const found = new Set();
  for (const key of Object.keys(columns)) {
    const match = TURN_KEY.exec(key);
    if (match) found.add(Number(match[1]));
  }
  return [...found].sort((a, b) => a - b);
}

// The keys the turns panel draws (left out of "Add a plot").
function isTurnPanelKey(key) {
  const match = TURN_KEY.exec(key);
  return (match && TURN_METRICS.includes(match[2])) || key.startsWith(ACTION_PREFIX) || COLLAPSE_KEYS.includes(key);
}

// The steps that logged any of `keys`, and per key its values there (null: 0).
function stacked(columns, keys) {
  const steps = columns.step || [];
  const rows = steps.map((_, i) => i).filter((i) => keys.some((k) => columns[k] && columns[k][i] != null));
  return {
    xs: rows.map((i) => steps[i]),
    values: keys.map((k) => rows.map((i) => (columns[k] ? columns[k][i] || 0 : 0))),
  };
}

// One band per first word, by summed share (largest at the bottom, ties by name); words
// beyond MAX_ACTION_WORDS are added to "other", the top band.
function actionBands(columns) {
  const words = Object.keys(columns)
    .filter((k) => k.startsWith(ACTION_PREFIX) && k !== `${ACTION_PREFIX}other`)
    .map((k) => k.slice(ACTION_PREFIX.length))
    .sort();
  const { xs, values } = stacked(columns, [...words, "other"].map((w) => ACTION_PREFIX + w));
  const sum = (ys) => ys.reduce((a, b) => a + b, 0);
  const ranked = words.map((word, i) => ({ word, ys: values[i] })).sort((a, b) => sum(b.ys) - sum(a.ys));
  const other = values[words.length].slice();
  for (const { ys } of ranked.slice(MAX_ACTION_WORDS)) ys.forEach((y, i) => (other[i] += y));
  const bands = ranked
    .slice(0, MAX_ACTION_WORDS)
    .map(({ word, ys }, i) => ({ label: word, ys, color: WORD_COLORS[i % WORD_COLORS.length] }));
  return { xs, bands: [...bands, { label: "other", ys: other, color: OTHER_COLOR }] };
}

function renderTurns(overview) {
  const columns = overview.metrics.train || {};
  const turns = turnPositions(columns);
  const box = document.getElementById("turns");
  box.hidden = !turns.length;
  if (!turns.length) {
    document.getElementById("turn-plots").replaceChildren();
    return;
  }
  const onClick = (step) => openStep(state.run, step);
  const perTurn = (metric) =>
    turns.map((k) => ({
      label: `turn ${k}`,
      xs: columns.step,
      ys: columns[`turn${k}_${metric}`] || [],
      color: turnColor(k),
    }));
  const line = (key, color, label = key) => ({ label, xs: columns.step, ys: columns[key] || [], color });
  const loss = stacked(columns, turns.map((k) => `turn${k}_loss_share`));
  const actions = actionBands(columns);
  document.getElementById("turn-plots").replaceChildren(
    linePlot({
      id: "turn-advantage",
      title: "Advantage |mean| per turn",
      series: perTurn("advantage_abs_mean"),
      onClick,
    }),
    linePlot({ id: "turn-return", title: "Return (mean) per turn", series: perTurn("return_mean"), onClick }),
    linePlot({
      id: "turn-entropy",
      title: "Token entropy (nats): all turns and per turn",
      series: [line("entropy", "#1d2330", "all turns"), ...perTurn("entropy")],
      onClick,
    }),
    linePlot({
      id: "turn-collapse",
      title: "Signs of collapse (shares)",
      series: [
        line("degenerate_group_share", "#1d2330", "groups with equal returns"),
        line("action_top_share", "#9ca3af", "most common first word"),
      ],
      onClick,
    }),
    stackPlot({ id: "turn-actions", title: "First word of the replies (shares)", ...actions, onClick }),
    stackPlot({
      id: "turn-loss",
      title: "Share of the loss per turn",
      xs: loss.xs,
      bands: turns.map((k, i) => ({ label: `turn ${k}`, ys: loss.values[i], color: turnColor(k) })),
      onClick,
    }),
  );
}

// ---------------------------------------------------------------- a step's rollouts

function groupRows(rows) {
  const groups = new Map();
  for (const row of rows) {
    if (!groups.has(row.group_id)) groups.set(row.group_id, []);
    groups.get(row.group_id).push(row);
  }
  for (const list of groups.values()) list.sort((a, b) => a.sample_index - b.sample_index);
  return groups;
}

function hitTokens(tokens, query) {
  const hits = new Set();
  if (!query) return hits;
  const text = tokens.join("").toLowerCase();
  const starts = [];
  let at = 0;
  for (const t of tokens) {
    starts.push(at);
    at += t.length;
  }
  const q = query.toLowerCase();
  for (let i = text.indexOf(q); i >= 0; i = text.indexOf(q, i + 1)) {
    for (let t = nearestStart(starts, i); t < tokens.length && starts[t] < i + q.length; t++) hits.add(t);
  }
  return hits;
}

function nearestStart(starts, offset) {
  let lo = 0;
  let hi = starts.length - 1;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (starts[mid] <= offset) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

function tokenView(row, query) {
  const hits = hitTokens(row.token_text, query);
  const spans = row.token_text.map((text, i) => {
    let cls = row.loss_mask[i] ? "tok m" : "tok";
    const engine = row.engine_logprobs[i];
    const trainer = row.trainer_logprobs ? row.trainer_logprobs[i] : null;
    if (row.loss_mask[i] && engine != null && trainer != null && Math.abs(engine - trainer) > 0.5) cls += " far";
    if (hits.has(i)) cls += " hit";
    return el("span", { class: cls, "data-i": i, text });
  });
  const box = el("div", { class: "tokens" }, spans);
  box.addEventListener("mousemove", (event) => {
    const i = event.target.dataset && event.target.dataset.i;
    if (i == null) return hideTooltip();
    const k = Number(i);
    const engine = row.engine_logprobs[k];
    const trainer = row.trainer_logprobs ? row.trainer_logprobs[k] : null;
    const lp = (v) => (v == null ? "— (not sampled)" : v.toFixed(4));
    const unrecorded = "— (not recorded in this step)";
    const diff = engine != null && trainer != null ? ` (trainer − engine ${(trainer - engine).toFixed(4)})` : "";
    showTooltip(
      [
        `token ${k}: ${JSON.stringify(row.token_text[k])} id ${row.token_ids[k]}`,
        `loss mask ${row.loss_mask[k]} (${row.loss_mask[k] ? "trained" : "not trained"})`,
        `engine logprob ${lp(engine)}`,
        `trainer logprob ${row.trainer_logprobs ? lp(trainer) : unrecorded}${diff}`,
        `version ${row.token_versions[k]}`,
      ].join("\n"),
      event,
    );
  });
  box.addEventListener("mouseleave", hideTooltip);
  return box;
}

function callsView(calls) {
  if (!Array.isArray(calls) || !calls.length) return null;
  const items = calls.map((call, n) => {
    const messages = (call.messages || []).map((m) =>
      el(
        "div",
        { class: "msg" },
        el("span", { class: "role", text: `${m.role}: ` }),
        typeof m.content === "string" ? m.content : JSON.stringify(m.content),
      ),
    );
    const took = call.ended_s != null && call.started_s != null ? `${fmt(call.ended_s - call.started_s)} s` : "";
    return el(
      "div",
      {},
      el("div", {
        text: `call ${n + 1} · ${call.completion_id || ""} · finish ${call.finish_reason} · reward ${fmt(call.reward)} · ${took}`,
      }),
      messages,
      el("div", { class: "msg" }, el("span", { class: "role", text: "reply: " }), call.reply || ""),
      call.tool_calls && call.tool_calls.length
        ? el("div", { class: "msg" }, el("span", { class: "role", text: "tool calls: " }), JSON.stringify(call.tool_calls))
        : null,
    );
  });
  return el("details", { class: "calls" }, el("summary", { text: `${calls.length} call(s): the conversation` }), items);
}

function rolloutCard(row, matches, query) {
  const breaks = Array.isArray(row.concat_breaks) ? row.concat_breaks : [];
  const masked = row.loss_mask.reduce((a, b) => a + b, 0);
  const head = el(
    "div",
    { class: "head" },
    el("strong", { text: `#${row.sample_index}` }),
    el("span", { class: "badge", text: `reward ${fmt(row.reward)}` }),
    el("span", { class: "badge", text: `advantage ${row.advantage > 0 ? "+" : ""}${fmt(row.advantage)}` }),
    el("span", { class: "badge", text: `v${row.policy_version}` }),
    row.staleness > 0 ? el("span", { class: "badge warn", text: `stale ${row.staleness}` }) : null,
    row.truncated ? el("span", { class: "badge warn", text: "truncated" }) : null,
    row.error != null ? el("span", { class: "badge error", text: "error" }) : null,
    breaks.length ? el("span", { class: "badge warn", text: `${breaks.length} concat break(s)` }) : null,
    el("span", { class: "badge", text: `${masked}/${row.loss_mask.length} tokens trained` }),
  );
  const timings = row.timings && typeof row.timings === "object" ? row.timings : {};
  return el(
    "div",
    {
      class: `rollout${row.error != null ? " has-error" : ""}${matches ? "" : " dim"}`,
      "data-index": row.index,
      "data-session": row.session_id,
    },
    head,
    row.error != null ? el("div", { class: "errorbox", text: row.error }) : null,
    breaks.length ? el("div", { class: "breakbox" }, breaks.map((b) => el("div", { text: `concat break: ${b}` }))) : null,
    tokenView(row, query),
    callsView(row.calls),
    Object.keys(timings).length
      ? el("div", { class: "timings", text: Object.entries(timings).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ") })
      : null,
  );
}

const panels = [];

class StepPanel {
  constructor(root, { compact = false, chooseRun = true, onChange = null } = {}) {
    this.root = root;
    this.compact = compact;
    this.chooseRun = chooseRun; // the Steps tab follows the header's run instead
    this.onChange = onChange;
    this.run = state.run;
    this.step = null;
    this.data = null;
    this.group = null;
    this.flags = new Set();
    this.query = "";
    this.hits = null;
    this.key = `panel-${panels.length}`;
    panels.push(this);
    root.classList.add("step-panel");
    if (compact) root.classList.add("compact");
    this.build();
  }

  build() {
    this.runSelect = el("select", { class: "run-select", onchange: () => this.switchRun(Number(this.runSelect.value)) });
    this.stepInput = el("input", {
      type: "number",
      class: "step-input",
      onchange: () => this.load(this.run, Number(this.stepInput.value)),
    });
    const move = (delta) => {
      const steps = this.steps();
      const i = steps.indexOf(this.step);
      const next = steps[Math.max(0, Math.min(steps.length - 1, i + delta))];
      if (next != null) this.load(this.run, next);
    };
    const flags = FLAGS.map(([name, label]) =>
      el(
        "label",
        {},
        el("input", {
          type: "checkbox",
          "data-flag": name,
          onchange: (e) => {
            if (e.target.checked) this.flags.add(name);
            else this.flags.delete(name);
            this.render();
          },
        }),
        ` ${label}`,
      ),
    );
    this.searchInput = el("input", {
      type: "search",
      class: "search",
      placeholder: "search text",
      oninput: () => {
        this.query = this.searchInput.value;
        this.render();
      },
      onkeydown: (e) => e.key === "Enter" && this.searchAll(),
    });
    const toolbar = el(
      "div",
      { class: "toolbar" },
      this.runSelect,
      el("label", {}, "Step ", this.stepInput),
      el("button", { text: "◀", title: "previous step", onclick: () => move(-1) }),
      el("button", { text: "▶", title: "next step", onclick: () => move(1) }),
      el("button", { text: "latest", onclick: () => move(Infinity) }),
      el("span", { class: "hint", text: "show:" }),
      flags,
      this.searchInput,
      el("button", { class: "search-all", text: "search all steps", onclick: () => this.searchAll() }),
    );
    this.summary = el("div", { class: "summary" });
    this.hitsBox = el("div", { class: "hits", hidden: true });
    this.groupsBox = el("div");
    this.detail = el("div");
    this.root.replaceChildren(
      toolbar,
      this.hitsBox,
      this.summary,
      el(
        "div",
        { class: "legend-tokens" },
        "Tokens: ",
        el("span", { class: "tok m", text: "trained (loss mask 1)" }),
        " ",
        el("span", { class: "tok", text: "not trained (prompt, tool output)" }),
        " ",
        el("span", { class: "tok m far", text: "|trainer − engine logprob| > 0.5" }),
        " · hover a token for its logprobs and version",
      ),
      el("div", { class: "step-body" }, this.groupsBox, this.detail),
    );
    this.renderRuns();
  }

  steps() {
    const overview = state.overviews[this.run];
    return overview ? overview.steps : [];
  }

  renderRuns() {
    this.runSelect.replaceChildren(...state.runs.map((r) => el("option", { value: r.id, text: r.name })));
    this.runSelect.value = this.run;
    this.runSelect.hidden = !this.chooseRun || state.runs.length < 2;
  }

  stepsChanged() {
    const steps = this.steps();
    if (steps.length) {
      this.stepInput.min = steps[0];
      this.stepInput.max = steps[steps.length - 1];
    }
    if (this.step == null && steps.length && this.root.offsetParent !== null) this.load(this.run, steps[steps.length - 1]);
  }

  async switchRun(run) {
    this.run = run;
    if (!state.overviews[run]) await refreshOverview(run);
    const steps = this.steps();
    this.load(run, steps.includes(this.step) ? this.step : steps[steps.length - 1]);
  }

  async load(run, step, group = null) {
    this.run = run;
    this.runSelect.value = run;
    if (step == null || Number.isNaN(step)) {
      this.detail.replaceChildren(el("div", { class: "message", text: "This run has no trajectory files yet." }));
      return;
    }
    this.step = step;
    this.stepInput.value = step;
    this.summary.textContent = `loading step ${step}…`;
    try {
      this.data = await getJSON(`/api/runs/${run}/steps/${step}`);
      setBanners(this.key, this.data.warnings, "warn");
    } catch (error) {
      this.data = null;
      setBanners(this.key, [`step ${step}: ${error.message}`]);
      this.summary.textContent = `step ${step} could not be shown: ${error.message}`;
      this.groupsBox.replaceChildren();
      this.detail.replaceChildren();
      return;
    }
    const groups = groupRows(this.data.rows);
    this.group = group && groups.has(group) ? group : null;
    this.render();
    if (this.onChange) this.onChange(this);
  }

  matches(row) {
    for (const [name, , test] of FLAGS) if (this.flags.has(name) && !test(row)) return false;
    if (this.query && !row.token_text.join("").toLowerCase().includes(this.query.toLowerCase())) return false;
    return true;
  }

  render() {
    if (!this.data) return;
    const rows = this.data.rows;
    const groups = groupRows(rows);
    const sum = (f) => rows.reduce((a, r) => a + (f(r) ? 1 : 0), 0);
    const rewards = rows.map((r) => r.reward).filter((r) => r != null);
    const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
    this.summary.textContent =
      `step ${this.data.step} (${this.data.file}) · ${rows.length} rollouts in ${groups.size} groups · ` +
      `reward mean ${fmt(mean)} · reward 0: ${sum((r) => r.reward === 0)} · errors: ${sum((r) => r.error != null)} · ` +
      `truncated: ${sum((r) => r.truncated)} · stale: ${sum((r) => r.staleness > 0)}`;
    const body = [];
    for (const [id, list] of groups) {
      const matching = list.filter((r) => this.matches(r)).length;
      if (!matching) continue;
      const groupMean = list.reduce((a, r) => a + (r.reward || 0), 0) / list.length;
      body.push(
        el(
          "tr",
          { class: `group-row${id === this.group ? " selected" : ""}`, "data-group": id, onclick: () => this.selectGroup(id) },
          el("td", { text: id }),
          el("td", { text: matching === list.length ? String(list.length) : `${matching} of ${list.length}` }),
          el("td", { text: fmt(groupMean) }),
          el(
            "td",
            { class: "dots" },
            list.map((r) =>
              el("span", {
                class: r.error != null ? "bad" : r.reward > 0 ? "good" : "",
                title: `#${r.sample_index}: reward ${fmt(r.reward)}`,
              }),
            ),
          ),
        ),
      );
    }
    this.groupsBox.replaceChildren(
      body.length
        ? el(
            "table",
            { class: "groups" },
            el("tr", {}, ["group", "rollouts", "mean reward", "rewards"].map((h) => el("th", { text: h }))),
            body,
          )
        : el("div", { class: "message", text: "No rollout of this step matches the filters." }),
    );
    if (this.group == null) {
      this.detail.replaceChildren(el("div", { class: "message", text: "Click a group to see its rollouts side by side." }));
      return;
    }
    const list = groups.get(this.group) || [];
    this.detail.replaceChildren(
      el("h3", { text: `group ${this.group}` }),
      el("div", { class: "rollouts" }, list.map((r) => rolloutCard(r, this.matches(r), this.query))),
    );
  }

  selectGroup(id) {
    this.group = id;
    this.render();
    if (this.onChange) this.onChange(this);
  }

  async searchAll() {
    const params = new URLSearchParams({ q: this.query, flags: [...this.flags].join(",") });
    this.hitsBox.hidden = false;
    this.hitsBox.replaceChildren(el("div", { class: "note", text: "searching every step…" }));
    let result;
    try {
      result = await getJSON(`/api/runs/${this.run}/search?${params}`);
    } catch (error) {
      this.hitsBox.replaceChildren(el("div", { class: "note", text: `search failed: ${error.message}` }));
      return;
    }
    setBanners(`${this.key}-search`, result.errors);
    const rows = result.hits.map((hit) =>
      el(
        "div",
        {
          class: "hit-row",
          "data-step": hit.step,
          "data-index": hit.index,
          onclick: () => this.openRow(hit.step, hit.group_id, hit.index),
        },
        el("strong", { text: `step ${hit.step}` }),
        ` · ${hit.group_id} #${hit.sample_index} · reward ${fmt(hit.reward)}${hit.error != null ? " · error" : ""} · `,
        el("span", { text: hit.snippet }),
      ),
    );
    const what = [result.query && `“${result.query}”`, ...result.flags].filter(Boolean).join(" + ") || "everything";
    this.hitsBox.replaceChildren(
      el("div", {
        class: "note",
        text: `${result.hits.length}${result.limited ? "+" : ""} rollout(s) match ${what} in ${result.scanned_steps} steps`,
      }),
      ...rows,
      el("button", { text: "close", onclick: () => (this.hitsBox.hidden = true) }),
    );
  }

  async openRow(step, group, index) {
    await this.load(this.run, step, group);
    const card = this.detail.querySelector(`.rollout[data-index="${index}"]`);
    if (card) {
      card.scrollIntoView({ block: "nearest", inline: "center" });
      card.classList.add("flash");
    }
  }
}

// ---------------------------------------------------------------- tabs and start

let stepPanel = null;
let compareA = null;
let compareB = null;

function showTab(name) {
  for (const section of document.querySelectorAll("section.tab")) section.hidden = section.id !== name;
  for (const link of document.querySelectorAll("header nav a")) link.classList.toggle("active", link.dataset.tab === name);
  const steps = (state.overviews[state.run] || {}).steps || [];
  const last = steps[steps.length - 1];
  if (name === "steps" && stepPanel.step == null) stepPanel.load(state.run, last);
  if (name === "compare" && compareA.step == null) {
    compareA.load(state.run, steps[0]);
    if (state.runs.length > 1) compareB.switchRun(state.run === 0 ? 1 : 0);
    else compareB.load(state.run, last);
  }
}

function openStep(run, step, group = null) {
  location.hash = `steps/${run}/${step}${group ? `/${group}` : ""}`;
}

function writeHash(panel) {
  const hash = `#steps/${panel.run}/${panel.step}${panel.group ? `/${encodeURIComponent(panel.group)}` : ""}`;
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

async function route() {
  const [tab, run, step, group] = location.hash.slice(1).split("/");
  const name = ["overview", "steps", "compare"].includes(tab) ? tab : "overview";
  if (name === "steps" && step != null) {
    if (Number(run) !== state.run && state.runs[Number(run)]) await selectRun(Number(run));
    stepPanel.load(Number(run), Number(step), group ? decodeURIComponent(group) : null);
  }
  showTab(name);
}

async function selectRun(run) {
  state.run = run;
  document.getElementById("run").value = run;
  await refreshOverview(run);
  renderOverview();
}

async function start() {
  state.runs = await getJSON("/api/runs");
  const runSelect = document.getElementById("run");
  const overlay = document.getElementById("overlay");
  runSelect.replaceChildren(...state.runs.map((r) => el("option", { value: r.id, text: r.name })));
  overlay.append(...state.runs.map((r) => el("option", { value: r.id, text: r.name })));
  runSelect.hidden = state.runs.length < 2;
  overlay.parentElement.hidden = state.runs.length < 2;
  runSelect.addEventListener("change", async () => {
    await selectRun(Number(runSelect.value));
    stepPanel.switchRun(state.run);
  });
  overlay.addEventListener("change", async () => {
    state.overlay = overlay.value;
    if (state.overlay !== "") await refreshOverview(Number(state.overlay));
    renderOverview();
  });
  document.getElementById("extra-metric").addEventListener("change", (e) => {
    if (e.target.value) state.extra.push(e.target.value);
    renderOverview();
  });
  stepPanel = new StepPanel(document.getElementById("step-panel"), { chooseRun: false, onChange: writeHash });
  compareA = new StepPanel(document.getElementById("compare-a"), { compact: true });
  compareB = new StepPanel(document.getElementById("compare-b"), { compact: true });
  await refreshOverview(state.run);
  renderOverview();
  for (const panel of panels) panel.stepsChanged();
  window.addEventListener("hashchange", route);
  await route();
  setInterval(poll, POLL_MS);
}

start().catch((error) => setBanners("start", [`the viewer could not start: ${error.message}`]));
