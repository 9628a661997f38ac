// The client's session logic against the in-test fake server (WebSocket
// binding over a real `ws` server): hello/welcome, subscriptions, pushes on
// both push streams, reconnect with resume, retry_ms, close codes, logout,
// the WebTransport → WebSocket fallback, the keep-alive and groups.

import assert from "node:assert/strict";
import { afterEach, beforeEach, test } from "node:test";
import {
  Client,
  CloseCode,
  type ClientEvent,
  type ClientOptions,
  ClosedError,
  ConfigError,
  ConnectError,
  ProtocolError,
  RejectedError,
  ServerError,
  TimeoutError,
  type WebTransportConstructor,
} from "../src/index.js";
import { ClientWebSocket, FakeServer, presence, until } from "./fake-server.js";

let server: FakeServer;
const clients: Client[] = [];

beforeEach(async () => {
  server = await FakeServer.start();
});

afterEach(async () => {
  for (const c of clients.splice(0)) c.close();
  await server.stop();
});

async function connect(options: Partial<ClientOptions> = {}): Promise<{ client: Client; events: ClientEvent[] }> {
  const client = await Client.connect({
    token: "token-al",
    webSocketUrl: server.url,
    WebSocket: ClientWebSocket,
    webTransport: false,
    requestTimeoutMs: 2000,
    ...options,
  });
  clients.push(client);
  const events: ClientEvent[] = [];
  client.on((e) => events.push(e));
  return { client, events };
}

const presenceEvents = (events: ClientEvent[]) =>
  events.filter((e) => e.type === "presence").map((e) => e.type === "presence" && [e.target, e.presence.version, e.source]);

test("hello, welcome, subscribe, pushes on both push streams through the View", async () => {
  server.presences.set("bob", presence(5n, true, { status: "away", message: "lunch" }));
  const { client, events } = await connect();
  const conn = await server.connection(1);
  assert.deepEqual(conn.hello, { version: 1, token: "token-al", resume: null, foreground: true });
  assert.equal(client.session, conn.session!.id);
  assert.equal(client.user, "al");
  assert.equal(client.device, "phone");
  assert.equal(client.binding, "websocket");

  const subscribed = await client.subscribe(["bob", "carol"], "realtime");
  assert.deepEqual(
    subscribed.snapshots.map((s) => [s.target, s.tier, s.presence.version]),
    [
      ["bob", "realtime", 5n],
      ["carol", "realtime", 1n],
    ],
  );
  assert.deepEqual((await conn.waitRequest("subscribe")).request, { type: "subscribe", targets: ["bob", "carol"], tier: "realtime" });
  assert.equal(client.presence("bob")?.message, "lunch");

  // Realtime travels on stream byte 2 and batched on 1 here: the client goes by each stream's first frame.
  conn.push("realtime", "bob", presence(6n, false));
  conn.push("batched", "carol", presence(3n));
  // Older or equal versions are dropped by the View: no event, no change.
  conn.push("batched", "bob", presence(5n, true));
  conn.push("realtime", "bob", presence(6n, true));
  conn.push("realtime", "carol", presence(4n, false));
  await until(() => client.presence("carol")?.version === 4n, 2000, "carol v4");
  assert.deepEqual(presenceEvents(events), [
    ["bob", 5n, "snapshot"],
    ["carol", 1n, "snapshot"],
    ["bob", 6n, "realtime"],
    ["carol", 3n, "batched"],
    ["carol", 4n, "realtime"],
  ]);
  assert.equal(client.presence("bob")?.online, false);

  // The other requests, as the server decodes them, and their answers.
  assert.equal((await client.query("bob")).version, 5n);
  await client.setStatus("doNotDisturb", "in a meeting");
  await client.setInvisible(true);
  assert.deepEqual(await client.route("al"), [{ device: "phone", kind: "web", session: client.session }]);
  await client.ping();
  await client.unsubscribe("carol");
  assert.equal(client.presence("carol"), undefined);
  await assert.rejects(client.unsubscribe("nobody"), (e) => e instanceof ServerError && e.error.code === 9);
  assert.deepEqual(
    conn.requests.map((r) => r.request),
    [
      { type: "subscribe", targets: ["bob", "carol"], tier: "realtime" },
      { type: "query", targets: ["bob"] },
      { type: "setStatus", status: "doNotDisturb", message: "in a meeting" },
      { type: "setInvisible", invisible: true },
      { type: "route", user: "al" },
      { type: "ping" },
      { type: "unsubscribe", target: "carol" },
      { type: "unsubscribe", target: "nobody" },
    ],
  );
  // Request ids are distinct (the reply echoes them).
  assert.equal(new Set(conn.requests.map((r) => r.id)).size, conn.requests.length);
  // A request over the welcome's max_frame is refused by the client, never sent.
  await assert.rejects(client.subscribe(["x".repeat(70_000)], "batched"), ConfigError);
  await client.ping();
  assert.deepEqual(conn.requests.slice(-1).map((r) => r.request.type), ["ping"]);
});

