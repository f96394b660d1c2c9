// A slow disk seen from the page: one alarm naming the bottleneck (not one per full buffer and
// blocked stage), acknowledged and silenced from the page with the operator's name, kept in the
// run database; and dead time agreeing between the page, the status line, /metrics and the run
// report of the same run. Runs `tessera run --control` for real.
//
//   TESSERA_BIN     the binary (default: target/release/tessera)
//   SCREENSHOT      where to write the screenshot (default: target/dashboard-alarm.png)
import { until, launch } from "./common.mjs";
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync, readFileSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const bin = process.env.TESSERA_BIN || join(root, "target/release/tessera");
const shot = process.env.SCREENSHOT || join(root, "target/dashboard-alarm.png");
const dir = mkdtempSync(join(tmpdir(), "tessera-alarms-"));
const out = join(dir, "data");
writeFileSync(join(dir, "t.toml"), `
[run]
output = "${out}"
status_interval_ms = 300
[sources]
count = 8
fragment_size = "4 KiB"
trigger = "periodic"
rate_hz = 2000
[[readout]]
id = 0
sources = "0-3"
buffer = "20 MiB"
[[readout]]
id = 1
sources = "4-7"
buffer = "20 MiB"
[recorder]
fsync = false
throttle = "5 MB"
[alarms]
blocked_s = 2
[stop]
sources_ms = 5000
readout_ms = 5000
builders_ms = 5000
recorder_ms = 5000
`);

const tessera = spawn(bin, ["run", join(dir, "t.toml"), "--control", "--http", "127.0.0.1:0"], { stdio: ["ignore", "pipe", "pipe"] });
// The status lines on stderr; each run's summary on stdout.
let stderr = "";
let stdout = "";
tessera.stderr.on("data", (d) => { stderr += d; });
tessera.stdout.on("data", (d) => { stdout += d; });
let exited = null;
tessera.on("exit", (code) => { exited = code; });
let browser;
try {
  const addrFile = join(out, "control.addr");
  const addr = await until("control.addr", () => {
    if (exited !== null) throw new Error("tessera run exited with " + exited + ": " + stderr);
    return existsSync(addrFile) && readFileSync(addrFile, "utf8").trim();
  });
  const api = async (path) => (await fetch(`http://${addr}${path}`)).json();
  browser = await launch();
  const page = await browser.newPage({ viewport: { width: 1400, height: 1300 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(`http://${addr}/`);
  await until("the configured state", async () => (await page.textContent("#state")) === "configured");
  await page.fill("#operator", "shifter");
  await page.click("#btn-start");
  await until("the running state", async () => (await page.textContent("#state")) === "running");

  // The disk holds everything: one banner, the bottleneck, naming the recorder and what it holds.
  await until("one alarm, the bottleneck", async () => {
    const a = await page.locator("#alarms > div").evaluateAll((d) => d.map((x) => x.dataset.alarm));
    return a.length === 1 && a[0] === "bottleneck";
  }, 60000);
  const text = await page.textContent('#alarms div[data-alarm="bottleneck"]');
  assert.match(text, /bottleneck recorder/, text);
  assert.match(text, /it holds /, text);
  // Dead time, the consequence, is on the page as a number.
  await until("dead time on the page", async () => parseFloat(await page.textContent("#dead-time")) > 0);

  await page.click('#alarms div[data-alarm="bottleneck"] button.ack');
  await until("acknowledged", async () => (await page.textContent("#alarms")).includes("acknowledged by shifter"));
  await page.click('#alarms div[data-alarm="bottleneck"] button.silence');
  await until("silenced", async () => (await page.textContent("#alarms")).includes("silenced by shifter until"));
  await page.screenshot({ path: shot, fullPage: true });
  const rec = await api("/api/runs/1");
  assert.deepEqual(rec.alarm_actions.map((a) => [a.action, a.alarm, a.subject]),
    [["acknowledge", "bottleneck", "data path"], ["silence", "bottleneck", "data path"]]);
  assert.ok(rec.alarm_actions.every((a) => a.who.startsWith("shifter from 127.0.0.1")), JSON.stringify(rec.alarm_actions));
  // ... and in the message log, with the name.
  await until("the acknowledgement in the log", async () => (await page.textContent("#log")).includes("alarm acknowledged by shifter"));

  // Dead time: paused, nothing moves, so the page, the status line, /metrics and (after the
  // stop) the report must give the run's one figure.
  await page.click("#btn-pause");
  await until("paused", async () => (await page.textContent("#state")) === "paused");
  const live = await api("/api/live");
  const pct = (f) => (100 * f).toFixed(1);
  const run = live.dead_time.run_fraction;
  assert.ok(run > 0.05, "a slow disk under a 2 kHz trigger gives dead time: " + run);
  await until("the page's run figure", async () => (await page.textContent("#dead-time-run")) === "run " + pct(run) + "%");
  const metrics = await (await fetch(`http://${addr}/metrics`)).text();
  const m = metrics.match(/^tessera_run_dead_time_fraction(?:\{[^}]*\})? ([0-9.e+-]+)$/m);
  assert.ok(m, "tessera_run_dead_time_fraction in /metrics");
  assert.equal(pct(Number(m[1])), pct(run), "/metrics against /api/live");
  const mark = stderr.length;
  await until("a status line while paused", () => /paused .*dead \d+% \(run [\d.]+%/.test(stderr.slice(mark)));
  const lines = stderr.slice(mark).split(/\r|\n/).filter((l) => /paused .*dead \d+% \(run [\d.]+%/.test(l));
  assert.equal(lines[lines.length - 1].match(/\(run ([\d.]+)%/)[1], pct(run), "the status line: " + lines[lines.length - 1]);
  await page.click("#btn-stop");
  // The stop's deadlines are short: what the slow disk has not taken by then is counted still
  // buffered, and the balance still holds.
  await until("stopped", async () => (await page.textContent("#state")) === "stopped", 120000);
  const report = await api("/api/report");
  assert.equal(pct(report.dead_time_fraction), pct(run), "the report");
  await until("the run's summary", () => stdout.includes("run 1 ended"));
  assert.match(stdout, new RegExp("dead time " + pct(run).replace(".", "\\.") + "% \\("), "the summary");
  assert.deepEqual(errors, [], "errors in the page");
  console.log("dashboard alarms test: ok (screenshot " + shot + ")");
} finally {
  if (browser) await browser.close();
  tessera.kill("SIGINT");
  await until("tessera to exit", () => exited !== null, 60000).catch(() => tessera.kill("SIGKILL"));
  rmSync(dir, { recursive: true, force: true });
}
