// Tessera's dashboard: polls the run control's API and draws it. Plots by uPlot (from npm).
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY = 300; // points on the plots

function human(n, unit) {
  const k = ["", "k", "M", "G", "T"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < k.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + k[i] + unit;
}
// Decimal units, as the command line prints them (tessera runs, the summary).
function bytes(n) {
  for (const [u, m] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) {
    if (n >= m) return (n / m).toFixed(1) + " " + u;
  }
  return n.toFixed(0) + " B";
}
function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
function rows(tbody, html) { tbody.innerHTML = html.join(""); }
// The token a run control over hosts asks for: asked once, kept for this tab only.
let tokenRequired = false;
const token = () => sessionStorage.getItem("tessera-token");
function askToken() {
  const t = prompt("This run control needs its token to change state (kept for this tab):");
  if (t) sessionStorage.setItem("tessera-token", t.trim());
  $("btn-token").hidden = !tokenRequired || !!token();
}
$("btn-token").addEventListener("click", askToken);
function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const op = $("operator").value.trim() || localStorage.getItem("tessera-operator") || "dashboard";
  localStorage.setItem("tessera-operator", op);
  h["X-Tessera-Operator"] = op;
  if (token()) h["Authorization"] = "Bearer " + token();
  return h;
}
// Calls that need the token are not made without it: each would be refused and logged.
const mayChange = () => !tokenRequired || !!token();
async function getJSON(path, withToken) {
  const h = {};
  if (withToken && token()) h["Authorization"] = "Bearer " + token();
  const r = await fetch(path, { cache: "no-store", headers: h });
  if (!r.ok) { const e = new Error((await r.json().catch(() => ({}))).error || r.statusText); e.status = r.status; throw e; }
  return r.json();
}
async function post(path, body) {
  if (!mayChange()) askToken();
  const r = await fetch(path, { method: "POST", headers: headers(body != null), body: body == null ? "" : JSON.stringify(body) });
  const j = await r.json().catch(() => ({}));
  if (r.status === 401) { sessionStorage.removeItem("tessera-token"); $("btn-token").hidden = false; }
  if (!r.ok) throw new Error(j.error || r.statusText);
  return j;
}
// Times as the logs give them: UTC, ISO 8601.
function utc(ns) { return new Date(ns / 1e6).toISOString().slice(0, 19) + "Z"; }

// Plots.
function plot(el, title, series) {
  const width = Math.max(300, el.parentElement.clientWidth - 30);
  return new uPlot({
    title, width, height: 180,
    scales: { x: { time: false } },
    axes: [{ label: "s" }, { size: 70 }],
    series: [{ label: "t" }, ...series],
  }, [[], ...series.map(() => [])], el);
}
const ratePlot = plot($("plot-rate"), "events/s", [
  { label: "built", stroke: "#3b5bdb" },
  { label: "incomplete", stroke: "#c5221f" },
]);
const throughputPlot = plot($("plot-throughput"), "MB/s", [
  { label: "built", stroke: "#1e8e3e" },
  { label: "recorded", stroke: "#b58900" },
]);
const deadPlot = plot($("plot-dead"), "dead time and fullest buffer, %", [
  { label: "dead time", stroke: "#c5221f" },
  { label: "fullest buffer", stroke: "#3b5bdb" },
]);
// Each buffer's occupancy over the run: one series per buffer, made again when the set of
// buffers changes (a new topology).
let bufferPlot = null;
let bufferNames = "";
function showBuffers(h) {
  const names = h.length ? h[h.length - 1].buffers.map((b) => b[0]) : [];
  if (!bufferPlot || names.join("|") !== bufferNames) {
    bufferNames = names.join("|");
    if (bufferPlot) bufferPlot.destroy();
    const colors = ["#3b5bdb", "#1e8e3e", "#b58900", "#c5221f", "#7048e8", "#0b7285", "#e8590c", "#5c940d"];
    bufferPlot = plot($("plot-buffers"), "each buffer's occupancy, %", names.map((n, i) => ({ label: n, stroke: colors[i % colors.length] })));
  }
  bufferPlot.setData([h.map((p) => p.t), ...names.map((n, i) => h.map((p) => (p.buffers[i] ? 100 * p.buffers[i][1] : null)))]);
}

