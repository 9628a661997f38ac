// The WebTransport carrier over an in-memory WebTransport (Node has no
// WebTransport; its web streams are the browser's API): length-prefixed
// control frames on one bidirectional stream, two server-opened push streams
// told apart by their first frame, the session close code as the greendot
// close code. A real browser against a real server is the Chromium test.

import assert from "node:assert/strict";
import { test } from "node:test";
import {
  Client,
  type ClientEvent,
  decodeHello,
  decodeRequestFrame,
  encodePush,
  encodeServerFrame,
  FrameReader,
  type Hello,
  prefixFrame,
  type Push,
  type RequestFrame,
  type ServerFrame,
  type WebTransportConstructor,
} from "../src/index.js";
import { presence, until } from "./fake-server.js";

type CloseInfo = { closeCode?: number; reason?: string };

/** One in-memory WebTransport session; the test plays the server through its methods. */
class MemoryWebTransport {
  static sessions: MemoryWebTransport[] = [];
  readonly ready = Promise.resolve();
  readonly closed: Promise<CloseInfo>;
  readonly incomingUnidirectionalStreams: ReadableStream<ReadableStream<Uint8Array>>;
  hello: Hello | null = null;
  readonly requests: RequestFrame[] = [];
  closedByClient: CloseInfo | null = null;
  private uni!: ReadableStreamDefaultController<ReadableStream<Uint8Array>>;
  private resolveClosed!: (info: CloseInfo) => void;
  private control: WritableStreamDefaultWriter<Uint8Array> | null = null;

  constructor(
    readonly url: string,
    readonly options: unknown,
  ) {
    MemoryWebTransport.sessions.push(this);
    this.closed = new Promise((r) => (this.resolveClosed = r));
    this.incomingUnidirectionalStreams = new ReadableStream({ start: (c) => void (this.uni = c) });
  }

  async createBidirectionalStream() {
    const up = new TransformStream<Uint8Array, Uint8Array>();
    const down = new TransformStream<Uint8Array, Uint8Array>();
    this.control = down.writable.getWriter();
    void this.serve(up.readable);
    return { readable: down.readable, writable: up.writable };
  }

  close(info: CloseInfo = {}): void {
    this.closedByClient ??= info;
    this.resolveClosed(info);
  }

  // ----- the server's side -----

  /** Writes bytes in chunks of 3, so frames arrive split. */
  private static async writeSplit(w: WritableStreamDefaultWriter<Uint8Array>, bytes: Uint8Array): Promise<void> {
    for (let i = 0; i < bytes.length; i += 3) await w.write(bytes.slice(i, i + 3));
  }

  sendControl(frame: ServerFrame): Promise<void> {
    return MemoryWebTransport.writeSplit(this.control!, prefixFrame(encodeServerFrame(frame)));
  }

  openPushStream(): (push: Push) => Promise<void> {
    const stream = new TransformStream<Uint8Array, Uint8Array>();
    this.uni.enqueue(stream.readable);
    const w = stream.writable.getWriter();
    return (push) => MemoryWebTransport.writeSplit(w, prefixFrame(encodePush(push)));
  }

  closeSession(code: number, reason: string): void {
    this.resolveClosed({ closeCode: code, reason });
  }

  rawControl(bytes: Uint8Array): Promise<void> {
    return this.control!.write(bytes);
  }

  private async serve(readable: ReadableStream<Uint8Array>): Promise<void> {
    const frames = new FrameReader(65_536);
    const reader = readable.getReader();
    for (;;) {
      const { value, done } = await reader.read().catch(() => ({ value: undefined, done: true as const }));
      if (done) return;
      frames.push(value);
      for (let p = frames.next(); p !== null; p = frames.next()) {
        if (this.hello === null) this.hello = decodeHello(p);
        else this.requests.push(decodeRequestFrame(p));
      }
    }
  }
}

const Ctor = MemoryWebTransport as unknown as WebTransportConstructor;

