// Headless Chromium for the end-to-end tests: Debian's /usr/bin/chromium
// (installed by the tests' own command), driven by puppeteer-core (which
// downloads no browser).

import { readFileSync } from "node:fs";
import { join } from "node:path";
import puppeteer, { type Browser, type Page } from "puppeteer-core";

export const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";

/**
 * Headless Chromium. With `netLog` and GREENDOT_NETLOG_DIR set, it writes
 * its network log to GREENDOT_NETLOG_DIR/`netLog`.netlog.json (see
 * {@link netLogSummary}); the path is returned with the browser.
 */
export async function launch(extraArgs: string[] = [], netLog?: string): Promise<Browser & { netLogPath?: string }> {
  const dir = process.env.GREENDOT_NETLOG_DIR;
  const netLogPath = netLog !== undefined && dir !== undefined ? join(dir, `${netLog}.netlog.json`) : undefined;
  const browser: Browser & { netLogPath?: string } = await puppeteer.launch({
    executablePath: CHROMIUM,
    headless: true,
    // --no-sandbox: the tests run as root. No certificate flag: WebTransport
    // must be let in by serverCertificateHashes alone.
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--window-size=1100,800",
      ...(netLogPath === undefined ? [] : [`--log-net-log=${netLogPath}`]),
      ...extraArgs,
    ],
    defaultViewport: { width: 1100, height: 800 },
  });
  browser.netLogPath = netLogPath;
  return browser;
}

/**
 * How Chromium's QUIC and WebTransport sessions changed state and ended,
 * and any network change it saw, one line per event, from a network log
 * (read line by line: a browser that did not exit cleanly leaves it
 * unterminated).
 */
export function netLogSummary(path: string): string[] {
  let text: string;
  try {
    text = readFileSync(path, "utf8");
  } catch (e) {
    return [`no network log at ${path}: ${String(e)}`];
  }
  const lines = text.split("\n");
  let names = new Map<number, string>();
  try {
    const constants = JSON.parse(lines[0]!.replace(/,\s*$/, "") + "}").constants as { logEventTypes: Record<string, number> };
    names = new Map(Object.entries(constants.logEventTypes).map(([name, id]) => [id, name]));
  } catch {
    return ["the network log has no constants line"];
  }
  // Of the QUIC, HTTP/3, WebTransport and network events, how things changed and ended.
  const wanted = /^(QUIC_|HTTP3_|WEB_TRANSPORT|NETWORK_|CERT_VERIFIER)/;
  const detail = /CLOSE|GOAWAY|RESET|STATE|ERROR|MIGRAT|CHANGED|CERT/;
  const out: string[] = [];
  for (const line of lines.slice(2)) {
    let event: { type: number; time: string; params?: unknown };
    try {
      event = JSON.parse(line.replace(/,\s*$/, ""));
    } catch {
      continue;
    }
    const name = names.get(event.type) ?? String(event.type);
    if (wanted.test(name) && detail.test(name)) out.push(`${event.time} ${name} ${JSON.stringify(event.params ?? {}).slice(0, 400)}`);
  }
  return out;
}

/** A page whose console errors and exceptions go to stderr. */
export async function open(browser: Browser, url: string): Promise<Page> {
  const page = await browser.newPage();
  page.on("console", (m) => {
    if (m.type() === "error" || m.type() === "warn") process.stderr.write(`[page ${m.type()}] ${m.text()}\n`);
  });
  page.on("pageerror", (e) => process.stderr.write(`[page exception] ${String(e)}\n`));
  await page.goto(url, { waitUntil: "load" });
  return page;
}