// Histograms: the recorder fills them from every event; the page draws one at a time.
const bars = uPlot.paths.bars({ size: [0.9, 60] });
function barPlot(el, title, xfmt) {
  return new uPlot({
    title, width: Math.max(300, el.parentElement.clientWidth / 2 - 30), height: 220,
    scales: { x: { time: false } },
    axes: [{ values: (u, v) => v.map(xfmt) }, { size: 70 }],
    series: [{ label: "bin", value: (u, v) => (v == null ? "--" : xfmt(v)) }, { label: "count", stroke: "#3b5bdb", fill: "#3b5bdb55", paths: bars, points: { show: false } }],
  }, [[], []], el);
}
let histPlot = null;
let histKind = null;
let meansPlot = null;
let lastTriggers = null;
const log2Label = (unit) => (i) => {
  if (i == null || i < 0) return "";
  const v = i === 0 ? 0 : 2 ** (i - 1);
  return unit === "ns" ? (v >= 1e9 ? (v / 1e9).toFixed(1) + " s" : v >= 1e6 ? (v / 1e6).toFixed(1) + " ms" : v >= 1e3 ? (v / 1e3).toFixed(0) + " µs" : v + " ns") : bytes(v);
};
// A histogram as bars: log2 bins by index (labelled by their lower bound), linear by centre.
function histData(h) {
  if (!h) return [[], []];
  let first = h.bins.findIndex((n) => n > 0);
  let last = h.bins.length - 1 - [...h.bins].reverse().findIndex((n) => n > 0);
  if (first < 0) { first = 0; last = h.bins.length - 1; }
  const xs = [], ys = [];
  for (let i = first; i <= last; i++) {
    xs.push(h.scale === "log2" ? i : h.lo + (h.hi - h.lo) * (i + 0.5) / h.bins.length);
    ys.push(h.bins[i]);
  }
  return [xs, ys];
}
async function refreshHistograms() {
  let r;
  try { r = await getJSON("/api/histograms"); } catch (e) { return; }
  const rec = r.recorder;
  $("hist-run").textContent = `run ${r.run_number}${r.running ? " (so far)" : ""}`;
  const pick = $("hist-pick");
  const options = [];
  if (rec) {
    options.push(["event", "event size"], ["triggers", "time between triggers"]);
    for (const s of Object.keys(rec.fragment_size)) options.push(["frag:" + s, "fragment size, source " + s]);
    for (const s of Object.keys(rec.payload_word)) options.push(["word:" + s, "payload word, source " + s]);
  }
  for (const b of r.build_latency || []) options.push(["lat:" + b.builder, "build latency, builder " + b.builder]);
  const want = options.map((o) => o[0]).join("|");
  if (pick.dataset.options !== want) {
    const keep = pick.value;
    pick.innerHTML = options.map(([v, t]) => `<option value="${esc(v)}">${esc(t)}</option>`).join("");
    pick.dataset.options = want;
    if (options.some((o) => o[0] === keep)) pick.value = keep;
  }
  const k = pick.value;
  let h = null, fmt = (v) => String(v), kind = k.split(":")[0];
  if (!rec && kind !== "lat") { $("plot-hist").dataset.count = 0; return; }
  if (k === "event") { h = rec.event_size; fmt = log2Label("bytes"); }
  else if (k === "triggers") { h = rec.time_between_triggers; fmt = log2Label("ns"); }
  else if (kind === "frag") { h = rec.fragment_size[k.slice(5)]; fmt = log2Label("bytes"); }
  else if (kind === "word") { h = rec.payload_word[k.slice(5)]; fmt = (v) => (v == null ? "" : Number(v).toFixed(0)); }
  if (kind === "lat") {
    // The builder's latency histogram: cumulative Prometheus buckets, as /metrics gives them.
    const b = (r.build_latency || []).find((x) => "lat:" + x.builder === k);
    if (b) {
      let prev = 0;
      const xs = [], ys = [];
      b.latency.buckets.forEach(([le, cum], i) => { xs.push(i); ys.push(cum - prev); prev = cum; });
      const les = b.latency.buckets.map(([le]) => le);
      fmt = (i) => (les[i] == null ? "+Inf" : "≤" + (les[i] * 1e3).toFixed(1) + " ms");
      if (histKind !== k) { if (histPlot) histPlot.destroy(); histPlot = barPlot($("plot-hist"), "build latency", fmt); histKind = k; }
      histPlot.setData([xs, ys]);
      $("hist-stats").textContent = `${b.latency.count} events, mean ${(1e3 * b.latency.sum_s / Math.max(1, b.latency.count)).toFixed(2)} ms`;
      $("plot-hist").dataset.count = b.latency.count;
    }
  } else if (h) {
    if (histKind !== k) { if (histPlot) histPlot.destroy(); histPlot = barPlot($("plot-hist"), pick.options[pick.selectedIndex].text + " (" + h.unit + ")", fmt); histKind = k; }
    histPlot.setData(histData(h));
    const mean = h.count ? h.sum / h.count : 0;
    $("hist-stats").textContent = `${h.count} entries, mean ${h.unit === "bytes" ? bytes(mean) : h.unit === "ns" ? (mean / 1e6).toFixed(3) + " ms" : mean.toFixed(1)}` +
      (h.under || h.over ? `, ${h.under} under and ${h.over} over the range` : "");
    $("plot-hist").dataset.count = h.count;
  }
  // The data-quality view: the payload word's mean per source, as bars.
  if (rec) {
    const srcs = Object.keys(rec.payload_word).map(Number);
    if (!meansPlot) meansPlot = barPlot($("plot-means"), "payload word, mean per source", (v) => (v == null ? "" : String(v)));
    meansPlot.setData([srcs, srcs.map((s) => { const w = rec.payload_word[s]; return w.count ? w.sum / w.count : null; })]);
    $("plot-means").dataset.sources = srcs.length;
    // Events by trigger type, with the rate since the last look.
    const now = Date.now();
    rows($("trigger-types").tBodies[0], Object.entries(rec.trigger_types).map(([t, n]) => {
      const rate = lastTriggers && lastTriggers.run === r.run_number && r.running ? ((n - (lastTriggers.counts[t] || 0)) / ((now - lastTriggers.t) / 1e3)).toFixed(0) : "–";
      return `<tr><td>${esc(t)}</td><td>${n}</td><td>${rate}</td></tr>`;
    }));
    rows($("streams").tBodies[0], Object.entries(rec.streams || {}).map(([name, n]) => {
      const rate = lastTriggers && lastTriggers.run === r.run_number && r.running ? ((n - ((lastTriggers.streams || {})[name] || 0)) / ((now - lastTriggers.t) / 1e3)).toFixed(0) : "–";
      return `<tr><td>${esc(name)}</td><td>${n}</td><td>${rate}</td></tr>`;
    }));
    lastTriggers = { run: r.run_number, t: now, counts: rec.trigger_types, streams: rec.streams };
  }
}
$("hist-pick").addEventListener("change", refreshHistograms);

