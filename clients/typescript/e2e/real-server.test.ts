// The client against a real `greendot serve` (started by
// transport/tests/browser.rs, which passes its addresses and tokens in the
// environment): in Node over WebSocket (the `ws` package, trusting the
// server's dev certificate), and in headless Chromium over WebTransport
// (the page's copy of the client, `serverCertificateHashes` from the dev
// certificate's hash); groups in Node (the server's group interval is
// 200 ms and its member pages hold 2).

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, test } from "node:test";
import WebSocket from "ws";
import { Client, type ClientEvent, type ClientOptions, type WebSocketConstructor } from "../src/index.js";
import { launch, netLogSummary, open } from "./browser.js";

const env = (name: string): string => {
  const v = process.env[name];
  if (v === undefined) throw new Error(`${name} is not set: run this from transport/tests/browser.rs`);
  return v;
};
const wsUrl = `${env("GREENDOT_WS_URL")}`;
const ca = readFileSync(env("GREENDOT_CA"));

/** `ws` with the server's certificate as the only trusted root. */
class TrustingWebSocket extends WebSocket {
  constructor(url: string, protocols: string | string[]) {
    super(url, protocols, { ca });
  }
}

const clients: Client[] = [];
after(() => {
  for (const c of clients) c.close();
});

async function node(token: string, options: Partial<ClientOptions> = {}): Promise<Client> {
  const c = await Client.connect({
    token,
    webSocketUrl: wsUrl,
    WebSocket: TrustingWebSocket as unknown as WebSocketConstructor,
    requestTimeoutMs: 5000,
    ...options,
  });
  clients.push(c);
  return c;
}

/** Closes the browser and sums up its network log (complete only once the browser has closed). */
async function closeWithNetLog(browser: Awaited<ReturnType<typeof launch>>): Promise<string[]> {
  await browser.close();
  if (browser.netLogPath === undefined) return ["no network log (GREENDOT_NETLOG_DIR is not set)"];
  return netLogSummary(browser.netLogPath);
}

