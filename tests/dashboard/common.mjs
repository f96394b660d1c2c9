// What the dashboard tests share: waiting without asserting time, and the browser.
import { chromium } from "playwright-core";

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Polls `f` until it returns something truthy; throws naming `what` after `limit` ms.
export async function until(what, f, limit = 30000) {
  const t0 = Date.now();
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() - t0 > limit) throw new Error("timed out waiting for " + what);
    await sleep(100);
  }
}

// Debian's Chromium, headless; Playwright gives every launch a new, empty profile directory.
export function launch() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
}