// History across runs: time in UTC on the x axis, one series per headline figure.
const historyPlot = new uPlot({
  title: "history", width: Math.max(300, $("plot-history").parentElement.clientWidth - 30), height: 200,
  scales: { x: { time: true }, pct: { range: [0, 100] } },
  tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),
  axes: [{ values: (u, splits) => splits.map((v) => new Date(v * 1e3).toISOString().slice(11, 19)) }, { size: 70, label: "events/s" }, { scale: "pct", side: 1, label: "%", grid: { show: false } }],
  series: [{ label: "UTC" },
    { label: "events/s", stroke: "#3b5bdb" },
    { label: "incomplete/s", stroke: "#b58900" },
    { label: "dead time %", stroke: "#c5221f", scale: "pct" },
    { label: "fullest buffer %", stroke: "#1e8e3e", scale: "pct" }],
}, [[], [], [], [], []], $("plot-history"));
let historyRuns = [];
async function refreshHistory() {
  const span = $("history-span").value;
  let q = span;
  if (span.startsWith("runs=")) {
    const n = Number(span.slice(5));
    if (!historyRuns.length) return;
    const last = historyRuns[0].number;
    q = `first_run=${Math.max(0, last - n + 1)}&last_run=${last}`;
  }
  try {
    const h = await getJSON("/api/history?" + q + "&limit=20000");
    historyPlot.setData([h.map((p) => p.unix_ns / 1e9), h.map((p) => p.events_per_s), h.map((p) => p.incomplete_per_s),
      h.map((p) => 100 * p.dead_time_fraction), h.map((p) => 100 * p.buffer_fraction)]);
    $("plot-history").dataset.points = h.length;
  } catch (e) { /* no run database yet */ }
}
$("history-span").addEventListener("change", refreshHistory);

// Transitions.
for (const b of document.querySelectorAll("#buttons button[data-t]")) {
  b.addEventListener("click", async () => {
    const t = b.dataset.t;
    $("message").textContent = t + "…";
    const body = (t === "start" || t === "stop") && $("comment").value ? { comment: $("comment").value } : null;
    try {
      await post("/api/transitions/" + t, body);
      $("message").textContent = "";
      if (t === "start" || t === "stop") $("comment").value = "";
    } catch (e) {
      $("message").textContent = e.message;
    }
    refresh();
    refreshRuns();
  });
}
$("operator").value = localStorage.getItem("tessera-operator") || "";

$("why-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const n = $("why-event").value;
  if (n === "") return;
  try {
    const w = await getJSON("/api/events/" + n + "/why");
    const lines = [`event ${w.event_id}: ${w.status}${w.builder != null ? " (builder " + w.builder + ")" : ""}`, w.explanation, ""];
    for (const l of w.links) {
      lines.push(`${l.missing ? "MISSING " : "        "}source ${l.source} RU ${l.readout_unit} link ${l.link_state} last event ${l.last_event_id ?? "-"}${Object.keys(l.rejected).length ? " rejected " + JSON.stringify(l.rejected) : ""}`);
    }
    $("why").textContent = lines.join("\n");
  } catch (e) {
    $("why").textContent = String(e.message);
  }
});

