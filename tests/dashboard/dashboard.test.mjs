// The dashboard in headless Chromium, driven by Playwright: load it, press Start, see the rates
// move, press Stop, see the run in the list. Runs `tessera run --control` for real.
//
//   TESSERA_BIN     the binary (default: target/release/tessera)
//   SCREENSHOT      where to write the screenshot (default: target/dashboard.png)
import { sleep, until, launch } from "./common.mjs";
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync, readFileSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const bin = process.env.TESSERA_BIN || join(root, "target/release/tessera");
const shot = process.env.SCREENSHOT || join(root, "target/dashboard.png");
const dir = mkdtempSync(join(tmpdir(), "tessera-dashboard-"));
const out = join(dir, "data");
writeFileSync(join(dir, "t.toml"), `
[run]
output = "${out}"
[sources]
count = 8
fragment_size = "4 KiB"
size_spread = "2 KiB"
trigger = "poisson"
rate_hz = 3000
[[readout]]
id = 0
sources = "0-3"
[[readout]]
id = 1
sources = "4-7"
[recorder]
compression = "lz4"
fsync = false
[shipper]
to = ["${join(dir, "archive")}"]
interval_s = 0.5
[stop]
sources_ms = 5000
readout_ms = 5000
builders_ms = 5000
recorder_ms = 5000
`);