test("4014 Draining with retry_ms: reconnect with resume after a wait in [0, retry_ms]", async () => {
  const retryMs = 1000;
  // The top of the random range: the wait is ~retry_ms, far above the 100 ms backoff ceiling.
  const { client, events } = await connect({ random: () => 0.999 });
  const first = await server.connection(1);
  await client.subscribe(["bob"], "batched");
  const firstSession = client.session;

  server.presences.set("bob", presence(9n, false));
  const closedAt = Date.now();
  first.close(14, `server draining: reconnect and resume retry_ms=${retryMs}`);
  // A request made while reconnecting waits for the new connection.
  await until(() => events.some((e) => e.type === "disconnected"), 2000, "disconnected");
  const during = client.ping();

  const second = await server.connection(2);
  const waited = second.helloAt - closedAt;
  assert.ok(waited >= retryMs * 0.9, `waited ${waited} ms: the retry_ms draw, not the backoff's`);
  assert.ok(waited <= retryMs + 500, `waited ${waited} ms: within [0, retry_ms] plus slack`);
  assert.equal(second.hello!.resume, firstSession, "the hello resumes the previous session");
  await during;
  assert.equal((await second.waitRequest("ping")).request.type, "ping");

  await until(() => client.presence("bob")?.version === 9n, 2000, "the resumed welcome's snapshot");
  assert.equal(client.session, second.session!.id, "the new welcome's session is kept");
  assert.notEqual(client.session, firstSession);
  const reconnected = events.find((e) => e.type === "reconnected");
  assert.deepEqual(reconnected, { type: "reconnected", session: client.session, resumed: true, binding: "websocket" });
  assert.deepEqual(presenceEvents(events).at(-1), ["bob", 9n, "snapshot"]);
  // Resumed: no subscribe sent again (the server carried the subscriptions over).
  assert.equal(second.requests.filter((r) => r.request.type === "subscribe").length, 0);

  // The same client draws from the backoff when no retry_ms is given: ~100 ms, not the old retry_ms.
  const again = Date.now();
  second.close(10, "server stopping");
  const third = await server.connection(3);
  assert.ok(third.helloAt - again <= 100 + 600, `waited ${third.helloAt - again} ms`);
  assert.equal(third.hello!.resume, second.session!.id);
});

test("a server's 4001 Logout ends the client: no reconnect", async () => {
  const { client, events } = await connect({ random: () => 0 });
  const conn = await server.connection(1);
  conn.close(1, "logout");
  await until(() => client.isClosed, 2000, "closed");
  assert.deepEqual(events.at(-1), { type: "closed", code: 1, reason: "logout" });
  assert.ok(!events.some((e) => e.type === "disconnected"));
  // With random 0 a reconnect would come at once: none does.
  await new Promise((r) => setTimeout(r, 300));
  assert.equal(server.connections.length, 1);
  await assert.rejects(client.ping(), ClosedError);
});

test("every close code: 1, 2, 6, 7, 8, 13 and unknown ones end the client; the others reconnect and resume", async () => {
  const final = new Set([1, 2, 6, 7, 8, 13, 17, 999]);
  for (let code = 0; code <= 17; code++) {
    const codeUnderTest = code === 17 ? 999 : code;
    const { client } = await connect({ random: () => 0 });
    const before = server.connections.length;
    const conn = await server.connection(before);
    conn.close(codeUnderTest, "bye retry_ms=0");
    if (!final.has(codeUnderTest)) {
      const next = await server.connection(before + 1);
      assert.equal(next.hello!.resume, conn.session!.id, `close ${codeUnderTest}: resumes`);
      assert.ok(!client.isClosed);
    } else {
      await until(() => client.isClosed, 2000, `closed after ${codeUnderTest}`);
      await new Promise((r) => setTimeout(r, 50));
      assert.equal(server.connections.length, before, `close ${codeUnderTest}: no reconnect`);
    }
    client.close();
  }
});