function showState(s) {
  const el = $("state");
  el.textContent = s.state;
  el.className = "state " + s.state;
  $("run-number").textContent = s.run_number ?? "–";
  $("busy").textContent = s.busy ? s.busy + " under way…" : (s.error ? "error: " + s.error : "");
  for (const b of document.querySelectorAll("#buttons button[data-t]")) {
    b.disabled = !!s.busy || !s.allowed.includes(b.dataset.t);
  }
  rows($("components").tBodies[0], s.components.map((c) =>
    `<tr><td>${esc(c.name)}</td><td>${esc(c.host ?? "")}</td><td class="${esc(c.state)}">${esc(c.state)}</td><td>${esc(linksOf(c.name))}</td><td>${esc(c.detail)}</td></tr>`));
  const ls = s.last_stop;
  $("last-stop").innerHTML = ls ? "<h2>Last stop</h2>" + ls.stages.map((x) =>
    `<div class="${x.finished ? "busy" : "blocked"}">${esc(x.stage)}: ${x.finished ? "done" : "deadline passed"} in ${x.elapsed_ms} ms (deadline ${x.deadline_ms} ms)${x.left ? " — " + esc(x.left) : ""}</div>`).join("") : "";
}

// Each component's links, from the live view: a readout unit's sources connected, a builder's
// and the recorder's links open.
let liveNow = null;
function linksOf(name) {
  const l = liveNow;
  if (!l) return "";
  let m = name.match(/^readout unit (\d+)/);
  if (m) {
    const src = l.sources.filter((x) => x.readout_unit === Number(m[1]));
    return `${src.filter((x) => x.link_state === "connected").length}/${src.length} sources connected`;
  }
  m = name.match(/^builder (\d+)/);
  if (m) {
    const b = l.builders.find((x) => x.id === Number(m[1]));
    return b ? `${b.links} links` : "";
  }
  if (name.startsWith("recorder") && l.recorder) return `${l.recorder.links} builder links`;
  return "";
}
// Each process (the run's, or each host's agent): CPU over the last look, memory, uptime.
let lastHosts = null;
function showProcesses(hosts) {
  const now = Date.now();
  rows($("processes").tBodies[0], hosts.map((h) => {
    const key = h.host || "this process";
    const prev = lastHosts && lastHosts.t < now && lastHosts.cpu[key];
    const cpu = prev != null ? (h.cpu_ns - prev) / 1e6 / (now - lastHosts.t) : null;
    const up = h.uptime_s >= 3600 ? (h.uptime_s / 3600).toFixed(1) + " h" : h.uptime_s >= 60 ? (h.uptime_s / 60).toFixed(1) + " min" : h.uptime_s.toFixed(0) + " s";
    return `<tr><td>${esc(key)}</td><td>${h.pid || ""}</td><td>${cpu == null ? "–" : (100 * cpu).toFixed(0) + "% of " + h.cpu_allowance.toFixed(1) + " cores"}</td><td>${bytes(h.rss_bytes || 0)}</td><td>${up}</td></tr>`;
  }));
  lastHosts = { t: now, cpu: Object.fromEntries(hosts.map((h) => [h.host || "this process", h.cpu_ns])) };
}

