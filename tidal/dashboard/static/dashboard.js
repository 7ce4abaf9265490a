/* tidal dashboard: polls the coordinator's (or `tidal dashboard`'s) JSON and draws with
   plotly.js, which the same server serves from the installed plotly package. */
"use strict";

const POLL_MS = 1000;
const LIST_POLL_MS = 2000;
const TERMINAL = new Set(["succeeded", "failed", "stopped", "interrupted"]);
// Metrics with a chart of their own (or none): not repeated among the per-metric charts.
const OWN_CHART = new Set(["samples_per_s", "cost", "world_size", "projected_cost",
  "cost_per_1k_samples", "price_per_worker_hour", "max_steps", "global_batch_size",
  "compute_s", "comm_s"]);
const METRIC_ORDER = ["loss", "accuracy"];
const COLORS = { world: "#2f6fdf", target: "#c98a0b", rate: "#1f9d55", cost: "#8a4fd6",
                 fail: "#d64545", gen: "#1d2330", metric: "#2f6fdf" };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function num(v, digits = 3) {
  if (typeof v === "string") return v; // "NaN", "Infinity", "-Infinity": a logged value
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
  if (Number.isInteger(v)) return v.toLocaleString("en-US");
  return v.toLocaleString("en-US", { maximumSignificantDigits: digits + 1 });
}
function money(v) { return v === null || v === undefined ? "–" : "$" + v.toFixed(v < 10 ? 4 : 2); }
function clock(t) {
  const d = new Date(t * 1000);
  return d.toLocaleTimeString("en-GB", { hour12: false }) + "." +
    String(d.getMilliseconds()).padStart(3, "0");
}
function dateTime(t) { return new Date(t * 1000).toLocaleString("en-GB", { hour12: false }); }
function age(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return (s * 1000).toFixed(0) + " ms ago";
  if (s < 120) return s.toFixed(1) + " s ago";
  return (s / 60).toFixed(0) + " min ago";
}
function duration(s) {
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function bytes(b) {
  if (b === null || b === undefined) return "–";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}
function badge(state) { return el("span", { class: "badge " + state, text: state }); }
function jobUrl(name) { return "/jobs/" + encodeURIComponent(name); }

async function getJSON(url) {
  const resp = await fetch(url, { cache: "no-store" });
  if (!resp.ok) throw new Error(resp.status + " " + resp.statusText);
  return resp.json();
}

function setConn(ok, text) {
  const node = document.getElementById("conn");
  if (!node) return;
  node.textContent = text;
  node.classList.toggle("bad", !ok);
}

function fillBody(table, rows) {
  const body = table.tBodies[0];
  body.replaceChildren(...rows);
}

/* ---------------------------------------------------------------- the job list */
function tidalJobsPage() {
  const table = document.getElementById("jobs");
  async function poll() {
    try {
      const d = await getJSON("/dashboard/jobs");
      const jobs = d.jobs.slice().reverse(); // newest first
      fillBody(table, jobs.map((j) => el("tr", { "data-job": j.name, "data-state": j.state },
        el("td", {}, el("a", { href: jobUrl(j.name), text: j.name })),
        el("td", {}, badge(j.state)),
        el("td", { class: "num", text: num(j.step) }),
        el("td", { class: "num", text: `${j.world_size} / ${j.target_workers}` }),
        el("td", { class: "num", text: num(j.samples_per_s) }),
        el("td", { class: "num", text: num(j.loss) }),
        el("td", { class: "num", text: money(j.cost) }),
        el("td", { class: "num", text: Math.max(0, j.generations - 1) }),
        el("td", { text: dateTime(j.created) }),
        el("td", {}, el("code", { text: j.script.split("/").pop(), title: j.script })),
      )));
      document.getElementById("empty").hidden = jobs.length > 0;
      setConn(true, "updated " + new Date().toLocaleTimeString("en-GB", { hour12: false }));
    } catch (err) {
      setConn(false, "server not answering (" + err.message + ")");
    }
    setTimeout(poll, LIST_POLL_MS);
  }
  poll();
}

/* ---------------------------------------------------------------- one job */
const LAYOUT = {
  margin: { l: 48, r: 12, t: 8, b: 36 },
  showlegend: true,
  legend: { orientation: "h", x: 0, y: 1.18, font: { size: 11 } },
  font: { size: 11, family: "system-ui, sans-serif" },
  paper_bgcolor: "rgba(0,0,0,0)",
  plot_bgcolor: "rgba(0,0,0,0)",
  xaxis: { gridcolor: "#eef0f4" },
  yaxis: { gridcolor: "#eef0f4", rangemode: "tozero" },
};
const CONFIG = { displayModeBar: false, responsive: true };

function layout(extra) {
  const out = JSON.parse(JSON.stringify(LAYOUT));
  for (const [k, v] of Object.entries(extra || {})) {
    out[k] = typeof v === "object" && !Array.isArray(v) ? Object.assign(out[k] || {}, v) : v;
  }
  return out;
}

function plot(id, traces, lay, emptyText) {
  const div = document.getElementById(id);
  const points = traces.reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
  div.dataset.points = String(points);
  if (typeof Plotly === "undefined") {
    div.replaceChildren(el("div", { class: "empty", text: "chart library did not load" }));
    return;
  }
  if (!points) {
    if (div.dataset.plotted) { Plotly.purge(div); delete div.dataset.plotted; }
    div.replaceChildren(el("div", { class: "empty", text: emptyText || "no data yet" }));
    return;
  }
  if (!div.dataset.plotted) div.replaceChildren();
  div.dataset.plotted = "1";
  Plotly.react(div, traces, lay, CONFIG);
}

// Consecutive repeats of a value collapse to their first point (metrics are the latest
// values, sampled more often than the script reports them); the newest point is kept so
// that a line reaches the present.
function series(xs, ys) {
  const x = [], y = [];
  let last, lastIndex = -1;
  for (let i = 0; i < ys.length; i++) {
    const v = ys[i];
    if (v === null || v === undefined) continue;
    lastIndex = i;
    if (v === last) continue;
    last = v;
    x.push(xs[i]);
    y.push(v);
  }
  if (lastIndex >= 0 && x.length && x[x.length - 1] !== xs[lastIndex]) {
    x.push(xs[lastIndex]);
    y.push(ys[lastIndex]);
  }
  return { x, y };
}

// A log axis for a positive metric that spans orders of magnitude (a loss, typically).
function yAxisFor(values) {
  const pos = values.filter((v) => v > 0);
  if (pos.length !== values.length || pos.length < 2) return { rangemode: "normal" };
  return Math.max(...pos) / Math.min(...pos) > 100 ? { type: "log", rangemode: "normal" } : { rangemode: "normal" };
}

function chartId(key) { return "chart-metric-" + key.replace(/[^A-Za-z0-9_-]/g, "_"); }

function tidalJobPage(name) {
  const h = { t: [], step: [], world: [], target: [], metrics: [] };
  let after = 0;
  // What the script logs with tidal.log: one value per step (a redone step's replaces it).
  const perStep = new Map(); // name -> Map(step -> value)
  let stepsAfter = 0;
  let lastGenKey = "";
  let eventsShown = 0;
  let finalRendered = false;
  document.getElementById("status-link").href = "/dashboard/jobs/" + encodeURIComponent(name);

  function merge(hist) {
    for (let i = 0; i < hist.t.length; i++) {
      h.t.push(new Date(hist.t[i] * 1000));
      h.step.push(hist.step[i]);
      h.world.push(hist.world_size[i]);
      h.target.push(hist.target[i]);
      h.metrics.push(hist.metrics[i] || {});
    }
    after = hist.seq;
    return hist.t.length > 0;
  }

  function mergeSteps(st) {
    if (!st) return false;
    let grew = false;
    for (const [key, s] of Object.entries(st.series)) {
      if (!perStep.has(key)) perStep.set(key, new Map());
      const m = perStep.get(key);
      for (let i = 0; i < s.step.length; i++) m.set(s.step[i], s.value[i]);
      grew = grew || s.step.length > 0;
    }
    stepsAfter = st.seq;
    return grew;
  }

  // A non-finite value arrives as a string ("NaN", ...): a gap in the chart.
  function stepColumn(key) {
    const m = perStep.get(key);
    const x = [...m.keys()].sort((a, b) => a - b);
    return { x, y: x.map((s) => (typeof m.get(s) === "number" ? m.get(s) : null)) };
  }

  // A non-finite value arrives as a string ("NaN", ...): a gap in the chart.
  function metricColumn(key) { return h.metrics.map((m) => (typeof m[key] === "number" ? m[key] : null)); }

  function drawCharts(status) {
    const gens = status.generations;
    const opened = gens.map((g) => new Date(g.opened_at * 1000));
    plot("chart-world", [
      { x: h.t, y: h.world, name: "world size", mode: "lines", line: { shape: "hv", color: COLORS.world, width: 2 } },
      { x: h.t, y: h.target, name: "target", mode: "lines", line: { shape: "hv", color: COLORS.target, dash: "dash" } },
      { x: opened, y: gens.map((g) => g.world_size), name: "new generation", mode: "markers",
        marker: { color: gens.map((g) => (/fail|lost|missed/.test(g.reason) ? COLORS.fail : COLORS.gen)), size: 7, symbol: "diamond" },
        text: gens.map((g) => `generation ${g.id}: ${g.world_size} workers<br>${g.reason}`),
        hoverinfo: "text" },
    ], layout({ yaxis: { dtick: 1, title: { text: "workers" } }, xaxis: { type: "date" } }));

    // Nothing trains without a generation, whatever rank 0 measured last.
    const rate = series(h.t, metricColumn("samples_per_s").map((v, i) => (h.world[i] ? v : 0)));
    plot("chart-throughput", [
      { x: rate.x, y: rate.y, name: "samples/s", mode: "lines", line: { color: COLORS.rate, shape: "hv" } },
    ], layout({ showlegend: false, xaxis: { type: "date" } }), "no throughput reported yet");

    const ms = (key) => series(h.t, metricColumn(key).map((v, i) => (h.world[i] && v !== null ? v * 1000 : null)));
    const compute = ms("compute_s"), comm = ms("comm_s");
    plot("chart-split", [
      { x: compute.x, y: compute.y, name: "compute", mode: "lines", stackgroup: "split",
        line: { color: COLORS.world, shape: "hv" } },
      { x: comm.x, y: comm.y, name: "waiting for all-reduce", mode: "lines", stackgroup: "split",
        line: { color: COLORS.target, shape: "hv" } },
    ], layout({ xaxis: { type: "date" } }), "no step-time split reported yet");

    const paused = gens.filter((g) => g.pause_s !== null && g.pause_s !== undefined);
    plot("chart-pauses", [
      { x: paused.map((g) => "g" + g.id), y: paused.map((g) => g.pause_s * 1000), type: "bar",
        name: "pause", marker: { color: paused.map((g) => (/fail|lost|missed/.test(g.reason) ? COLORS.fail : COLORS.world)) },
        text: paused.map((g) => `${(g.pause_s * 1000).toFixed(0)} ms`), textposition: "auto",
        hovertext: paused.map((g) => `generation ${g.id} (${g.world_size} workers): ${g.reason}`),
        hoverinfo: "text" },
    ], layout({ showlegend: false, yaxis: { title: { text: "ms" } }, xaxis: { type: "category" } }),
    "no rescale yet");

    const cost = series(h.t, metricColumn("cost"));
    const projected = series(h.t, metricColumn("projected_cost"));
    const priced = cost.y.some((v) => v > 0) || projected.y.some((v) => v > 0);
    plot("chart-cost", priced ? [
      { x: cost.x, y: cost.y, name: "spent", mode: "lines", line: { color: COLORS.cost, shape: "hv" } },
      { x: projected.x, y: projected.y, name: "projected total", mode: "lines",
        line: { color: COLORS.cost, dash: "dot", shape: "hv" } },
    ] : [], layout({ yaxis: { title: { text: "$" } }, xaxis: { type: "date" } }),
    "no cost: the job has no price (tidal run --price)");

    const keys = new Set([...perStep.keys()].filter((k) => !OWN_CHART.has(k)));
    for (const m of h.metrics) for (const k of Object.keys(m)) if (!OWN_CHART.has(k)) keys.add(k);
    const ordered = [...METRIC_ORDER.filter((k) => keys.has(k)),
      ...[...keys].filter((k) => !METRIC_ORDER.includes(k)).sort()];
    const holder = document.getElementById("charts");
    for (const key of ordered) {
      const id = chartId(key);
      if (!document.getElementById(id)) {
        holder.append(el("div", { class: "panel" },
          el("h3", { text: key + " vs step" }),
          el("div", { class: "chart", id, "data-metric": key, "data-points": "0" })));
      }
      // Logged metrics: one point per step; other gauges: sampled, repeats collapsed.
      const s = perStep.has(key) ? stepColumn(key) : series(h.step, metricColumn(key));
      plot(id, [{ x: s.x, y: s.y, name: key, mode: "lines+markers", marker: { size: 4 },
        line: { color: COLORS.metric } }],
      layout({ showlegend: false, xaxis: { title: { text: "step" } }, yaxis: yAxisFor(s.y.filter((v) => v !== null)) }));
    }
  }

  function card(label, value, sub) {
    return el("div", { class: "card" }, el("div", { class: "label", text: label }),
      el("div", { class: "value", text: value }), sub ? el("div", { class: "sub", text: sub }) : null);
  }

  function drawSummary(d) {
    const s = d.status;
    const m = s.metrics;
    document.getElementById("state").replaceWith(Object.assign(badge(s.state), { id: "state" }));
    document.title = `${s.name} · ${s.state} · tidal`;
    const pauses = s.generations.map((g) => g.pause_s).filter((p) => p !== null && p !== undefined);
    const failed = s.workers.filter((w) => w.state === "failed").length;
    const end = TERMINAL.has(s.state) && s.events.length ? s.events[s.events.length - 1].time : d.now;
    document.getElementById("summary").replaceChildren(
      card("step", num(s.step)),
      card("workers", `${s.world_size} / ${s.target_workers}`, `range ${s.min_workers}–${s.max_workers}`),
      card("samples/s", num(s.world_size ? m.samples_per_s : null)),
      card("loss", num(m.loss)),
      ...("accuracy" in m ? [card("accuracy", num(m.accuracy))] : []),
      card("cost", money(m.cost), m.price_per_worker_hour ? `${money(m.price_per_worker_hour)} per worker-hour` : null),
      ...(m.cost_per_1k_samples ? [card("$ / 1k samples", money(m.cost_per_1k_samples))] : []),
      card("rescales", String(Math.max(0, s.generations.length - 1)),
        pauses.length ? `last pause ${(pauses[pauses.length - 1] * 1000).toFixed(0)} ms` : null),
      card("worker failures", String(failed)),
      ...("checkpoint_stall_s" in m ? [card("checkpoint stall", `${(m.checkpoint_stall_s * 1000).toFixed(0)} ms`)] : []),
      card("elapsed", duration(Math.max(0, end - s.created)), s.script.split("/").pop()),
    );
  }

  function drawTables(d) {
    const s = d.status;
    if (s.events.length !== eventsShown) {
      const fresh = eventsShown > 0 ? s.events.length - eventsShown : 0;
      const rows = s.events.map((e, i) => el("tr", { "data-kind": e.kind, class: i >= s.events.length - fresh ? "fresh" : null },
        el("td", {}, el("code", { text: clock(e.time) })),
        el("td", {}, el("span", { class: "kind kind-" + e.kind, text: e.kind })),
        el("td", { text: e.message })));
      fillBody(document.getElementById("timeline"), rows.reverse());
      eventsShown = s.events.length;
    }
    const rates = d.worker_rates || {};
    fillBody(document.getElementById("workers"), s.workers.map((w) => {
      const r = rates[String(w.id)] || {};
      const hb = w.last_heartbeat ? d.now - w.last_heartbeat : null;
      return el("tr", { "data-worker": w.id, "data-state": w.state },
        el("td", { class: "num" }, el("a", { href: `/dashboard/jobs/${encodeURIComponent(name)}/logs/${w.id}`,
          text: w.id, title: "this worker's log", target: "_blank" })),
        el("td", { class: "num", text: w.rank === null ? "–" : w.rank }),
        el("td", { text: `${w.pid ?? "–"} @ ${w.host ?? "–"}` +
          (w.node && w.node !== w.host ? ` · node ${w.node.slice(0, 12)}` : ""), title: w.node ?? "" }),
        el("td", {}, badge(w.state)),
        el("td", { text: ["exited", "failed"].includes(w.state) ? "–" : age(hb) }),
        el("td", { class: "num", text: r.step ?? "–" }),
        el("td", { class: "num", text: num(r.steps_per_s ?? null) }),
        el("td", { class: "num", text: w.exit_code ?? "–" }));
    }));
    fillBody(document.getElementById("generations"), s.generations.slice().reverse().map((g) =>
      el("tr", { "data-generation": g.id },
        el("td", { class: "num", text: g.id }),
        el("td", { class: "num", text: g.world_size }),
        el("td", { text: g.members.join(", ") }),
        el("td", { class: "num", text: g.start_step ?? "–" }),
        el("td", { class: "num", text: g.pause_s === null ? "–" : (g.pause_s * 1000).toFixed(0) + " ms" }),
        el("td", { text: g.recovery ? g.recovery + (g.redone_steps ? ` (${g.redone_steps} steps redone)` : "") : "–" }),
        el("td", { text: g.reason }))));
    fillBody(document.getElementById("checkpoints"), s.checkpoints.slice().reverse().map((c) =>
      el("tr", {},
        el("td", { class: "num", text: c.step }),
        el("td", { class: "num", text: bytes(c.bytes) }),
        el("td", { class: "num", text: c.seconds_to_write === null ? "–" : c.seconds_to_write.toFixed(2) + " s" }),
        el("td", {}, el("code", { text: c.path })))));
  }

  async function poll() {
    let delay = POLL_MS;
    try {
      const d = await getJSON(`/dashboard/jobs/${encodeURIComponent(name)}` +
        `?after=${after}&steps_after=${stepsAfter}`);
      const grewSteps = mergeSteps(d.steps);
      const grew = merge(d.history) || grewSteps;
      const s = d.status;
      const genKey = s.generations.map((g) => `${g.id}:${g.pause_s}`).join(",");
      if (grew || genKey !== lastGenKey || !finalRendered) drawCharts(s);
      lastGenKey = genKey;
      drawSummary(d);
      drawTables(d);
      finalRendered = true;
      const ended = TERMINAL.has(s.state) && !d.live;
      setConn(true, (ended ? "finished · " : "live · ") + "updated " +
        new Date().toLocaleTimeString("en-GB", { hour12: false }));
      if (ended) delay = 10 * POLL_MS; // a finished job changes no more; keep a slow poll
    } catch (err) {
      setConn(false, "server not answering (" + err.message + "); the job may have ended: " +
        "`tidal dashboard` serves finished jobs");
      delay = 3 * POLL_MS;
    }
    setTimeout(poll, delay);
  }
  poll();
}
