// driftline live status: polls /api/series and draws the key charts with uPlot.
// Plain JS, no build step. Each chart lists the series keys it draws (see status/series.py);
// a `prefix` draws every key "prefix:<label>" as one line.
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
const HEIGHT = 220;
// Tick steps of integer-valued charts (model versions): no 0.5 ticks.
const INTEGER_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 1e6];

// ---------------------------------------------------------------- formatting
function fmtNumber(v, digits = 3) {
  if (v == null || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(digits - 1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(digits - 1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(digits - 2) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  return v.toPrecision(digits);
}

function fmtDuration(s, digits = 1) {
  if (s == null || !isFinite(s)) return "–";
  const a = Math.abs(s);
  if (a < 1) return (s * 1000).toFixed(Math.max(0, digits - 1)) + " ms";
  if (a < 120) return s.toFixed(digits) + " s";
  if (a < 7200) return (s / 60).toFixed(digits) + " min";
  if (a < 2 * 86400) return (s / 3600).toFixed(digits) + " h";
  if (a < 365 * 86400) return (s / 86400).toFixed(digits) + " d";
  return (s / (365.25 * 86400)).toFixed(digits) + " y";
}

const isPowerOf10 = (v) => v > 0 && Math.abs(Math.log10(v) - Math.round(Math.log10(v))) < 1e-9;

// Axis tick labels: the chart's formatter, with more digits until neighbouring ticks differ
// (a watermark lag of 25.9 y moves by hours during a replay).
function axisLabels(fmt, vals) {
  let labels = vals.map((v) => fmt(v));
  for (let digits = 2; digits <= 6 && new Set(labels).size < labels.length; digits++) {
    labels = vals.map((v) => fmt(v, digits));
  }
  return labels;
}

const fmtMs = (v) => (v == null ? "–" : v < 10 ? v.toFixed(2) + " ms" : v.toFixed(0) + " ms");
const fmtAuc = (v, digits = 3) => (v == null ? "–" : v.toFixed(digits));
const pad2 = (n) => String(n).padStart(2, "0");
const fmtClock = (s) => {
  const d = new Date(s * 1000);
  return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
};
const fmtDate = (s) => (s == null ? "–" : new Date(s * 1000).toISOString().slice(0, 16).replace("T", " "));

// ---------------------------------------------------------------- chart definitions
const CHARTS = [
  // the model's AUC per model, and beside it the counting baseline's on the same examples
  { id: "auc", x: "event_time_s", prefix: "auc", fmt: fmtAuc,
    also: [["baseline_auc", (m) => `${m}: counting clicks`]] },
  // the same over the recent examples, beside counting recent clicks: what moves when the traffic changes
  { id: "recent-auc", x: "event_time_s", prefix: "recent_auc", fmt: fmtAuc,
    also: [["recent_counts_auc", (m) => `${m}: counting recent clicks`]] },
  { id: "rps", keys: [["rank_rps", "requests/s"], ["rank_error_rps", "5xx/s"]], fmt: fmtNumber },
  { id: "latency", keys: [["rank_p50_ms", "p50"], ["rank_p99_ms", "p99"]], fmt: fmtNumber },
  { id: "sync", keys: [["sync_delay_p50_s", "median"], ["sync_delay_p99_s", "p99"]], fmt: fmtDuration },
  { id: "tables", prefix: "table_rows", fmt: fmtNumber, log: true },
  { id: "version", prefix: "model_version", fmt: fmtNumber, stepped: true, integer: true },
  { id: "examples", keys: [["join_rate", "joined"]], prefix: "train_rate", prefixLabel: (m) => `trained (${m})`, fmt: fmtNumber },
  { id: "rank-rate", prefix: "rank_train_rate", prefixLabel: (r) => `rank ${r}`, fmt: fmtNumber },
  { id: "rank-comm", prefix: "rank_comm_ms", prefixLabel: (r) => `rank ${r}`, fmt: fmtNumber },
  { id: "lag", prefix: "consumer_lag", fmt: fmtNumber },
  { id: "wm-lag", prefix: "watermark_lag_s", prefixLabel: (s) => `${s} watermark`, fmt: fmtDuration },
  { id: "places", prefix: "place_ratio", prefixLabel: (p) => `place ${p}`, fmt: fmtAuc },
];

// The lines of a chart present in this response: [{key, label}].
function columnsOf(chart, api) {
  const cols = (chart.keys || []).filter(([k]) => k in api.series).map(([key, label]) => ({ key, label }));
  const prefixes = chart.prefix ? [[chart.prefix, chart.prefixLabel], ...(chart.also || [])] : [];
  for (const [prefix, labelOf] of prefixes) {
    const p = prefix + ":";
    for (const key of Object.keys(api.series).sort()) {
      if (key.startsWith(p)) {
        const name = key.slice(p.length);
        cols.push({ key, label: labelOf ? labelOf(name) : name });
      }
    }
  }
  return cols;
}

// uPlot's columnar data: [x, y1, y2, ...]. Wall-clock charts use api.t; the AUC chart uses event
// time, keeping only points where it is known, sorted and de-duplicated (uPlot needs x ascending).
function dataOf(chart, api, cols) {
  // A log scale has no place for 0: an empty table is a gap there.
  const ys = cols.map((c) => (chart.log ? api.series[c.key].map((v) => (v > 0 ? v : null)) : api.series[c.key]));
  if (!chart.x) return [api.t, ...ys];
  const xs = api.series[chart.x] || [];
  const rows = [];
  for (let i = 0; i < xs.length; i++) {
    if (xs[i] != null && ys.some((y) => y[i] != null)) rows.push([xs[i], ...ys.map((y) => y[i])]);
  }
  rows.sort((a, b) => a[0] - b[0]);
  const kept = rows.filter((r, i) => i === rows.length - 1 || rows[i + 1][0] !== r[0]);
  return [kept.map((r) => r[0]), ...cols.map((_, j) => kept.map((r) => r[j + 1]))];
}

function makePlot(chart, el, cols, data) {
  const stepped = chart.stepped && uPlot.paths && uPlot.paths.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined;
  const opts = {
    width: Math.max(300, el.clientWidth),
    height: HEIGHT,
    scales: { x: { time: true }, y: chart.log ? { distr: 3 } : {} },
    series: [
      { label: chart.x ? "event time" : "time" },
      ...cols.map((c, i) => ({
        label: c.label,
        stroke: PALETTE[i % PALETTE.length],
        width: 1.5,
        paths: stepped,
        value: (u, v) => chart.fmt(v),
      })),
    ],
    axes: [chart.x ? {} : { space: 70, values: (u, vals) => vals.map(fmtClock) }, {
      // wide enough for the longest tick label (about 7 px a character at 11 px)
      size: (u, values) => Math.max(50, 16 + 7 * Math.max(0, ...(values || []).map((v) => String(v).length))),
      // log scale: label the powers of ten only (the ticks between are unlabelled)
      values: (u, vals) => (chart.log ? vals.map((v) => (isPowerOf10(v) ? chart.fmt(v) : "")) : axisLabels(chart.fmt, vals)),
      incrs: chart.integer ? INTEGER_INCRS : undefined,
    }],
    legend: { live: true },
  };
  return new uPlot(opts, data, el);
}

// ---------------------------------------------------------------- state and rendering
const state = { plots: {}, signatures: {}, updates: 0, lastError: null };
window.driftline = state; // for the browser test and for poking around in devtools

function renderChart(chart, api) {
  const fig = document.getElementById("chart-" + chart.id);
  const el = fig.querySelector(".plot");
  const cols = columnsOf(chart, api);
  const data = dataOf(chart, api, cols);
  const signature = cols.map((c) => c.key).join("|");
  let plot = state.plots[chart.id];
  if (plot && state.signatures[chart.id] === signature) {
    plot.setData(data);
  } else {
    if (plot) plot.destroy();
    el.textContent = "";
    plot = state.plots[chart.id] = makePlot(chart, el, cols, data);
    state.signatures[chart.id] = signature;
  }
  // The legend shows the newest values while the cursor is not over the chart.
  if (data[0].length && (plot.cursor.left == null || plot.cursor.left < 0)) plot.setLegend({ idx: data[0].length - 1 });
  let points = 0;
  for (const y of data.slice(1)) for (const v of y) if (v != null) points++;
  fig.dataset.points = String(points);
}

function last(api, key) {
  const ys = api.series[key];
  if (!ys) return null;
  for (let i = ys.length - 1; i >= 0; i--) if (ys[i] != null) return ys[i];
  return null;
}

function lastOfPrefix(api, prefix, pick) {
  const vals = Object.keys(api.series).filter((k) => k.startsWith(prefix + ":")).map((k) => last(api, k)).filter((v) => v != null);
  return vals.length ? pick(...vals) : null;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function renderTiles(api) {
  setText("tile-auc", fmtAuc(lastOfPrefix(api, "auc", Math.max)));
  setText("tile-event-time", fmtDate(last(api, "event_time_s")));
  const sparse = last(api, "model_version:sparse");
  const dense = last(api, "model_version:dense");
  setText("tile-version", `${sparse == null ? "–" : sparse} / ${dense == null ? "–" : dense}`);
  setText("tile-rps", fmtNumber(last(api, "rank_rps")));
  setText("tile-p99", fmtMs(last(api, "rank_p99_ms")));
  setText("tile-sync", fmtDuration(last(api, "sync_delay_p50_s")));
  setText("tile-wm-lag", fmtDuration(lastOfPrefix(api, "watermark_lag_s", Math.max)));
  const source = api.meta && api.meta.event_time_source;
  setText("note-auc", source ? `x: event time from ${source}` : "x: event time (not exported yet)");
}

function renderBadges(api) {
  const box = document.getElementById("badges");
  box.textContent = "";
  for (const t of api.targets) {
    const b = document.createElement("span");
    b.className = "badge " + (t.up === true ? "up" : t.up === false ? "down" : "pending");
    b.textContent = t.name;
    b.dataset.target = t.name;
    const ago = t.last_ok ? `last ok ${Math.max(0, api.now - t.last_ok).toFixed(0)} s ago` : "never scraped ok";
    b.title = `${t.url}\n${t.up ? "up" : t.up === false ? "down: " + t.last_error : "pending"}\n${ago}`;
    box.appendChild(b);
  }
}

// The services' fault flags (status/problems.py), one line each; hidden when there are none.
function renderProblems(api) {
  const box = document.getElementById("problems");
  const list = box.querySelector("ul");
  list.textContent = "";
  for (const p of api.problems || []) {
    const li = document.createElement("li");
    const who = document.createElement("strong");
    who.textContent = p.target + ": ";
    li.append(who, p.problem);
    list.appendChild(li);
  }
  box.hidden = list.children.length === 0;
}

async function poll() {
  let delay = 2000;
  try {
    const resp = await fetch("/api/series", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const api = await resp.json();
    delay = Math.max(500, (api.interval_s || 2) * 1000);
    renderBadges(api);
    renderProblems(api);
    renderTiles(api);
    for (const chart of CHARTS) renderChart(chart, api);
    state.updates++;
    state.lastError = null;
    document.body.dataset.updates = String(state.updates);
    const up = api.targets.filter((t) => t.up).length;
    setText("updated", `${up}/${api.targets.length} services up · ${api.t.length} points · updated ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    state.lastError = String(err);
    setText("updated", `status API unreachable (${err}); retrying…`);
  }
  setTimeout(poll, delay);
}

new ResizeObserver(() => {
  for (const chart of CHARTS) {
    const plot = state.plots[chart.id];
    const el = document.querySelector(`#chart-${chart.id} .plot`);
    if (plot && el.clientWidth > 0 && Math.abs(plot.width - el.clientWidth) > 2) {
      plot.setSize({ width: Math.max(300, el.clientWidth), height: HEIGHT });
    }
  }
}).observe(document.getElementById("charts"));

poll();