let lastRun = null;
// The live totals of the run under way, for its row in the run list (the database has its
// counts only once it ends).
let liveTotals = null;
// Shown while the server does not answer: nothing on the page may look current or clickable.
function unreachable(why) {
  const el = $("state");
  el.textContent = "unreachable";
  el.className = "state unreachable";
  for (const b of document.querySelectorAll("#buttons button[data-t]")) b.disabled = true;
  $("busy").textContent = "";
  $("message").textContent = "no answer from tessera (" + why + "): what is shown is from before";
  $("message").className = "alarm";
  document.body.classList.add("stale");
}
// Alarms raised now: those no one has seen to first (errors first), then the acknowledged and
// silenced, dimmed. Each can be acknowledged or silenced for an hour, with the operator's name.
function showAlarms(list) {
  const rank = (x) => (x.acknowledged_by || x.silenced_by ? 2 : 0) + (x.level === "error" ? 0 : 1);
  const a = [...list].sort((x, y) => rank(x) - rank(y));
  const html = a.map((x) => {
    const seen = x.acknowledged_by ? ` <span class="label">acknowledged by ${esc(x.acknowledged_by.split(" from ")[0])}</span>` : "";
    const quiet = x.silenced_by ? ` <span class="label">silenced by ${esc(x.silenced_by.split(" from ")[0])} until ${utc(x.silenced_until_unix_ns)}</span>` : "";
    const folded = x.folded && x.folded.length ? `<details><summary>${x.folded.length} consequences</summary>${x.folded.map((f) => "<div>" + esc(f) + "</div>").join("")}</details>` : "";
    const buttons = (x.acknowledged_by ? "" : `<button class="ack">acknowledge</button>`) + (x.silenced_by ? `<button class="unsilence">unsilence</button>` : `<button class="silence">silence 1 h</button>`);
    return `<div class="alarm-${esc(x.level)}${x.acknowledged_by || x.silenced_by ? " seen" : ""}" data-alarm="${esc(x.alarm)}" data-subject="${esc(x.subject)}"><b>${esc(x.level === "error" ? "ALARM" : "alarm")}</b> ${esc(x.subject)}: ${esc(x.message)}${seen}${quiet} ${buttons}${folded}</div>`;
  }).join("");
  // Redrawn only when it changed: a button under the operator's pointer stays where it is.
  if ($("alarms").dataset.html !== html) {
    $("alarms").innerHTML = html;
    $("alarms").dataset.html = html;
  }
}
$("alarms").addEventListener("click", async (ev) => {
  const b = ev.target.closest("button");
  if (!b) return;
  const d = b.closest("[data-alarm]").dataset;
  const body = { alarm: d.alarm, subject: d.subject };
  try {
    if (b.classList.contains("ack")) await post("/api/alarms/acknowledge", body);
    else await post("/api/alarms/silence", { ...body, seconds: b.classList.contains("silence") ? 3600 : 0 });
  } catch (e) { $("message").textContent = e.message; }
  refresh();
});
const RUNNING = ["running", "paused"];
async function refresh() {
  let v;
  try { v = await getJSON("/api/live"); } catch (e) { unreachable(e.message); return; }
  if (document.body.classList.contains("stale")) {
    document.body.classList.remove("stale");
    $("message").textContent = "";
    $("message").className = "";
  }
  tokenRequired = !!v.token_required;
  liveNow = v.live;
  if (v.live && v.live.hosts) showProcesses(v.live.hosts);
  $("btn-token").hidden = !tokenRequired || !!token();
  showState(v.state);
  showAlarms(v.alarms || []);
  showFaults(v.faults);
  showShipping(v.shipper);
  const taking = RUNNING.includes(v.state.state);
  const h = v.history.slice(-HISTORY);
  ratePlot.setData([h.map((p) => p.t), h.map((p) => p.events_per_s), h.map((p) => p.incomplete_per_s)]);
  throughputPlot.setData([h.map((p) => p.t), h.map((p) => p.built_bytes_per_s / 1e6), h.map((p) => p.recorded_bytes_per_s / 1e6)]);
  deadPlot.setData([h.map((p) => p.t), h.map((p) => 100 * p.dead_time_fraction), h.map((p) => 100 * p.buffer_fraction)]);
  showBuffers(h);
  // Dead time by the rule of the status line, /metrics and the report.
  const d = v.dead_time;
  $("dead-time").textContent = taking && d && d.interval_fraction != null ? (100 * d.interval_fraction).toFixed(1) + "%" : "0.0%";
  $("dead-time").className = taking && d && d.interval_fraction > 0.05 ? "blocked" : "";
  $("dead-time-run").textContent = d ? "run " + (100 * d.run_fraction).toFixed(1) + "%" : "";
  // After a stop the last run's totals stay on screen.
  const lr = v.last_run;
  $("last-run").innerHTML = !taking && lr ? `<span class="label">last run</span> <b>${lr.run_number}</b>: ${lr.events} events (${lr.events_incomplete} incomplete) in ${lr.duration_s.toFixed(1)} s, ${lr.events_per_s.toFixed(0)} events/s, ${bytes(lr.built_bytes_per_s)}/s, ${lr.rejected} rejected fragments, dead time ${(100 * lr.dead_time_fraction).toFixed(1)}%, balance ${lr.balance_holds ? "holds" : '<span class="blocked">broken</span>'} (${esc(lr.stop_reason)})` : "";
  // Rates are of a run taking data; after it, they are zero, not the last value seen.
  const last = taking && h.length ? h[h.length - 1] : null;
  $("events-rate").textContent = last ? human(last.events_per_s, "") : "0";
  $("built-rate").textContent = last ? human(last.built_bytes_per_s, "B/s") : "0";
  $("recorded-rate").textContent = last ? human(last.recorded_bytes_per_s, "B/s") : "0";
  const live = v.live;
  if (live) {
    lastRun = live.run_number;
    const ev = live.builders.reduce((a, b) => a + b.events_complete + b.events_incomplete, 0);
    const inc = live.builders.reduce((a, b) => a + b.events_incomplete, 0);
    const rej = live.sources.reduce((a, s) => a + Object.values(s.rejected).reduce((x, y) => x + y, 0), 0);
    $("events-total").textContent = ev;
    // Bytes built, as the run database counts them.
    const rb = live.builders.reduce((a, b) => a + b.bytes_built, 0);
    liveTotals = taking ? { run: live.run_number, events: ev, incomplete: inc, bytes: rb } : null;
    showCurrentFile(taking && live.recorder ? live.recorder.current_file : null);
    $("incomplete-total").textContent = inc;
    $("rejected-total").textContent = rej;
    const rec = live.recorder;
    $("disk").innerHTML = rec && rec.disk_free ? `disk: ${bytes(rec.disk_free)} free` +
      (rec.disk_full ? ' <span class="blocked">FULL: the run stops</span>' : rec.disk_low ? ' <span class="blocked">LOW: writes slowed</span>' : "") : "";
    $("ru-buffers").innerHTML = live.readout_units.map((u) => {
      const f = u.buffer_limit ? u.buffer_used / u.buffer_limit : 0;
      return `<div>RU ${u.id}${u.host ? " on " + esc(u.host) : ""}${u.busy ? ' <span class="blocked">BUSY</span>' : ""}<div class="bar"><div style="width:${(100 * f).toFixed(1)}%"></div><span>${(100 * f).toFixed(1)}% of ${bytes(u.buffer_limit)}</span></div></div>`;
    }).join("");
    const maxEv = Math.max(0, ...live.sources.map((s) => s.last_event_id ?? 0));
    rows($("alignment").tBodies[0], live.sources.map((s) => {
      const behind = s.last_event_id == null ? "–" : maxEv - s.last_event_id;
      const rj = Object.entries(s.rejected).map(([k, n]) => `${esc(k)} ${n}`).join(", ");
      return `<tr><td>${s.id}${s.kind === "external" ? " (ext)" : ""}</td><td>${s.readout_unit}</td><td>${esc(s.link_state)}</td><td>${s.last_event_id ?? "–"}</td><td class="${behind > 1000 ? "blocked" : ""}">${behind}</td><td>${rj}</td></tr>`;
    }));
  }
  if (!live || !taking) {
    liveTotals = null;
    showCurrentFile(null);
  }
  const r = v.rates;
  if (r && live && taking) {
    rows($("stages").tBodies[0], r.stages.map((s) =>
      `<tr><td>${esc(s.stage)}</td><td>${esc(s.host || "")}</td><td class="${esc(s.condition)}">${esc(s.condition)}</td><td>${esc(s.why)}</td></tr>`));
    $("bottleneck").textContent = "bottleneck: " + r.bottleneck;
    $("bottleneck").className = "bottleneck" + (r.bottleneck.startsWith("none") ? "" : " named");
    // The trigger: offered against accepted, dead time over the interval and the run's vetoes.
    const t = live.trigger;
    $("trigger").textContent = t
      ? `trigger (${t.policy}): ${r.trigger_offered_per_s.toFixed(0)}/s offered, ${r.trigger_accepted_per_s.toFixed(0)}/s accepted, dead time ${(100 * r.dead_time_fraction).toFixed(1)}%; run: ${t.offered} offered, ${t.accepted} accepted, ${t.vetoed} vetoed`
      : "";
  } else {
    $("trigger").textContent = "";
    // No run taking data: no stage is blocked, whatever the last look said.
    rows($("stages").tBodies[0], []);
    $("bottleneck").textContent = "no run taking data";
    $("bottleneck").className = "bottleneck";
  }
}