test("WebTransport: prefixed frames both ways, push streams by their first frame, session close codes", async () => {
  MemoryWebTransport.sessions = [];
  const hash = { algorithm: "sha-256" as const, value: new Uint8Array(32) };
  const connecting = Client.connect({
    token: "t",
    host: "example.test",
    port: 4433,
    WebTransport: Ctor,
    serverCertificateHashes: [hash],
    random: () => 0,
  });
  const first = await until(() => MemoryWebTransport.sessions[0]?.hello && MemoryWebTransport.sessions[0]);
  assert.equal(first.url, "https://example.test:4433/greendot");
  assert.deepEqual(first.options, { serverCertificateHashes: [hash] });
  assert.deepEqual(first.hello, { version: 1, token: "t", resume: null, foreground: true });
  // The push streams may overtake the welcome: the client keeps them until it has it.
  const batched = first.openPushStream();
  await batched({ type: "stream", tier: "batched" });
  await first.sendControl({
    type: "welcome",
    welcome: { version: 1, session: 41n, resumed: false, user: "al", device: "web", snapshots: [], maxFrame: 65_536 },
  });
  const realtime = first.openPushStream();
  await realtime({ type: "stream", tier: "realtime" });
  const client = await connecting;
  const events: ClientEvent[] = [];
  client.on((e) => events.push(e));
  assert.equal(client.binding, "webtransport");
  assert.equal(client.session, 41n);

  const subscribing = client.subscribe(["bob"], "realtime");
  const req = await until(() => first.requests[0]);
  assert.deepEqual(req.request, { type: "subscribe", targets: ["bob"], tier: "realtime" });
  await first.sendControl({
    type: "reply",
    id: req.id,
    result: { ok: true, value: { type: "subscribed", snapshots: [{ target: "bob", tier: "realtime", presence: presence(3n) }], refused: [] } },
  });
  await subscribing;
  await realtime({ type: "update", target: "bob", presence: presence(4n, false) });
  await batched({ type: "update", target: "bob", presence: presence(5n) });
  await until(() => client.presence("bob")?.version === 5n);
  assert.deepEqual(
    events.filter((e) => e.type === "presence").map((e) => e.type === "presence" && [e.presence.version, e.source]),
    [
      [3n, "snapshot"],
      [4n, "realtime"],
      [5n, "batched"],
    ],
  );

  // The session closed with 14 (Draining) and retry_ms=0: a new session, resuming.
  first.closeSession(14, "server draining retry_ms=0");
  const second = await until(() => MemoryWebTransport.sessions[1]?.hello && MemoryWebTransport.sessions[1]);
  assert.equal(second.hello!.resume, 41n);
  await second.sendControl({
    type: "welcome",
    welcome: {
      version: 1,
      session: 42n,
      resumed: true,
      user: "al",
      device: "web",
      snapshots: [{ target: "bob", tier: "realtime", presence: presence(6n) }],
      maxFrame: 65_536,
    },
  });
  await until(() => client.session === 42n && client.presence("bob")?.version === 6n);

  // A frame over the client's cap on the control stream: the client closes with 4 (ProtocolError).
  await second.rawControl(Uint8Array.of(0x01, 0x00, 0x00, 0x01));
  await until(() => second.closedByClient);
  assert.equal(second.closedByClient!.closeCode, 4);
  const third = await until(() => MemoryWebTransport.sessions[2]?.hello && MemoryWebTransport.sessions[2]);
  assert.equal(third.hello!.resume, 42n);

  // Logout: the request, then the session closed by the client with close code 1.
  const out = client.logout();
  await until(() => third.requests.length === 0 && third.hello && true);
  await third.sendControl({
    type: "welcome",
    welcome: { version: 1, session: 43n, resumed: true, user: "al", device: "web", snapshots: [], maxFrame: 65_536 },
  });
  const logoutReq = await until(() => third.requests.find((r) => r.request.type === "logout"));
  await third.sendControl({ type: "reply", id: logoutReq.id, result: { ok: true, value: { type: "done" } } });
  await out;
  assert.equal(third.closedByClient!.closeCode, 1);
  assert.ok(client.isClosed);
});