test("a session that was not resumed: versions forgotten, subscriptions made again per tier", async () => {
  server.presences.set("bob", presence(50n));
  server.presences.set("carol", presence(60n));
  const { client, events } = await connect({ random: () => 0 });
  await client.subscribe(["bob"], "realtime");
  await client.subscribe(["carol"], "batched");
  const first = await server.connection(1);
  // A restarted server: no sessions, versions begin again.
  server.sessions.clear();
  server.presences.set("bob", presence(2n, false));
  server.presences.set("carol", presence(3n, false));
  first.drop();
  const second = await server.connection(2);
  assert.equal(second.hello!.resume, first.session!.id);
  await until(() => second.requests.length === 2, 2000, "two subscribes");
  assert.deepEqual(
    second.requests.map((r) => r.request),
    [
      { type: "subscribe", targets: ["bob"], tier: "realtime" },
      { type: "subscribe", targets: ["carol"], tier: "batched" },
    ],
  );
  // The lower versions of the new server are taken, not dropped as stale.
  await until(() => client.presence("carol")?.version === 3n, 2000, "carol v3");
  assert.equal(client.presence("bob")?.version, 2n);
  assert.deepEqual(events.find((e) => e.type === "reconnected"), { type: "reconnected", session: client.session, resumed: false, binding: "websocket" });
  assert.ok(events.some((e) => e.type === "disconnected" && /lost|1006|dropped/i.test(e.reason)), "a lost TCP connection is a disconnect");
});

test("a refused hello: the error frame and the close code reach the caller", async () => {
  // The error frame is what the caller gets; the close reason's retry_ms is kept with it.
  server.refuse = { error: { code: 24, message: "the server's session cap" }, code: 13, reason: "TooManySessions: cap retry_ms=250" };
  await assert.rejects(
    connect(),
    (e) =>
      e instanceof RejectedError &&
      e.closeCode === 13 &&
      e.error.code === 24 &&
      e.error.message === "the server's session cap retry_ms=250" &&
      e.retryAfterMs === 250,
  );
  assert.equal(server.connections.length, 1, "13 Refused: Client.connect does not retry");
  // A refusal during a reconnect that allows none ends the client.
  server.refuse = null;
  const { client, events } = await connect({ random: () => 0 });
  server.refuse = { error: { code: 5, message: "expired" }, code: 8, reason: "TokenExpired: expired" };
  (await server.connection(2)).close(14, "draining retry_ms=0");
  await until(() => client.isClosed, 2000, "closed");
  const last = events.at(-1);
  assert.equal(last?.type === "closed" && last.code, 8);
  assert.equal(server.connections.length, 3);
});

test("logout: the request, the server's 4001, the client finished; close(): a plain 1000", async () => {
  const { client, events } = await connect();
  const conn = await server.connection(1);
  await client.logout();
  assert.equal((await conn.waitRequest("logout")).request.type, "logout");
  await until(() => conn.closeInfo, 2000, "close");
  assert.equal(conn.closeInfo!.code, 4001);
  assert.ok(client.isClosed);
  assert.deepEqual(events.at(-1)?.type, "closed");

  // A server that never answers the logout: the client closes with 4001 itself.
  server.hold.add("logout");
  const { client: other } = await connect({ requestTimeoutMs: 200 });
  const conn2 = await server.connection(2);
  await assert.rejects(other.logout(), TimeoutError);
  await until(() => conn2.closeInfo, 2000, "close");
  assert.deepEqual([conn2.closeInfo!.code, conn2.closeInfo!.byServer], [4001, false]);
  assert.equal(conn2.session!.live, false, "the device is logged out");

  const { client: third } = await connect();
  const conn3 = await server.connection(3);
  third.close();
  await until(() => conn3.closeInfo, 2000, "close");
  assert.deepEqual([conn3.closeInfo!.code, conn3.closeInfo!.byServer], [1000, false]);
  assert.equal(conn3.session!.live, true, "a plain close leaves the session to linger");
});