// The shipper's backlog: between runs too, as files drain after the run that wrote them.
function showShipping(s) {
  const el = $("shipping");
  if (!s) { el.innerHTML = ""; return; }
  let t = `shipping to ${s.destinations.map(esc).join(", ")}: `;
  if (s.backlog_files === 0) {
    t += "every finished file verified";
  } else {
    t += `<span class="${s.failed > 0 ? "blocked" : ""}">${s.backlog_files} files, ${bytes(s.backlog_bytes)} waiting</span>, oldest ${s.oldest_s.toFixed(0)} s`;
    if (s.drain_s != null) t += `, ~${s.drain_s.toFixed(0)} s to drain`;
  }
  t += ` · verified ${s.verified}, freed locally ${s.deleted}`;
  if (s.failed > 0) t += ` · <span class="blocked">${s.failed} failed copies</span>`;
  if (s.last_error) t += `<br><span class="label">last failure: ${esc(s.last_error)}</span>`;
  el.innerHTML = t;
}

// The file the recorder is writing, above the finished ones.
function showCurrentFile(f) {
  const tb = $("files").tBodies[0];
  const old = tb.querySelector("tr.writing");
  if (old) old.remove();
  if (!f) return;
  const tr = document.createElement("tr");
  tr.className = "writing";
  tr.innerHTML = `<td>${esc(f.file)} (being written)</td><td>${f.events}</td><td>${bytes(f.size_bytes)}</td><td>–</td>`;
  tb.prepend(tr);
}