const tessera = spawn(bin, ["run", join(dir, "t.toml"), "--control", "--quiet", "--http", "127.0.0.1:0"], { stdio: ["ignore", "inherit", "inherit"] });
let exited = null;
tessera.on("exit", (code) => { exited = code; });
let browser;
try {
  const addrFile = join(out, "control.addr");
  const addr = await until("control.addr", () => {
    if (exited !== null) throw new Error("tessera run exited with " + exited);
    return existsSync(addrFile) && readFileSync(addrFile, "utf8").trim();
  });
  browser = await launch();
  const page = await browser.newPage({ viewport: { width: 1400, height: 1300 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(`http://${addr}/`);
  await until("the configured state", async () => (await page.textContent("#state")) === "configured");
  assert.equal(await page.isDisabled("#btn-stop"), true, "stop is not offered before a start");

  await page.fill("#operator", "playwright");
  await page.fill("#comment", "dashboard test");
  await page.click("#btn-start");
  await until("the running state", async () => (await page.textContent("#state")) === "running");
  // Rates move: the events/s figure leaves zero and the event count grows between two looks.
  await until("a rate", async () => Number((await page.textContent("#events-rate")).replace(/[^0-9.]/g, "")) > 0);
  const n1 = Number(await page.textContent("#events-total"));
  await until("more events", async () => Number(await page.textContent("#events-total")) > n1);
  await until("stages with a bottleneck", async () => (await page.textContent("#bottleneck")).startsWith("bottleneck:"));
  // The demo's periodic trigger, one for all sources: offered, accepted and dead time.
  await until("the trigger line", async () => /^trigger \(veto\): \d+\/s offered, \d+\/s accepted, dead time [\d.]+%; run: \d+ offered/.test(await page.textContent("#trigger")));
  await until("readout buffers", async () => (await page.locator("#ru-buffers .bar").count()) === 2);
  await until("alignment rows", async () => (await page.locator("#alignment tbody tr").count()) === 8);
  await until("a sampled event", async () => (await page.textContent("#sample")).startsWith("run 1 event") || errors.length > 0);
  assert.deepEqual(errors, [], "errors in the page");
  // The file being written is listed while the run goes on, and the run's row counts live.
  await until("the file being written", async () => (await page.locator("#files tbody tr.writing").count()) === 1);
  assert.match(await page.textContent("#files tbody tr.writing td"), /\.tsr\.part \(being written\)$/);
  await until("run 1 counting in the run list", async () => {
    const c = await page.locator('#runs tbody tr[data-run="1"] td').allTextContents();
    return c.length > 4 && Number(c[4]) > 0;
  });
  // The bottleneck is red only when it names one.
  const bn = await page.evaluate(() => [document.getElementById("bottleneck").textContent, document.getElementById("bottleneck").className]);
  assert.equal(bn[1].includes("named"), !bn[0].startsWith("bottleneck: none"), "bottleneck " + bn);
  // The sampled event's header fields, and every source's payload plotted as words.
  assert.match(await page.textContent("#sample-head"), /run, event1, \d+/);
  assert.match(await page.textContent("#sample-head"), /missing sourcesnone/);
  await until("the payload plot", async () => (await page.getAttribute("#plot-sample", "data-sources")) === "8");
  await page.click("#sample-head + div + details summary");
  // The sampled event's hex fits its box: nothing cut off on the right.
  assert.ok(await page.evaluate(() => { const e = document.getElementById("sample"); return e.scrollWidth <= e.clientWidth; }), "sampled event cut off");
  // The plots have data.
  await until("plotted points", () => page.evaluate(() => document.querySelectorAll("#plot-rate canvas").length > 0));
  // The programs view: each component's links, the process's CPU, memory and uptime.
  await until("links per component", async () => (await page.textContent("#components")).includes("4/4 sources connected"));
  await until("the process's CPU", async () => /this process\d+\d+% of [\d.]+ cores[\d.]+ (MB|GB)/.test(await page.textContent("#processes")));
  // Histograms filled from the data path: every source's fragment sizes and payload word, the
  // payload word's mean per source, events by trigger type.
  await until("a histogram with entries", async () => Number(await page.getAttribute("#plot-hist", "data-count")) > 0);
  const picks = await page.locator("#hist-pick option").allTextContents();
  for (const want of ["event size", "time between triggers", "fragment size, source 7", "payload word, source 0", "build latency, builder 1"]) {
    assert.ok(picks.includes(want), want + " not among " + picks);
  }
  await page.selectOption("#hist-pick", { label: "payload word, source 3" });
  await until("source 3's payload word", async () => (await page.textContent("#plot-hist")).includes("payload word, source 3"));
  assert.equal(await page.getAttribute("#plot-means", "data-sources"), "8");
  await until("events by trigger type", async () => (await page.locator("#trigger-types tbody tr").count()) > 0);
  await until("events by stream", async () => (await page.textContent("#streams tbody")).startsWith("main"));
  // Each buffer's occupancy over time: one series per readout unit, builder and the recorder.
  await until("the buffer plot", async () => (await page.textContent("#plot-buffers")).includes("RU 1"));
  // A fault rehearsed from the page: refused with the reason where it cannot be done, shown
  // while it lasts, and its consequence named (source 5 missing from incomplete events).
  await page.selectOption("#fault-target", "source");
  await page.fill("#fault-id", "42");
  await page.selectOption("#fault-kind", "skip");
  await page.click("#fault-form button");
  await until("the refusal", async () => (await page.textContent("#fault-result")).startsWith("refused: source 42 is not an emulated source"));
  await page.fill("#fault-id", "5");
  await page.fill("#fault-seconds", "2");
  await page.click("#fault-form button");
  await until("the fault shown", async () => (await page.textContent("#faults")).includes("FAULT REHEARSAL source 5: skip on every event for 2 s"));
  await until("events built without source 5", async () => Number(await page.textContent("#incomplete-total")) > 0);
  await until("the fault over", async () => (await page.textContent("#faults")) === "", 30000);
  // Dead time is a headline figure, over the interval and the run.
  assert.match(await page.textContent("#dead-time"), /^\d+\.\d%$/);
  await until("the run's dead time", async () => /^run \d+\.\d%$/.test(await page.textContent("#dead-time-run")));
  // A note while the run goes on, beside the start's comment.
  await until("the start comment among the notes", async () => (await page.textContent("#notes")).includes("dashboard test"));
  await page.fill("#note-text", "crate 3 reset");
  await page.click("#note-form button");
  await until("the note", async () => (await page.textContent("#notes")).includes("crate 3 reset"));
  // Times as the logs give them: UTC, ISO 8601.
  await until("log lines", async () => (await page.locator("#log tbody tr").count()) > 0);
  assert.match(await page.locator("#log tbody tr td").first().textContent(), /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$/);

  await page.fill("#comment", "end of test fill");
  await page.click("#btn-stop");
  await until("the stopped state", async () => (await page.textContent("#state")) === "stopped");
  // The last run's totals stay on screen, and its history is kept (plotted over runs).
  await until("the last run's totals", async () => /^last run 1: \d+ events/.test(await page.textContent("#last-run")));
  assert.match(await page.textContent("#last-run"), /balance holds/);
  await until("history points", async () => Number(await page.getAttribute("#plot-history", "data-points")) > 0, 30000);
  const notes = (await (await fetch(`http://${addr}/api/runs/1`)).json()).notes;
  assert.deepEqual(notes.map((n) => [n.kind, n.text]), [["start", "dashboard test"], ["note", "crate 3 reset"], ["stop", "end of test fill"]]);
  assert.ok(notes.every((n) => n.who.startsWith("playwright from 127.0.0.1")), JSON.stringify(notes));
  const row = page.locator('#runs tbody tr[data-run="1"]');
  await until("run 1 in the run list", async () => (await row.count()) === 1);
  const cells = await row.locator("td").allTextContents();
  assert.equal(cells[1], "stopped");
  assert.ok(Number(cells[4]) > 0, "run 1 has events: " + cells);
  assert.equal(cells[7], "holds", "balance: " + cells);
  assert.equal(cells[9], "dashboard test");
  assert.match(cells[6], /^[0-9.]+ (B|kB|MB|GB)$/, "sizes in the command line's units: " + cells);
  // Stopped: no stage shown blocked, no rate left on screen, no file being written.
  await until("the stages cleared", async () => (await page.textContent("#bottleneck")) === "no run taking data");
  assert.equal(await page.locator("#stages tbody tr").count(), 0);
  assert.equal(await page.textContent("#events-rate"), "0");
  assert.equal(await page.locator("#files tbody tr.writing").count(), 0);
  await until("files of run 1", async () => (await page.locator("#files tbody tr").count()) > 0);
  // The shipper drains after the run: its line says so once the run's file is verified, and the
  // archive holds it.
  await until("the shipper drained", async () => {
    const t = await page.textContent("#shipping");
    return t.includes("every finished file verified") && !t.includes("verified 0,");
  });
  assert.ok((await page.textContent("#shipping")).startsWith("shipping to " + join(dir, "archive")));
  assert.ok(existsSync(join(dir, "archive", "run000001_0001.tsr")), "run 1's file in the archive");
  // The message log shows what the run control said, with its role.
  await until("the message log", async () =>
    (await page.locator("#log tbody tr").count()) > 0 && (await page.textContent("#log")).includes("transition done"));
  assert.ok((await page.textContent("#log")).includes("run_control"), "the log names the role");
  await page.fill("#why-event", "10");
  await page.click("#why-form button");
  await sleep(300);
  assert.deepEqual(errors, [], "errors in the page");
  // The actions were logged with who asked.
  const actions = await (await fetch(`http://${addr}/api/runs/1`)).json();
  assert.ok(actions.actions.some((a) => a.action === "start" && a.who.startsWith("playwright from 127.0.0.1")), JSON.stringify(actions.actions));

  // Back to running for the picture: a dashboard with moving plots.
  await page.click("#btn-start");
  await until("run 2 running", async () => (await page.textContent("#run-number")) === "2");
  // The configuration view: run 2's topology, the same as run 1's.
  await until("run 2's configuration", async () => (await page.textContent("#config-diff")) === "the same as run 1");
  assert.match(await page.textContent("#config"), /\[sources\]/);
  await sleep(4000);
  await page.screenshot({ path: shot, fullPage: true });
  await page.click("#btn-stop");
  await until("stopped again", async () => (await page.textContent("#state")) === "stopped");
  // The server gone: the page says so and offers nothing to click.
  tessera.kill("SIGINT");
  await until("tessera to exit", () => exited !== null, 60000);
  await until("the unreachable state", async () => (await page.textContent("#state")) === "unreachable");
  for (const b of ["configure", "start", "pause", "resume", "stop", "reset"]) {
    assert.equal(await page.isDisabled("#btn-" + b), true, b + " offered with the server gone");
  }
  console.log("dashboard test: ok (screenshot " + shot + ")");
} finally {
  if (browser) await browser.close();
  tessera.kill("SIGINT");
  await until("tessera to exit", () => exited !== null, 60000).catch(() => tessera.kill("SIGKILL"));
  rmSync(dir, { recursive: true, force: true });
}
