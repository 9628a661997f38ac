// Headless Chromium for the end-to-end tests: Debian's /usr/bin/chromium
// (installed by the tests' own command), driven by puppeteer-core (which
// downloads no browser).

import puppeteer, { type Browser, type Page } from "puppeteer-core";

export const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";

export async function launch(extraArgs: string[] = []): Promise<Browser> {
  return puppeteer.launch({
    executablePath: CHROMIUM,
    headless: true,
    // --no-sandbox: the tests run as root. No certificate flag: WebTransport
    // must be let in by serverCertificateHashes alone.
    args: ["--no-sandbox", "--disable-gpu", "--window-size=1100,800", ...extraArgs],
    defaultViewport: { width: 1100, height: 800 },
  });
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