async function refreshRuns() {
  try {
    const runs = await getJSON("/api/runs?limit=20");
    historyRuns = runs;
    rows($("runs").tBodies[0], runs.map((r) => {
      if (liveTotals && liveTotals.run === r.number && !r.stopped_unix_ns) {
        r = { ...r, events: liveTotals.events, incomplete: liveTotals.incomplete, bytes: liveTotals.bytes };
      }
      const dur = r.stopped_unix_ns ? ((r.stopped_unix_ns - r.started_unix_ns) / 1e9).toFixed(1) + " s" : "running";
      const bal = r.balance_holds == null ? "–" : (r.balance_holds ? "holds" : '<span class="blocked">broken</span>');
      return `<tr data-run="${r.number}"><td>${r.number}</td><td class="${r.state === "error" ? "failed" : ""}">${esc(r.state)}</td><td>${utc(r.started_unix_ns)}</td><td>${dur}</td><td>${r.events}</td><td>${r.incomplete}</td><td>${bytes(r.bytes)}</td><td>${bal}</td><td>${esc(r.stop_reason ?? "")}${r.error ? " — " + esc(r.error) : ""}</td><td>${esc(r.comment)}</td></tr>`;
    }));
  } catch (e) { /* not configured yet */ }
  try {
    const rep = await getJSON("/api/report");
    const files = (rep.recorder && rep.recorder.files) || [];
    const writing = $("files").tBodies[0].querySelector("tr.writing");
    rows($("files").tBodies[0], files.map((f) =>
      `<tr><td>${esc(f.file)}</td><td>${f.events}</td><td>${bytes(f.size_bytes)}</td><td>${esc(f.file_crc32c)}</td></tr>`));
    if (writing) $("files").tBodies[0].prepend(writing);
  } catch (e) { /* no run yet */ }
}

// The notes of the open run, or of the last one.
async function refreshNotes() {
  const n = lastRun ?? (historyRuns[0] && historyRuns[0].number);
  if (n == null) return;
  try {
    const r = await getJSON("/api/runs/" + n);
    $("notes-run").textContent = "run " + n;
    $("notes").dataset.run = n;
    rows($("notes").tBodies[0], r.notes.map((x) =>
      `<tr><td>${utc(x.unix_ns)}</td><td>${esc(x.who.split(" from ")[0])}</td><td class="label">${esc(x.kind)}</td><td>${esc(x.text)}</td></tr>`));
  } catch (e) { /* no such run yet */ }
}
// The run's configuration (secrets redacted, as the run database keeps it) and what changed
// since the run before: a line diff.
function lineDiff(a, b) {
  const n = a.length, m = b.length;
  if (n * m > 4e6) return ["(too long to compare here: tessera runs show --json has both)"];
  const L = Array.from({ length: n + 1 }, () => new Uint32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--) L[i][j] = a[i] === b[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  const out = [];
  let i = 0, j = 0;
  while (i < n || j < m) {
    if (i < n && j < m && a[i] === b[j]) { i++; j++; }
    else if (j < m && (i === n || L[i][j + 1] >= L[i + 1][j])) out.push("+ " + b[j++]);
    else out.push("- " + a[i++]);
  }
  return out;
}
let configShown = null;
async function refreshConfig() {
  const n = lastRun ?? (historyRuns[0] && historyRuns[0].number);
  if (n == null || configShown === n) return;
  try {
    const r = await getJSON("/api/runs/" + n);
    $("config-run").textContent = `run ${n}, ${r.config_origin}, sha256 ${r.config_sha256.slice(0, 12)}…`;
    $("config").textContent = r.config;
    let diff = "no run before it";
    const prev = historyRuns.find((x) => x.number < n);
    if (prev) {
      const p = await getJSON("/api/runs/" + prev.number);
      const d = lineDiff(p.config.split("\n"), r.config.split("\n"));
      diff = d.length ? `changes since run ${prev.number}:\n` + d.join("\n") : `the same as run ${prev.number}`;
    }
    $("config-diff").textContent = diff;
    $("config-diff-summary").textContent = "the topology of the run · " + diff.split("\n")[0];
    configShown = n;
  } catch (e) { /* no such run yet */ }
}

// Fault rehearsal: from the page as from `tessera fault`, through the same API.
$("fault-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const target = $("fault-target").value;
  const body = { target, kind: $("fault-kind").value, seconds: Number($("fault-seconds").value) };
  if (target === "source") body.id = Number($("fault-id").value);
  if ($("fault-value").value !== "") body.value = Number($("fault-value").value);
  try {
    const r = await post("/api/faults", body);
    $("fault-result").textContent = r.result.replace(/^ok: /, "");
    $("fault-result").className = "";
  } catch (e) {
    $("fault-result").textContent = "refused: " + e.message;
    $("fault-result").className = "blocked";
  }
  refresh();
});
function showFaults(list) {
  const html = (list || []).map((f) =>
    `<div class="fault">FAULT REHEARSAL ${esc(f.result.replace(/^ok: /, ""))} <span class="label">by ${esc(f.who.split(" from ")[0])}, until ${utc(f.until_unix_ns)}</span></div>`).join("");
  if ($("faults").dataset.html !== html) { $("faults").innerHTML = html; $("faults").dataset.html = html; }
}

