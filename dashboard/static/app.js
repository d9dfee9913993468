// primerl dashboard: polls /api/... and redraws. Every value from the run (model output included) is set through
// textContent or an SVG attribute, never parsed as HTML.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const COLOURS = ["#2553a3", "#d1495b", "#1f7a3d", "#edae49", "#66a182", "#8d5a97", "#00798c", "#555"];

// Charts and derived series come from /api/charts (the server names them by the telemetry contract's keys).
let CHARTS = [];
let DERIVED = [];

function selector(series) {
  if (series.key !== undefined) return series.key;
  return { role: series.role, re: new RegExp(series.pattern), not: series.not ? new RegExp(series.not) : null };
}

async function loadCharts() {
  const table = await getJSON("/api/charts");
  CHARTS = table.charts.map((chart) => [chart.title, chart.series.map(selector)]);
  DERIVED = table.derived;
}

const state = {
  metricsNext: 0,
  rolloutsNext: 0,
  series: {}, // "role|name" -> Map(step -> value)
  rollouts: [],
  pickedStep: null,
  polls: 0,
  configShown: false,
};

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function fmtBytes(value) {
  // 2147483648 -> "2.00 GiB"; below 1 KiB the byte count itself.
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let scaled = value;
  let unit = -1;
  while (Math.abs(scaled) >= 1024 && unit < units.length - 1) {
    scaled /= 1024;
    unit += 1;
  }
  return unit < 0 ? `${value} B` : `${scaled.toFixed(2)} ${units[unit]}`;
}

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e6) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return value.toFixed(digits === undefined ? 3 : digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const s = Math.round(seconds);
  if (s < 90) return `${s} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// ------------------------------------------------------------------------------------------------- run
function showRun(run) {
  document.getElementById("run-id").textContent = run.run_id;
  const badge = document.getElementById("run-state");
  badge.textContent = run.state;
  badge.className = `state ${run.state}`;
  document.getElementById("run-step").textContent = `step ${run.step}${run.max_steps ? " / " + run.max_steps : ""}`;
  const progress = document.getElementById("run-progress");
  progress.max = Math.max(run.max_steps, 1);
  progress.value = Math.min(run.step, progress.max);
  document.getElementById("run-eta").textContent = run.eta_s !== null ? `ETA ${duration(run.eta_s)}` : "";
  // A run that ended (run.end, from its run directory) shows its last policy version and how it ended; the
  // broker's error shows only for a run that is still supposed to be running.
  const version = run.broker || run.end ? `policy v${run.latest_policy_version}` : "";
  document.getElementById("run-version").textContent = version;
  document.getElementById("run-error").textContent = run.broker_error || "";
  const end = document.getElementById("run-end");
  end.textContent = run.end ? endLine(run.end) : "";
  end.className = run.end && run.end.state === "failed" ? "error" : "";
  document.body.dataset.step = String(run.step);
  document.body.dataset.state = run.state;
}

function endLine(end) {
  // "ended 12/5/2026, 10:03:04 AM: the trainer finished step 30"
  const when = end.ended_unix_ms ? ` ${new Date(end.ended_unix_ms).toLocaleString()}` : "";
  return `ended${when}${end.reason ? ": " + end.reason : ""}`;
}

// --------------------------------------------------------------------------------------------- metrics
function addRows(rows) {
  for (const row of rows) {
    for (const [name, value] of Object.entries(row)) {
      if (name === "step" || name === "role" || name === "time" || typeof value !== "number") continue;
      const key = `${row.role}|${name}`;
      if (!state.series[key]) state.series[key] = new Map();
      state.series[key].set(row.step, value);
    }
    for (const derived of DERIVED) {
      const [top, bottom] = [row[derived.numerator], row[derived.denominator]];
      if (row.role !== derived.role || typeof top !== "number" || typeof bottom !== "number" || bottom <= 0) continue;
      const key = `${row.role}|${derived.key}`;
      if (!state.series[key]) state.series[key] = new Map();
      state.series[key].set(row.step, top / bottom);
    }
  }
}

function matches(selector, role, name) {
  if (typeof selector === "string") return name === selector;
  const roleMatches = selector.role === undefined || role === selector.role;
  return roleMatches && selector.re.test(name) && !(selector.not && selector.not.test(name));
}

function seriesOf(selectors) {
  const found = [];
  for (const key of Object.keys(state.series).sort()) {
    const [role, name] = key.split("|");
    if (selectors.some((s) => matches(s, role, name))) found.push({ key, role, name, points: state.series[key] });
  }
  return found;
}

function drawChart(container, title, series) {
  container.replaceChildren();
  container.appendChild(el("h3", title));
  const width = 320;
  const height = 160;
  const pad = { left: 44, right: 6, top: 6, bottom: 18 };
  const plot = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none" });
  let xs = [];
  let ys = [];
  for (const s of series) {
    for (const [x, y] of s.points) {
      xs.push(x);
      if (Number.isFinite(y)) ys.push(y);
    }
  }
  if (!xs.length || !ys.length) {
    container.appendChild(el("div", "no data yet", "muted"));
    return;
  }
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) [y0, y1] = [y0 - 0.5, y1 + 0.5];
  const sx = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  plot.appendChild(svg("line", { x1: pad.left, y1: height - pad.bottom, x2: width - pad.right, y2: height - pad.bottom, class: "axis" }));
  plot.appendChild(svg("line", { x1: pad.left, y1: pad.top, x2: pad.left, y2: height - pad.bottom, class: "axis" }));
  for (const [y, anchor] of [[y0, height - pad.bottom], [y1, pad.top + 8]]) {
    const label = svg("text", { x: 2, y: anchor, class: "tick" });
    label.textContent = fmt(y);
    plot.appendChild(label);
  }
  for (const [x, anchor] of [[x0, pad.left], [x1, width - pad.right - 16]]) {
    const label = svg("text", { x: anchor, y: height - 4, class: "tick" });
    label.textContent = String(Math.round(x));
    plot.appendChild(label);
  }
  const legend = el("div", null, "legend");
  series.forEach((s, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const points = [...s.points].filter(([, y]) => Number.isFinite(y)).sort((a, b) => a[0] - b[0]);
    const line = svg("polyline", {
      points: points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "),
      fill: "none",
      stroke: colour,
      "stroke-width": 1.5,
      "vector-effect": "non-scaling-stroke",
      "data-metric": s.name,
      "data-role": s.role,
      "data-points": points.length,
    });
    plot.appendChild(line);
    if (points.length <= 200) {
      for (const [x, y] of points) {
        const dot = svg("circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 1.6, fill: colour, class: "pt" });
        const tip = svg("title");
        tip.textContent = `${s.name} step ${x}: ${fmt(y, 4)}`;
        dot.appendChild(tip);
        plot.appendChild(dot);
      }
    }
    const entry = el("span", `■ ${s.name} (${points.length ? fmt(points.at(-1)[1], 4) : "–"})`);
    entry.style.color = colour;
    legend.appendChild(entry);
  });
  container.appendChild(plot);
  container.appendChild(legend);
}

function drawCharts() {
  const root = document.getElementById("charts");
  CHARTS.forEach(([title, selectors], i) => {
    let box = root.children[i];
    if (!box) {
      box = el("div", null, "chart");
      box.dataset.chart = title;
      root.appendChild(box);
    }
    drawChart(box, title, seriesOf(selectors));
  });
}

// ------------------------------------------------------------------------------------- workers, queues
function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const cells of rows) {
    const tr = el("tr");
    for (const cell of cells) tr.appendChild(el("td", cell));
    body.appendChild(tr);
  }
}

function showWorkers(data) {
  // An ended run's workers as last seen: heartbeat ages relative to that snapshot.
  const asOf = data.as_of_unix_ms;
  const now = asOf || Date.now();
  const ago = asOf ? "before the end" : "ago";
  fillTable(
    "workers-table",
    data.workers.map((w) => [
      w.name,
      w.role,
      w.host,
      w.state,
      w.policy_version === null ? "–" : w.policy_version,
      w.lag === null ? "–" : w.lag,
      w.trainer_step ?? w.orchestrator_step ?? "–",
      w.num_inflight,
      w.last_heartbeat_unix_ms ? `${(Math.max(0, now - w.last_heartbeat_unix_ms) / 1000).toFixed(1)} s ${ago}` : "–",
    ]),
  );
  document.getElementById("workers-note").textContent = asOf ? "as last seen before the run ended" : "";
  if (!data.workers.length) fillTable("workers-table", [[data.broker_error || "no workers", "", "", "", "", "", "", "", ""]]);
}

function showQueues(data) {
  fillTable(
    "queues-table",
    data.queues.map((q) => [
      q.name,
      q.num_items,
      fmtBytes(Number(q.num_bytes)),
      `${q.capacity_items} items / ${fmtBytes(Number(q.capacity_bytes))}`,
    ]),
  );
  document.getElementById("rates").textContent =
    `rollout batches/s ${fmt(data.rollout_batches_per_s, 2)} · rollout bytes/s ${fmt(data.rollout_bytes_per_s, 0)} · ` +
    `weight bytes/s ${fmt(data.weight_bytes_per_s, 0)} · latest policy version ${data.latest_policy_version}` +
    (data.history_max_bytes ? ` · broker history ${fmt(data.history_bytes / 2 ** 20, 2)} of ` +
      `${fmt(data.history_max_bytes / 2 ** 20, 0)} MiB` : "");
}

function showEvents(data) {
  const list = document.getElementById("events-list");
  list.replaceChildren();
  for (const e of data.recent_errors) list.appendChild(el("li", `broker (recent error): ${e.message}`, "error"));
  for (const e of data.events.slice().reverse()) {
    list.appendChild(el("li", `${e.time} ${e.source} [${e.level}] ${e.message}`, e.level));
  }
  if (!list.children.length) list.appendChild(el("li", "no warnings or errors", "muted"));
}

// -------------------------------------------------------------------------------------------- rollouts
function tokenColour(logprob) {
  // p = exp(logprob): likely tokens stay clear, unlikely ones turn red.
  const p = Math.exp(Math.min(0, logprob));
  const alpha = Math.min(0.85, (1 - p) * 0.9);
  return `rgba(209, 73, 91, ${alpha.toFixed(2)})`;
}

function advantageColour(advantage) {
  const a = Math.max(-1, Math.min(1, advantage));
  return a >= 0 ? `rgba(31, 122, 61, ${(a * 0.6).toFixed(2)})` : `rgba(209, 73, 91, ${(-a * 0.6).toFixed(2)})`;
}

function showRollouts() {
  const picker = document.getElementById("rollout-step");
  const steps = [...new Set(state.rollouts.map((r) => r.step))].sort((a, b) => b - a);
  const wanted = state.pickedStep ?? steps[0];
  if (picker.options.length !== steps.length) {
    picker.replaceChildren(...steps.map((s) => el("option", s)));
  }
  if (wanted !== undefined) picker.value = String(wanted);
  const colourBy = document.getElementById("rollout-colour").value;
  const list = document.getElementById("rollout-list");
  list.replaceChildren();
  for (const r of state.rollouts.filter((x) => x.step === wanted)) {
    const card = el("div", null, "rollout");
    card.appendChild(
      el(
        "div",
        `${r.env_id} · example ${r.example_id} · rollout ${r.rollout_id} · reward ${fmt(r.reward, 3)} · ` +
          `advantage ${fmt(r.advantage, 3)} · policy v${r.policy_version}${r.truncated ? " · truncated" : ""}`,
        "meta",
      ),
    );
    card.appendChild(el("div", r.prompt, "prompt"));
    const completion = el("div", null, "completion");
    for (const [text, logprob, isModel] of r.tokens || []) {
      const span = el("span", text, isModel ? "tok" : "tok env");
      if (isModel) {
        span.style.backgroundColor = colourBy === "advantage" ? advantageColour(r.advantage) : tokenColour(logprob);
        span.title = `logprob ${fmt(logprob, 3)}`;
      }
      completion.appendChild(span);
    }
    if (r.tokens_dropped) completion.appendChild(el("span", ` … ${r.tokens_dropped} more tokens`, "muted"));
    card.appendChild(completion);
    list.appendChild(card);
  }
  if (!list.children.length) list.appendChild(el("p", "no sample rollouts yet", "muted"));
}

// ------------------------------------------------------------------------------------------------ poll
async function poll() {
  try {
    if (!CHARTS.length) await loadCharts();
    const [run, metrics, workers, queues, events, rollouts] = await Promise.all([
      getJSON("/api/run"),
      getJSON(`/api/metrics?since=${state.metricsNext}`),
      getJSON("/api/workers"),
      getJSON("/api/queues"),
      getJSON("/api/events"),
      getJSON(`/api/rollouts?since=${state.rolloutsNext}`),
    ]);
    // A rewritten file, or another source (the run directory's file appeared): read it all again next time.
    const restart = (data, source, next) =>
      state[source] !== undefined && (data.source !== state[source] || data.next < state[next]);
    if (restart(metrics, "metricsSource", "metricsNext")) {
      state.series = {};
      state.metricsNext = 0;
    } else {
      addRows(metrics.rows);
      state.metricsNext = metrics.next;
    }
    state.metricsSource = metrics.source;
    if (restart(rollouts, "rolloutsSource", "rolloutsNext")) {
      state.rollouts = [];
      state.rolloutsNext = 0;
    } else {
      state.rollouts.push(...rollouts.rollouts);
      state.rollouts = state.rollouts.slice(-400);
      state.rolloutsNext = rollouts.next;
    }
    state.rolloutsSource = rollouts.source;
    showRun(run);
    drawCharts();
    showWorkers(workers);
    showQueues(queues);
    showEvents(events);
    showRollouts();
    if (!state.configShown) {
      const config = await getJSON("/api/config");
      document.getElementById("config-text").textContent = config.text;
      state.configShown = true;
    }
    state.polls += 1;
    document.body.dataset.polls = String(state.polls);
    const seen = document.body.dataset.stepsSeen ? document.body.dataset.stepsSeen.split(",") : [];
    if (seen.at(-1) !== String(run.step)) document.body.dataset.stepsSeen = [...seen, run.step].join(",");
    document.getElementById("run-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    document.getElementById("run-error").textContent = `dashboard: ${err.message}`;
  }
  setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("rollout-step").addEventListener("change", (event) => {
    state.pickedStep = Number(event.target.value);
    showRollouts();
  });
  document.getElementById("rollout-colour").addEventListener("change", showRollouts);
  poll();
});