test("a request not answered in time: TimeoutError; one never sent is dropped, never sent later", async () => {
  server.hold.add("setStatus");
  const { client, events } = await connect({ requestTimeoutMs: 150, random: () => 0.999, reconnect: { initialBackoffMs: 600 } });
  await assert.rejects(client.setStatus("busy"), TimeoutError);
  const first = await server.connection(1);
  first.drop();
  await until(() => events.some((e) => e.type === "disconnected"), 2000, "disconnected");
  // Made while the client waits ~600 ms to reconnect: times out unsent.
  await assert.rejects(client.setInvisible(true), TimeoutError);
  const second = await server.connection(2);
  await client.ping();
  assert.deepEqual(
    second.requests.map((r) => r.request.type),
    ["ping"],
    "the timed-out request was never sent",
  );
});

test("WebTransport first; WebSocket when its handshake fails", async () => {
  const made: { url: string; options: unknown }[] = [];
  class FailingWebTransport {
    readonly ready: Promise<unknown>;
    readonly closed: Promise<{ closeCode?: number; reason?: string }>;
    readonly incomingUnidirectionalStreams = new ReadableStream();
    constructor(url: string, options: unknown) {
      made.push({ url, options });
      this.ready = Promise.reject(new Error("QUIC handshake failed: UDP blocked"));
      this.closed = Promise.reject(new Error("never opened"));
      this.ready.catch(() => {});
    }
    createBidirectionalStream(): Promise<never> {
      return Promise.reject(new Error("not open"));
    }
    close(): void {}
  }
  const hash = { algorithm: "sha-256" as const, value: new Uint8Array(32).fill(1) };
  const { client } = await connect({
    webTransport: true,
    WebTransport: FailingWebTransport as unknown as WebTransportConstructor,
    webTransportUrl: "https://127.0.0.1:1/greendot",
    serverCertificateHashes: [hash],
    random: () => 0,
  });
  assert.equal(client.binding, "websocket");
  assert.deepEqual(made, [{ url: "https://127.0.0.1:1/greendot", options: { serverCertificateHashes: [hash] } }]);
  // Every reconnect tries WebTransport first again.
  (await server.connection(1)).close(14, "retry_ms=0");
  await server.connection(2);
  assert.equal(made.length, 2);

  // A WebTransport that never opens: WebSocket after webTransportTimeoutMs.
  class HangingWebTransport extends FailingWebTransport {
    override readonly ready = new Promise<unknown>(() => {});
  }
  const started = Date.now();
  const { client: slow } = await connect({
    webTransport: true,
    WebTransport: HangingWebTransport as unknown as WebTransportConstructor,
    webTransportUrl: "https://127.0.0.1:1/greendot",
    webTransportTimeoutMs: 200,
  });
  assert.equal(slow.binding, "websocket");
  assert.ok(Date.now() - started >= 190);

  // No server at all: a ConnectError naming both attempts.
  await assert.rejects(
    connect({ webSocketUrl: "ws://127.0.0.1:1/greendot", webTransport: true, WebTransport: FailingWebTransport as unknown as WebTransportConstructor, webTransportUrl: "https://127.0.0.1:1/greendot" }),
    (e) => e instanceof ConnectError && /webtransport/.test(e.message) && /websocket/.test(e.message),
  );
});

test("keep-alive: a Ping after a quiet spell; a silent server is lost after the idle timeout", async () => {
  const { client, events } = await connect({ keepAliveMs: 100, idleTimeoutMs: 600, random: () => 0 });
  const first = await server.connection(1);
  // Answered pings keep a quiet connection up.
  await until(() => first.requests.filter((r) => r.request.type === "ping").length >= 3, 2000, "three pings");
  assert.equal(server.connections.length, 1);
  assert.ok(!events.some((e) => e.type === "disconnected"));
  // A server that stops answering (a dead peer TCP has not noticed yet).
  server.hold.add("ping");
  const second = await server.connection(2, 3000);
  assert.ok(events.some((e) => e.type === "disconnected" && /no message from the server/.test(e.reason)));
  assert.equal(second.hello!.resume, first.session!.id);
  server.hold.delete("ping");
  client.close();
});

test("pushes flooding in before the welcome are refused, not stored", async () => {
  server.pushesBeforeWelcome = 65;
  await assert.rejects(connect(), (e) => e instanceof ProtocolError && /before the welcome/.test(e.message));
  const conn = await server.connection(1);
  await until(() => conn.closeInfo, 2000, "close");
  assert.equal(conn.closeInfo!.code, 4004);
  // A few (a WebTransport push stream's first frame may overtake the welcome) are fine.
  server.pushesBeforeWelcome = 2;
  const { client } = await connect();
  assert.ok(client.isConnected);
});