$("note-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("note-text").value.trim();
  const n = $("notes").dataset.run;
  if (!text || !n) return;
  try {
    await post("/api/runs/" + n + "/notes", { text });
    $("note-text").value = "";
  } catch (e) { $("message").textContent = e.message; }
  refreshNotes();
});

// The sampled event: its header fields, and each fragment's payload plotted as words of the
// configured type (one series per source), made again when the set of sources changes.
let samplePlot = null;
let sampleSources = "";
function showSample(s) {
  const row = (k, v) => `<tr><td class="label">${esc(k)}</td><td>${v}</td></tr>`;
  rows($("sample-head").tBodies[0], [
    row("run, event", `${s.run_number}, ${s.event_id}`),
    row("trigger type", s.trigger_type),
    row("trigger time", (s.timestamp / 1e9).toFixed(6) + " s"),
    row("builder", s.builder_id),
    row("fragments, size", `${s.fragment_count}, ${bytes(s.record_size)}`),
    row("flags", s.flags.length ? `<span class="blocked">${s.flags.map(esc).join(", ")}</span>` : "none"),
    row("missing sources", s.missing.length ? `<span class="blocked">${s.missing.join(", ")}</span>` : "none"),
  ]);
  const frags = s.fragments || [];
  const names = frags.map((f) => String(f.source)).join("|");
  if (!samplePlot || names !== sampleSources) {
    sampleSources = names;
    if (samplePlot) samplePlot.destroy();
    const colors = ["#3b5bdb", "#1e8e3e", "#b58900", "#c5221f", "#7048e8", "#0b7285", "#e8590c", "#5c940d"];
    samplePlot = new uPlot({
      title: "payload as " + s.word_type + " words, per source", width: Math.max(300, $("plot-sample").parentElement.clientWidth - 30), height: 200,
      scales: { x: { time: false } }, axes: [{ label: "word" }, { size: 60 }],
      series: [{ label: "word" }, ...frags.map((f, i) => ({ label: "source " + f.source, stroke: colors[i % colors.length], points: { show: false } }))],
    }, [[], ...frags.map(() => [])], $("plot-sample"));
  }
  const n = Math.max(0, ...frags.map((f) => f.words.length));
  samplePlot.setData([[...Array(n).keys()], ...frags.map((f) => f.words.length ? f.words : [null])]);
  $("plot-sample").dataset.sources = frags.length;
}

async function refreshSample() {
  // The sampled event attaches a monitor consumer: a call that needs the token where one is set.
  if (!mayChange()) return;
  try {
    const s = await getJSON("/api/sample", true);
    showSample(s);
    $("sample").textContent = `run ${s.run_number} event ${s.event_id} trigger ${s.trigger_type} builder ${s.builder_id} fragments ${s.fragment_count} size ${s.record_size}` +
      (s.flags.length ? " [" + s.flags.join(",") + "]" : "") + (s.missing.length ? " missing " + s.missing.join(",") : "") +
      "\n\n" + s.text + "\n\nrecord:\n" + s.hex.join("\n");
  } catch (e) { /* none yet */ }
}

// The message log: the newest lines first, the last 200 kept on the page.
let logAfter = 0;
async function refreshLog() {
  try {
    const l = await getJSON("/api/log?after=" + logAfter + "&limit=500");
    logAfter = l.next;
    const tb = $("log").tBodies[0];
    for (const x of l.lines) {
      const tr = document.createElement("tr");
      tr.className = x.level === "ERROR" ? "failed" : (x.level === "WARN" ? "blocked" : "");
      tr.innerHTML = `<td>${utc(x.unix_ns)}</td><td>${esc(x.host || "run control")}</td><td>${esc(x.role)}</td><td>${esc(x.level)}</td><td>${esc(x.message)}</td>`;
      tb.prepend(tr);
    }
    while (tb.rows.length > 200) tb.deleteRow(tb.rows.length - 1);
  } catch (e) { /* server away: the state box says so */ }
}

// The first look says whether a token is needed: asked for once, before any call needing it.
refresh().finally(() => {
  if (tokenRequired && !token()) askToken();
  refreshSample();
  setInterval(refreshSample, 2000);
});
refreshRuns().then(() => { refreshHistory(); refreshNotes(); });
refreshLog();
refreshHistograms();
setInterval(refreshHistograms, 2000);
setInterval(refreshHistory, 5000);
setInterval(refreshNotes, 3000);
setInterval(refreshConfig, 3000);
setInterval(refreshLog, 2000);
setInterval(refresh, 1000);
setInterval(refreshRuns, 3000);
