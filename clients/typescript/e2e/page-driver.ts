// Drives the page of a real `greendot serve` in headless Chromium for
// transport/tests/browser.rs, one JSON line at a time:
//   env GREENDOT_PAGE_URL (the page's address as `serve` printed it, http://127.0.0.1:PORT/#dev=CODE), GREENDOT_SCREENSHOTS (a folder),
//       GREENDOT_PAGE_USER (who the page connects as, by /dev/token), GREENDOT_WATCH;
//   stdout {"ready":…} once the page is connected and watching;
//   stdin  {"name":N,"expect":{data-* of the watched user's row}} → stdout {"ok":N,…}
//          once the row shows it (a screenshot N.png is saved), or {"fail":N,…};
//          with "group":G the page first subscribes to group G (again: a fresh count and first page);
//          with "groupState":{data-* of #group-state} it waits until the group panel shows it;
//          with "groupChange":{"member":U,"online":"true"} until the newest change line says so;
//          with "allMembers":true it reads every page ("next page" until the last) and answers "members":[[user, online]…];
//          with "firstPage":true it then shows the first page again;
//          with "groupMember":{"user":U,data-*} until U's entry in the page shown has them (the page is watched);
//   stdin  {"quit":true} → the browser is closed and the driver exits.

import { createInterface } from "node:readline";
import { join } from "node:path";
import { launch, open } from "./browser.js";

const url = process.env.GREENDOT_PAGE_URL!;
const shots = process.env.GREENDOT_SCREENSHOTS!;
const user = process.env.GREENDOT_PAGE_USER ?? "page";
const target = process.env.GREENDOT_WATCH ?? "alice";
const timeoutMs = Number(process.env.GREENDOT_STEP_TIMEOUT_MS ?? 15000);

const say = (v: unknown) => process.stdout.write(JSON.stringify(v) + "\n");

const browser = await launch();
try {
  const page = await open(browser, url);
  await page.waitForSelector("body[data-ready=true]", { timeout: timeoutMs });
  await page.waitForSelector("#dev-form:not([hidden])", { timeout: timeoutMs });
  await page.$eval("#watch", (el, t) => ((el as HTMLInputElement).value = t), target);
  await page.$eval("#dev-user", (el, u) => ((el as HTMLInputElement).value = u), user);
  await page.click("#dev-connect");
  await page.waitForSelector('#state[data-connected="true"]', { timeout: timeoutMs });
  await page.waitForSelector(`li.user[data-user="${target}"][data-version]`, { timeout: timeoutMs });
  const state = await page.$eval("#state", (el) => ({ text: el.textContent, binding: (el as HTMLElement).dataset.binding }));
  say({ ready: true, state });

  const row = () =>
    page.$eval(`li.user[data-user="${target}"]`, (el) => ({
      data: { ...(el as HTMLElement).dataset },
      text: (el as HTMLElement).innerText.replace(/\s+/g, " ").trim(),
    }));
  const operator = () =>
    page.evaluate(() =>
      Object.fromEntries(
        ["op-users", "op-devices", "op-quic", "op-websocket", "op-migrations", "op-pushes", "op-latency"].map((id) => [
          id,
          document.getElementById(id)!.textContent,
        ]),
      ),
    );

  const group = () =>
    page.$eval("#group-panel", (el) => ({
      state: { ...(document.getElementById("group-state") as HTMLElement).dataset },
      text: (el as HTMLElement).innerText.replace(/\s+/g, " ").trim(),
      error: document.getElementById("group-error")!.textContent,
    }));

  for await (const line of createInterface({ input: process.stdin })) {
    if (!line.trim()) continue;
    const cmd = JSON.parse(line) as {
      name?: string;
      expect?: Record<string, string>;
      quit?: boolean;
      operator?: Record<string, string>;
      group?: string;
      groupState?: Record<string, string>;
      groupChange?: Record<string, string>;
      allMembers?: boolean;
      firstPage?: boolean;
      groupMember?: Record<string, string>;
    };
    if (cmd.quit) break;
    const name = cmd.name ?? "step";
    try {
      if (cmd.expect) {
        await page.waitForFunction(
          (t: string, want: Record<string, string>) => {
            const el = document.querySelector(`li.user[data-user="${t}"]`) as HTMLElement | null;
            return el !== null && Object.entries(want).every(([k, v]) => el.dataset[k] === v);
          },
          { timeout: timeoutMs },
          target,
          cmd.expect,
        );
      }
      if (cmd.operator) {
        // The operator view refreshes every second.
        await page.waitForFunction(
          (want: Record<string, string>) =>
            Object.entries(want).every(([id, v]) => document.getElementById(id)?.dataset.value === v),
          { timeout: timeoutMs },
          cmd.operator,
        );
      }
      if (cmd.group !== undefined) {
        await page.$eval("#group", (el, g) => ((el as HTMLInputElement).value = g), cmd.group);
        await page.evaluate(() => delete document.getElementById("group-members")!.dataset.pages);
        await page.click("#group-subscribe");
        await page.waitForSelector('#group-members[data-pages="1"], #group-error:not(:empty)', { timeout: timeoutMs });
      }
      const has = (selector: string, want: Record<string, string>) =>
        page.waitForFunction(
          (sel: string, w: Record<string, string>) => {
            const el = document.querySelector(sel) as HTMLElement | null;
            return el !== null && Object.entries(w).every(([k, v]) => el.dataset[k] === v);
          },
          { timeout: timeoutMs },
          selector,
          want,
        );
      if (cmd.groupState) await has("#group-state", cmd.groupState);
      if (cmd.groupChange) await has("#group-changes > li:first-child", cmd.groupChange);
      // Clicks `button` and waits for the page it shows to be read.
      const turn = async (button: string) => {
        const pages = await page.$eval("#group-members", (el) => (el as HTMLElement).dataset.pages ?? "0");
        await page.click(button);
        await page.waitForFunction(
          (n: string) => document.getElementById("group-members")!.dataset.pages !== n,
          { timeout: timeoutMs },
          pages,
        );
      };
      let members: [string, string][] | undefined;
      if (cmd.allMembers) {
        members = [];
        for (let clicks = 0; ; clicks++) {
          // A cursor that does not move the list on would click forever.
          if (clicks > 50) throw new Error("the member list did not end after 50 pages");
          members.push(
            ...(await page.$$eval("#group-members > li", (lis) =>
              lis.map((li) => [(li as HTMLElement).dataset.user!, (li as HTMLElement).dataset.online!] as [string, string]),
            )),
          );
          if (await page.$eval("#group-more", (el) => (el as HTMLElement).hidden)) break;
          await turn("#group-more");
        }
      }
      if (cmd.firstPage) await turn("#group-first");
      if (cmd.groupMember) {
        const { user: member, ...want } = cmd.groupMember;
        await has(`#group-members > li[data-user="${member}"]`, want);
      }
      const path = join(shots, `${name}.png`);
      await page.screenshot({ path, fullPage: true });
      say({ ok: name, row: await row(), operator: await operator(), group: await group(), members, screenshot: path });
    } catch (e) {
      say({
        fail: name,
        error: String(e),
        row: await row().catch(() => null),
        operator: await operator().catch(() => null),
        group: await group().catch(() => null),
      });
    }
  }
} finally {
  await browser.close();
}
// stdin would keep the process alive.
process.exit(0);