test("a text message from the server is a protocol error: the client closes with 4004 and reconnects", async () => {
  const { events } = await connect({ random: () => 0 });
  const first = await server.connection(1);
  first.ws.send("hello?");
  const second = await server.connection(2);
  assert.equal(first.closeInfo?.code, 4004);
  assert.equal(second.hello!.resume, first.session!.id);
  assert.ok(events.some((e) => e.type === "disconnected" && /text message/.test(e.reason)));
});

/** A JWT-shaped token (unsigned: the fake server does not check) expiring `inMs` from now. */
function tokenExpiringIn(inMs: number, n: number): string {
  const b64 = (o: object) => btoa(JSON.stringify(o)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  return `${b64({ alg: "HS256" })}.${b64({ sub: "al", dev: "phone", n, exp: Math.floor((Date.now() + inMs) / 1000) })}.sig`;
}

test("refreshToken: called ahead of exp, the new token sent on the live connection; ended subscriptions are not resubscribed", async () => {
  const fresh: string[] = [];
  const { client, events } = await connect({
    token: tokenExpiringIn(2_000, 0),
    refreshAheadMs: 60_000,
    refreshToken: async () => {
      fresh.push(tokenExpiringIn(600_000, fresh.length + 1));
      return fresh[fresh.length - 1]!;
    },
  });
  const conn = await server.connection(1);
  await client.subscribe(["bob", "carol"], "realtime");
  server.refreshEnds = ["carol"];
  // exp - min(60 s, 1/5 of ~2 s): within about 1.6 s.
  const refresh = await conn.waitRequest("refresh", 3_000);
  assert.deepEqual(refresh.request, { type: "refresh", token: fresh[0] });
  const refreshed = await until(() => events.find((e) => e.type === "tokenRefreshed"), 2_000, "tokenRefreshed");
  assert.deepEqual(refreshed, { type: "tokenRefreshed", ended: ["carol"] });
  assert.equal(fresh.length, 1, "the new token is good for 10 minutes: no second fetch");
  // A reconnect that does not resume: the new token, and bob only subscribed again.
  server.sessions.clear();
  conn.drop();
  const next = await server.connection(2);
  assert.equal(next.hello?.token, fresh[0]);
  assert.deepEqual((await next.waitRequest("subscribe")).request, { type: "subscribe", targets: ["bob"], tier: "realtime" });
});

test("without refreshToken a server's TokenExpired ends the client; with it the client reconnects with a new token", async () => {
  const plain = await connect();
  (await server.connection(1)).close(CloseCode.TokenExpired, "TokenExpired: the session's token expired");
  await until(() => plain.events.find((e) => e.type === "closed"), 2_000, "closed");
  const { events } = await connect({ token: tokenExpiringIn(0, 0), refreshToken: async () => "fresh" });
  (await server.connection(2)).close(CloseCode.TokenExpired, "TokenExpired");
  const again = await server.connection(3);
  assert.equal(again.hello?.token, "fresh");
  assert.ok(!events.some((e) => e.type === "closed"));
});

test("foreground and background: in every hello, told on the live connection, and the foreground reconnects at once", async () => {
  // A backoff ceiling far above the test's bounds: only appForegrounded can make the reconnect prompt.
  const { client } = await connect({ foreground: false, reconnect: { initialBackoffMs: 20_000, maxBackoffMs: 20_000 } });
  const first = await server.connection(1);
  assert.equal(first.hello!.foreground, false, "the hello carries the state at connect");
  assert.equal(client.isForeground, false);

  await client.appForegrounded();
  assert.deepEqual((await first.waitRequest("setForeground")).request, { type: "setForeground", foreground: true });
  await client.appBackgrounded();
  assert.deepEqual(first.requests.at(-1)!.request, { type: "setForeground", foreground: false });
  assert.equal(client.isForeground, false);

  // Lost while in the background: no request is made; the state waits for the next hello.
  first.drop();
  await until(() => !client.isConnected, 2000, "the loss noticed");
  await client.appBackgrounded();
  const before = Date.now();
  await client.appForegrounded();
  const second = await server.connection(2);
  assert.ok(second.helloAt - before < 5_000, `reconnected ${second.helloAt - before} ms after the foreground, not after the 20 s backoff`);
  assert.equal(second.hello!.foreground, true, "the reconnect's hello says foreground");
  assert.equal(second.hello!.resume, first.session!.id, "and resumes");
  assert.equal(second.requests.filter((r) => r.request.type === "setForeground").length, 0, "the hello said it all");
});

const groupEvents = (events: ClientEvent[]) =>
  events.flatMap((e) => {
    switch (e.type) {
      case "groupCount":
        return [["count", e.group, e.version, e.count, e.source]];
      case "groupMember":
        return [["member", e.group, e.version, e.member, e.online, e.count]];
      case "groupEnded":
        return [["ended", e.group]];
      default:
        return [];
    }
  });

test("groups: the requests as the server decodes them, the snapshot, pages, and only newer versions as events", async () => {
  const { client, events } = await connect();
  const conn = await server.connection(1);
  // A u64 past 2^53 stays exact: group ids are bigints.
  const big = (1n << 63n) + 5n;
  assert.equal(await client.setGroup(big, ["bob"], ["al"]), 1n);
  assert.equal(await client.setGroup(7, ["al", "bob", "carol"]), 1n);
  await assert.rejects(client.groupSubscribe(2 ** 60), ConfigError);
  const g = server.groups.get(7n)!;
  g.version = 5n;
  g.count = 2;
  g.entries = [
    { user: "bob", presence: presence(3n) },
    { user: "al", presence: presence(4n) },
    { user: "carol", presence: presence(1n, false) },
  ];
  assert.deepEqual(await client.groupSubscribe(7), { group: 7n, role: "member", version: 5n, count: 2, members: 3 });
  assert.deepEqual(await client.groupSubscribe(big), { group: big, role: "admin", version: 1n, count: 0, members: 2 });
  assert.deepEqual(client.groups().sort(), [7n, big]);

  // Not newer than the snapshot: dropped. Newer: an event with its stream's tier.
  conn.pushGroup("batched", { type: "groupCount", group: 7n, version: 5n, count: 9 });
  conn.pushGroup("batched", { type: "groupCount", group: 7n, version: 6n, count: 1 });
  conn.pushGroup("batched", { type: "groupCount", group: 7n, version: 6n, count: 8 });
  conn.pushGroup("realtime", { type: "groupMember", group: big, version: 2n, member: "bob", online: true, count: 1 });
  conn.pushGroup("realtime", { type: "groupMember", group: big, version: 2n, member: "bob", online: false, count: 0 });
  conn.pushGroup("realtime", { type: "groupCount", group: big, version: 1n, count: 7 });
  conn.pushGroup("realtime", { type: "groupMember", group: big, version: 3n, member: "bob", online: false, count: 0 });
  conn.pushGroup("batched", { type: "groupCount", group: 7n, version: 4n, count: 7 });
  conn.pushGroup("realtime", { type: "groupEnded", group: 7n });
  conn.pushGroup("realtime", { type: "groupEnded", group: 7n });
  await until(() => events.some((e) => e.type === "groupEnded"), 2000, "groupEnded");
  await client.ping();
  assert.deepEqual(groupEvents(events), [
    ["count", 7n, 6n, 1, "batched"],
    ["member", big, 2n, "bob", true, 1],
    ["member", big, 3n, "bob", false, 0],
    ["ended", 7n],
  ]);
  assert.deepEqual(client.groups(), [big]);

  // Pages: the cursor of one page starts the next.
  const first = await client.groupPage(7, null, 2);
  assert.deepEqual(first.entries.map((e) => e.user), ["bob", "al"]);
  assert.deepEqual(first.next, { online: true, after: 1n });
  const second = await client.groupPage(7n, first.next, 2);
  assert.deepEqual(second.entries.map((e) => [e.user, e.presence.online]), [["carol", false]]);
  assert.equal(second.next, null);
  assert.deepEqual([second.version, second.count], [5n, 2]);

  await client.groupUnsubscribe(big);
  assert.deepEqual(client.groups(), []);
  await assert.rejects(client.groupUnsubscribe(big), (e) => e instanceof ServerError && e.error.code === 9);
  await client.removeGroup(big);
  await assert.rejects(client.removeGroup(big), (e) => e instanceof ServerError && e.error.code === 30);
  await assert.rejects(client.groupSubscribe(big), (e) => e instanceof ServerError && e.error.code === 29);
  assert.deepEqual(
    conn.requests.map((r) => r.request).filter((r) => r.type !== "ping"),
    [
      { type: "setGroup", group: big, members: ["bob"], admins: ["al"] },
      { type: "setGroup", group: 7n, members: ["al", "bob", "carol"], admins: [] },
      { type: "groupSubscribe", group: 7n },
      { type: "groupSubscribe", group: big },
      { type: "groupPage", group: 7n, after: null, limit: 2 },
      { type: "groupPage", group: 7n, after: { online: true, after: 1n }, limit: 2 },
      { type: "groupUnsubscribe", group: big },
      { type: "groupUnsubscribe", group: big },
      { type: "removeGroup", group: big },
      { type: "removeGroup", group: big },
      { type: "groupSubscribe", group: big },
    ],
  );
});

test("watched pages: the watch requests as the server decodes them, and each delta as an event", async () => {
  const { client, events } = await connect();
  const conn = await server.connection(1);
  await client.setGroup(7, ["al", "bob"]);
  server.groups.get(7n)!.entries = [{ user: "bob", presence: presence(3n) }];
  const page = await client.groupWatchPage(7, null, 50);
  assert.deepEqual(page.entries.map((e) => e.user), ["bob"]);
  await client.groupRenewWatch(7n, null);
  const changed = [{ user: "bob", presence: presence(4n, false) }];
  conn.pushGroup("batched", { type: "groupPageDelta", group: 7n, entries: changed });
  await until(() => events.some((e) => e.type === "groupPageDelta"), 2000, "groupPageDelta");
  assert.deepEqual(
    events.filter((e) => e.type === "groupPageDelta"),
    [{ type: "groupPageDelta", group: 7n, entries: changed }],
  );
  await client.groupUnwatchPage(7, null);
  assert.deepEqual(
    conn.requests.map((r) => r.request).filter((r) => r.type !== "ping" && r.type !== "setGroup"),
    [
      { type: "groupWatchPage", group: 7n, after: null, limit: 50 },
      { type: "groupRenewWatch", group: 7n, after: null },
      { type: "groupUnwatchPage", group: 7n, after: null },
    ],
  );
  await client.close();
});

test("groups after a reconnect: a resumed session keeps them; a fresh one subscribes again, groupEnded if refused", async () => {
  const { client, events } = await connect({ random: () => 0 });
  server.groups.set(1n, { members: new Set(["al"]), admins: new Set(), version: 40n, count: 3, entries: [] });
  server.groups.set(2n, { members: new Set(["al"]), admins: new Set(["al"]), version: 50n, count: 4, entries: [] });
  await client.groupSubscribe(2n);
  await client.groupSubscribe(1n);
  const first = await server.connection(1);

  // Resumed: the server kept the subscriptions, the client asks nothing.
  first.drop();
  const second = await server.connection(2);
  await until(() => events.some((e) => e.type === "reconnected"), 2000, "reconnected");
  await client.ping();
  assert.deepEqual(second.requests.map((r) => r.request.type), ["ping"]);
  second.pushGroup("batched", { type: "groupCount", group: 1n, version: 41n, count: 2 });
  await until(() => groupEvents(events).length === 1, 2000, "count 41");

  // A restarted server: its versions begin again; al left group 2 meanwhile.
  server.sessions.clear();
  server.groups.set(1n, { members: new Set(["al"]), admins: new Set(), version: 3n, count: 1, entries: [] });
  server.groups.get(2n)!.members.delete("al");
  second.drop();
  const third = await server.connection(3);
  await until(() => events.filter((e) => e.type === "reconnected").length === 2, 2000, "second reconnect");
  await until(() => groupEvents(events).length === 3, 2000, "the resubscribe's count and the refusal");
  assert.deepEqual(
    third.requests.map((r) => r.request),
    [
      { type: "groupSubscribe", group: 1n },
      { type: "groupSubscribe", group: 2n },
    ],
  );
  // The new server's lower versions are taken, not dropped as stale; older than the snapshot still are.
  third.pushGroup("batched", { type: "groupCount", group: 1n, version: 2n, count: 9 });
  third.pushGroup("batched", { type: "groupCount", group: 1n, version: 4n, count: 0 });
  await until(() => groupEvents(events).length === 4, 2000, "count 4");
  assert.deepEqual(groupEvents(events), [
    ["count", 1n, 41n, 2, "batched"],
    ["count", 1n, 3n, 1, "snapshot"],
    ["ended", 2n],
    ["count", 1n, 4n, 0, "batched"],
  ]);
  assert.deepEqual(client.groups(), [1n]);
});