async function until(what: string, ok: () => boolean, ms = 10_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!ok()) {
    if (Date.now() > deadline) throw new Error(`not within ${ms} ms: ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

test("Node over WebSocket: snapshots, pushes, status, invisible, background, query and logout of a real server", async () => {
  const al = await node(env("GREENDOT_TOKEN_AL"));
  assert.equal(al.binding, "websocket");
  assert.equal(al.user, "al");
  const { snapshots, refused } = await al.subscribe(["bob"], "realtime");
  assert.deepEqual(refused, []);
  assert.equal(snapshots[0]?.target, "bob");
  assert.equal(snapshots[0]?.presence.online, false);
  await al.ping();

  const bob = await node(env("GREENDOT_TOKEN_BOB"));
  await until("al sees bob online", () => al.presence("bob")?.online === true);
  assert.equal(al.presence("bob")?.kinds, 1, "on mobile");
  const online = al.presence("bob")!.version;

  await bob.setStatus("away", "lunch");
  await until("al sees bob away", () => al.presence("bob")?.status === "away" && al.presence("bob")?.message === "lunch");
  assert.ok(al.presence("bob")!.version > online, "versions only grow");

  await bob.setInvisible(true);
  await until("al sees bob offline", () => al.presence("bob")?.online === false);
  const own = await bob.query("bob");
  assert.equal(own.invisible, true, "bob's own view says invisible");
  assert.equal(own.online, true);
  const shown = await al.query("bob");
  assert.equal(shown.online, false, "others are shown offline");
  assert.equal(shown.invisible, false);

  await bob.setInvisible(false);
  await until("al sees bob back", () => al.presence("bob")?.online === true);

  // In the background bob is not present: shown offline, last seen when he went.
  const wentAt = BigInt(Date.now());
  await bob.appBackgrounded();
  await until("al sees bob offline in the background", () => al.presence("bob")?.online === false);
  const away = al.presence("bob")!;
  assert.ok(away.lastSeen !== null && away.lastSeen >= wentAt - 1000n && away.lastSeen <= BigInt(Date.now()), "last seen when he went");
  assert.equal(bob.isConnected, true, "the session lives on");
  await bob.appForegrounded();
  await until("al sees bob in the foreground again", () => al.presence("bob")?.online === true);

  await bob.logout();
  assert.equal(bob.isClosed, true);
  await until("al sees bob logged out", () => al.presence("bob")?.online === false && al.presence("bob")?.lastSeen !== null);
  assert.ok(al.presence("bob")!.lastSeen! <= BigInt(Date.now()));
  al.close();
});

test("Chromium over WebTransport: the page's copy of the client connects with serverCertificateHashes", async () => {
  const browser = await launch([], "webtransport");
  let showNetLog = false;
  try {
    const page = await open(browser, env("GREENDOT_PAGE_URL"));
    const { binding, lost } = await page.evaluate(
      async (token: string, url: string, hash: string) => {
        const m = await import("/greendot-client.js" as string);
        const value = new Uint8Array(hash.match(/../g)!.map((h) => parseInt(h, 16)));
        // A connection lost under the request fails it with LostError; an
        // application retries (the client reconnects and resumes by
        // itself). Once here: a second loss fails the test.
        const lost: string[] = [];
        const once = async <T>(what: string, f: () => Promise<T>): Promise<T> => {
          try {
            return await f();
          } catch (e) {
            if ((e as Error).name !== "LostError") throw e;
            lost.push(`${what}: ${String(e)}`);
            return await f();
          }
        };
        const c: any = await once("connect", () =>
          m.Client.connect({
            token,
            webTransportUrl: url,
            serverCertificateHashes: [{ algorithm: "sha-256", value }],
            // No working fallback: this must be WebTransport.
            webSocketUrl: "wss://127.0.0.1:9/greendot",
          }),
        );
        await once("subscribe", () => c.subscribe(["bob"], "realtime"));
        (globalThis as any).al = c;
        return { binding: c.binding, lost };
      },
      env("GREENDOT_TOKEN_AL_BROWSER"),
      env("GREENDOT_WT_URL"),
      env("GREENDOT_CERT_HASH"),
    );
    if (lost.length > 0) {
      // The network log is complete only once the browser closes: at the end.
      console.error(`the WebTransport session was lost and the request retried: ${lost.join("; ")}`);
      showNetLog = true;
    }
    assert.equal(binding, "webtransport");

    const bob = await node(env("GREENDOT_TOKEN_BOB"));
    await bob.setStatus("busy", "on a call");
    await page.waitForFunction(
      () => {
        const p = (globalThis as any).al.presence("bob");
        return p?.online === true && p.status === "busy" && p.message === "on a call";
      },
      { timeout: 10_000 },
    );
    await bob.logout();
    await page.waitForFunction(() => (globalThis as any).al.presence("bob")?.online === false, { timeout: 10_000 });
    const closed = await page.evaluate(async () => {
      const c = (globalThis as any).al;
      await c.logout();
      return c.isClosed;
    });
    assert.equal(closed, true);
  } catch (e) {
    showNetLog = true;
    throw e;
  } finally {
    if (showNetLog) for (const line of await closeWithNetLog(browser)) console.error(`[netlog] ${line}`);
    else await browser.close();
  }
});

test("Chromium falls back to WebSocket when WebTransport fails (here: no certificate hash)", async () => {
  // wss to the self-signed dev certificate needs the flag; WebTransport
  // ignores it and, without serverCertificateHashes, refuses the certificate.
  const browser = await launch(["--ignore-certificate-errors"]);
  try {
    const page = await open(browser, env("GREENDOT_PAGE_URL"));
    const result = await page.evaluate(
      async (token: string, wtUrl: string, wsUrl: string) => {
        const m = await import("/greendot-client.js" as string);
        const c = await m.Client.connect({ token, webTransportUrl: wtUrl, webSocketUrl: wsUrl, webTransportTimeoutMs: 3000 });
        const { snapshots } = await c.subscribe(["bob"], "realtime");
        const binding = c.binding;
        await c.logout();
        return { binding, target: snapshots[0]?.target, closed: c.isClosed };
      },
      env("GREENDOT_TOKEN_AL_BROWSER"),
      env("GREENDOT_WT_URL"),
      wsUrl,
    );
    assert.deepEqual(result, { binding: "websocket", target: "bob", closed: true });
  } finally {
    await browser.close();
  }
});

test("Node over WebSocket: groups of a real server: a member sees the count change, an admin each member's change, pages", async () => {
  const service = await node(env("GREENDOT_TOKEN_SERVICE"));
  const group = (1n << 63n) + 42n;
  assert.equal(await service.setGroup(group, ["bob", "carol"], ["al"]), 1n);
  // A service token is not a member: it may write groups, not watch them.
  await assert.rejects(service.groupSubscribe(group), (e: Error & { error?: { code: number } }) => e.error?.code === 29);

  const al = await node(env("GREENDOT_TOKEN_AL"));
  const alEvents: ClientEvent[] = [];
  al.on((e) => alEvents.push(e));
  const carol = await node(env("GREENDOT_TOKEN_CAROL"));
  const carolEvents: ClientEvent[] = [];
  carol.on((e) => carolEvents.push(e));
  const asAdmin = await al.groupSubscribe(group);
  assert.deepEqual([asAdmin.group, asAdmin.role, asAdmin.members], [group, "admin", 3]);
  const asMember = await carol.groupSubscribe(group);
  assert.deepEqual([asMember.role, asMember.members], ["member", 3]);
  // al and carol are online (once the debounce passed); bob is not yet.
  assert.ok(asMember.count <= 2, `count ${asMember.count} before bob came`);

  const bob = await node(env("GREENDOT_TOKEN_BOB"));
  await until("al (admin) sees bob come online", () =>
    alEvents.some((e) => e.type === "groupMember" && e.group === group && e.member === "bob" && e.online),
  );
  await until("carol (member) sees the count reach 3", () =>
    carolEvents.some((e) => e.type === "groupCount" && e.group === group && e.count === 3 && e.source === "batched"),
  );
  // Versions only grow, per group, in what each of them was told.
  for (const events of [alEvents, carolEvents]) {
    const versions = events.flatMap((e) => (e.type === "groupCount" || e.type === "groupMember" ? [e.version] : []));
    assert.ok(versions.every((v, i) => i === 0 || v > versions[i - 1]!), `versions ${versions}`);
  }

  // Pages of 2 (the server's cap here, below the 50 asked): online first, all three once.
  const first = await carol.groupPage(group, null, 50);
  assert.equal(first.entries.length, 2);
  assert.notEqual(first.next, null);
  const second = await carol.groupPage(group, first.next, 50);
  assert.equal(second.next, null);
  const entries = [...first.entries, ...second.entries];
  assert.deepEqual(entries.map((e) => e.user).sort(), ["al", "bob", "carol"]);
  assert.ok(entries.every((e) => e.presence.online), "all three online");
  assert.equal(first.count, 3);

  await bob.logout();
  await until("al sees bob go offline", () =>
    alEvents.some((e) => e.type === "groupMember" && e.member === "bob" && !e.online && e.count === 2),
  );
  const offline = await carol.groupPage(group, null, 2);
  assert.deepEqual(offline.entries.map((e) => e.presence.online), [true, true], "online first");
  const last = await carol.groupPage(group, offline.next, 2);
  assert.deepEqual(last.entries.map((e) => [e.user, e.presence.online]), [["bob", false]]);

  // By difference: a change expecting another version is refused (38) and
  // changes nothing; one expecting the current version adds dee.
  await assert.rejects(
    service.changeGroup(group, { remove: ["carol"], expectVersion: 0 }),
    (e: Error & { error?: { code: number; message: string } }) => e.error?.code === 38 && e.error.message.endsWith("version=1"),
  );
  assert.equal(await service.changeGroup(group, { add: ["dee"], expectVersion: 1n }), 2n);
  const again = await carol.groupSubscribe(group);
  assert.deepEqual([again.role, again.members], ["member", 4], "carol stayed, dee joined");

  await service.removeGroup(group);
  await until("both subscriptions end", () =>
    [alEvents, carolEvents].every((events) => events.some((e) => e.type === "groupEnded" && e.group === group)),
  );
  assert.deepEqual([al.groups(), carol.groups()], [[], []]);
  for (const c of [al, carol, service]) c.close();
});
