// The dashboard of a run spread over hosts, in headless Chromium: three node agents (separate
// processes, each its own host to Tessera: fe1 and fe2 with a readout unit and their sources,
// be with the builder, the recorder and the monitor), one run control. One view must cover
// them all: components and stages with their hosts, the sampled event from the recorder's
// host, every host's lines in the message log, and an alarm naming a host whose agent dies.
// On loopback, so that it runs wherever the other dashboard test runs (the same run over
// network namespaces is crates/cli/tests/cluster.rs).
//
//   TESSERA_BIN     the binary (default: target/release/tessera)
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync, readFileSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";
import { sleep, until, launch } from "./common.mjs";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const bin = process.env.TESSERA_BIN || join(root, "target/release/tessera");
const dir = mkdtempSync(join(tmpdir(), "tessera-dashboard-hosts-"));
const TOKEN = "dashboard-hosts-token";
const env = { ...process.env, TESSERA_TOKEN: TOKEN };

const procs = [];
function start(args, name) {
  const p = spawn(bin, args, { env, stdio: ["ignore", "inherit", "pipe"] });
  const me = { p, name, exited: null, err: "" };
  p.on("exit", (code, sig) => { me.exited = code ?? sig; });
  p.stderr.on("data", (d) => { me.err += d; process.stderr.write(d); });
  procs.push(me);
  return me;
}

let browser;
try {
  // Agents bind a free port each and say which.
  const agents = {};
  for (const h of ["fe1", "fe2", "be"]) {
    const a = start(["node", "--listen", "127.0.0.1:0", "--output", join(dir, h)], h);
    agents[h] = await until(`the agent of ${h}`, () => {
      if (a.exited !== null) throw new Error(`the agent of ${h} exited with ${a.exited}`);
      const m = a.err.match(/waiting for the run control at (\S+)/);
      return m && { proc: a, addr: m[1] };
    });
  }
  const out = join(dir, "control");
  writeFileSync(join(dir, "t.toml"), `
[run]
output = "${out}"
[sources]
count = 8
fragment_size = "2 KiB"
trigger = "periodic"
rate_hz = 2000
[[readout]]
id = 0
host = "fe1"
sources = "0-3"
[[readout]]
id = 1
host = "fe2"
sources = "4-7"
[[builder]]
id = 0
host = "be"
[recorder]
host = "be"
fsync = false
[control]
agent_timeout_ms = 2000
[stop]
sources_ms = 3000
readout_ms = 3000
builders_ms = 3000
recorder_ms = 3000
[hosts]
fe1 = "${agents.fe1.addr}"
fe2 = "${agents.fe2.addr}"
be = "${agents.be.addr}"
`);
  const ctl = start(["run", join(dir, "t.toml"), "--control", "--quiet", "--http", "127.0.0.1:0"], "run control");
  const addrFile = join(out, "control.addr");
  const addr = await until("control.addr", () => {
    if (ctl.exited !== null) throw new Error("tessera run exited with " + ctl.exited);
    return existsSync(addrFile) && readFileSync(addrFile, "utf8").trim();
  });
  browser = await launch();
  const page = await browser.newPage({ viewport: { width: 1400, height: 1300 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  // A run over hosts has a token: the page asks for it once, and makes no call it knows would
  // be refused before it has it (issue 51: each load wrote two refusals into the crew's log).
  let asked = 0;
  page.on("dialog", async (d) => { asked++; await d.accept(TOKEN); });
  await page.goto(`http://${addr}/`);
  await until("the token asked for", () => asked === 1);
  await until("the configured state", async () => (await page.textContent("#state")) === "configured");
  await page.fill("#operator", "playwright");
  await page.click("#btn-start");
  await until("the running state", async () => (await page.textContent("#state")) === "running");
  await until("events", async () => Number(await page.textContent("#events-total")) > 500);

  // Components of every host, named with their host.
  const hostsOf = async (table, col) => new Set((await page.locator(`#${table} tbody tr`).evaluateAll(
    (rows, c) => rows.map((r) => r.cells[c] && r.cells[c].textContent), col)));
  await until("components of every host", async () => {
    const h = await hostsOf("components", 1);
    return ["fe1", "fe2", "be"].every((x) => h.has(x));
  });
  // The programs view: every host's process, with its CPU, memory and uptime.
  await until("every host's process", async () => {
    const h = await hostsOf("processes", 0);
    return ["fe1", "fe2", "be"].every((x) => h.has(x));
  });
  // Each stage's condition per host; the bottleneck line names one or says none.
  await until("stages per host", async () => {
    const h = await hostsOf("stages", 1);
    return ["fe1", "fe2", "be"].every((x) => h.has(x));
  });
  assert.match(await page.textContent("#bottleneck"), /^bottleneck: /);
  await until("readout buffers with their hosts", async () =>
    (await page.textContent("#ru-buffers")).includes("RU 0 on fe1") && (await page.textContent("#ru-buffers")).includes("RU 1 on fe2"));
  // The monitor runs on be; the page samples it there.
  await until("a sampled event", async () => (await page.textContent("#sample")).startsWith("run 1 event"), 60000);
  // Every host's agent in the message log.
  await until("every host in the message log", async () => {
    const h = await hostsOf("log", 1);
    return ["fe1", "fe2", "be"].every((x) => h.has(x));
  });
  // No host lost and nothing failed yet (a warning, such as a buffer filling on a loaded
  // machine, may come and go).
  assert.equal(await page.locator("#alarms div.alarm-error").count(), 0, "alarms while all is well: " + await page.textContent("#alarms"));

  // fe2's agent dies: the run goes to error naming it, and an alarm says so on the page.
  agents.fe2.proc.p.kill("SIGKILL");
  await until("an alarm naming fe2", async () =>
    (await page.locator('#alarms div[data-alarm="agent_lost"]').count()) === 1 &&
    (await page.textContent("#alarms")).includes("host fe2"), 60000);
  await until("the error state", async () => (await page.textContent("#state")) === "error", 60000);
  assert.ok((await page.textContent("#message")).includes("fe2") || (await page.textContent("body")).includes("host fe2"));
  await until("the alarm in the message log", async () => (await page.textContent("#log")).includes("alarm: the node agent of host fe2 is lost"));
  // The alarm acknowledged from the page, with the operator's name, kept in the run database.
  await page.click('#alarms div[data-alarm="agent_lost"] button.ack');
  await until("the alarm acknowledged", async () => (await page.textContent("#alarms")).includes("acknowledged by playwright"));
  const rec = await (await fetch(`http://${addr}/api/runs/1`)).json();
  assert.ok(rec.alarm_actions.some((a) => a.action === "acknowledge" && a.alarm === "agent_lost" && a.who.startsWith("playwright")), JSON.stringify(rec.alarm_actions));
  assert.equal(asked, 1, "the token asked for once");
  assert.ok(!(await page.textContent("#log")).includes("refused a state-changing call"), "the page made calls it knew would be refused");
  assert.deepEqual(errors, [], "errors in the page");
  console.log("dashboard test over hosts: ok");
} finally {
  if (browser) await browser.close();
  for (const x of procs) if (x.exited === null) x.p.kill("SIGINT");
  for (const x of procs) await until(`${x.name} to exit`, () => x.exited !== null, 60000).catch(() => x.p.kill("SIGKILL"));
  rmSync(dir, { recursive: true, force: true });
}
