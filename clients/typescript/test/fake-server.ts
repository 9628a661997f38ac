// An in-test greendot server speaking the WebSocket binding of
// docs/protocol.md ("WebSocket over TLS", without the TLS) over a real `ws`
// server: enough of the session layer (sessions, resume, subscriptions,
// pushes, close codes, groups) to drive the client's logic. Tests against a real
// `greendot serve` replace this with the real server and keep the client side.

import { type AddressInfo } from "node:net";
import { WebSocket, WebSocketServer } from "ws";
import {
  CloseCode,
  decodeHello,
  decodeRequestFrame,
  encodePush,
  encodeServerFrame,
  type Answer,
  type GroupEntry,
  type Hello,
  type Push,
  type Presence,
  type RequestFrame,
  type ServerFrame,
  type Tier,
  type WebSocketConstructor,
  type WireError,
} from "../src/index.js";

export const ClientWebSocket = WebSocket as unknown as WebSocketConstructor;

export const presence = (version: bigint, online = true, extra: Partial<Presence> = {}): Presence => ({
  version,
  online,
  status: "available",
  message: null,
  kinds: online ? 4 : 0,
  lastSeen: online ? null : 1_700_000_000_000n,
  invisible: false,
  ...extra,
});

interface Session {
  id: bigint;
  subs: Map<string, Tier>;
  groups: Set<bigint>;
  live: boolean;
}

/** A group as the fake keeps it: the lists, its version and count, and the member list its pages show. */
export interface FakeGroup {
  members: Set<string>;
  admins: Set<string>;
  version: bigint;
  count: number;
  entries: GroupEntry[];
}

/** Waits until `check` gives a value, or fails after `ms`. */
export async function until<T>(check: () => T | undefined | null | false, ms = 2000, what = "condition"): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const value = check();
    if (value !== undefined && value !== null && value !== false) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

export class FakeConnection {
  hello: Hello | null = null;
  session: Session | null = null;
  readonly requests: RequestFrame[] = [];
  /** The WebSocket close code and reason the connection ended with (from either side). */
  closeInfo: { code: number; reason: string; byServer: boolean } | null = null;
  readonly helloAt = Date.now();
  /** Stream byte of each tier's push stream: batched on 1, realtime on 2, to show the client reads the first frame. */
  readonly streamOf: Record<Tier, number> = { batched: 1, realtime: 2 };

  constructor(
    readonly server: FakeServer,
    readonly ws: WebSocket,
  ) {}

  send(stream: number, payload: Uint8Array): void {
    this.ws.send(Uint8Array.of(stream, ...payload));
  }

  control(frame: ServerFrame): void {
    this.send(0, encodeServerFrame(frame));
  }

  /** A group push on the push stream of `tier`. */
  pushGroup(tier: Tier, push: Push): void {
    this.send(this.streamOf[tier], encodePush(push));
  }

  /** An update on the push stream of `tier`. */
  push(tier: Tier, target: string, p: Presence): void {
    this.send(this.streamOf[tier], encodePush({ type: "update", target, presence: p }));
  }

  /** Closes with greendot close code `code` (WebSocket 4000 + code). */
  close(code: number, reason: string): void {
    this.closeInfo ??= { code: 4000 + code, reason, byServer: true };
    this.ws.close(4000 + code, reason);
  }

  /** Drops the TCP connection without a close frame. */
  drop(): void {
    this.closeInfo ??= { code: 1006, reason: "dropped", byServer: true };
    this.ws.terminate();
  }

  waitRequest(type: RequestFrame["request"]["type"], ms = 2000): Promise<RequestFrame> {
    return until(() => this.requests.find((r) => r.request.type === type), ms, `a ${type} request`);
  }
}

export class FakeServer {
  readonly connections: FakeConnection[] = [];
  readonly sessions = new Map<bigint, Session>();
  /** What a subscribe or a resume answers for each user (default version 1, online). */
  readonly presences = new Map<string, Presence>();
  /** Groups (every session's user is "al"). */
  readonly groups = new Map<bigint, FakeGroup>();
  /** Targets a refresh ends (a narrower watch). */
  refreshEnds: string[] = [];
  /** Request types left unanswered. */
  readonly hold = new Set<string>();
  /** Refuse every hello with this error frame, close code and close reason. */
  refuse: { error: WireError; code: number; reason: string } | null = null;
  /** Push frames sent before the welcome (a misbehaving server). */
  pushesBeforeWelcome = 0;
  private nextSession = 100n;

  private constructor(
    private readonly wss: WebSocketServer,
    readonly url: string,
  ) {
    wss.on("connection", (ws) => this.accept(ws));
  }

  static async start(): Promise<FakeServer> {
    const wss = new WebSocketServer({
      host: "127.0.0.1",
      port: 0,
      path: "/greendot",
      handleProtocols: (protocols) => (protocols.has("greendot.v1") ? "greendot.v1" : false),
    });
    await new Promise<void>((resolve) => wss.once("listening", () => resolve()));
    const { port } = wss.address() as AddressInfo;
    return new FakeServer(wss, `ws://127.0.0.1:${port}/greendot`);
  }

  async stop(): Promise<void> {
    for (const c of this.connections) c.ws.terminate();
    await new Promise<void>((resolve) => this.wss.close(() => resolve()));
  }

  /** The n-th connection (from 1) once its hello is handled. */
  connection(n: number, ms = 3000): Promise<FakeConnection> {
    return until(() => {
      const c = this.connections[n - 1];
      return c?.hello ? c : undefined;
    }, ms, `connection ${n}`);
  }

  presenceOf(user: string): Presence {
    return this.presences.get(user) ?? presence(1n);
  }

  private accept(ws: WebSocket): void {
    const conn = new FakeConnection(this, ws);
    this.connections.push(conn);
    ws.on("close", (code, reason) => {
      conn.closeInfo ??= { code, reason: reason.toString(), byServer: false };
      // A client's close 4001 is a logout; anything else leaves the session to linger.
      if (code === 4001 && conn.session) conn.session.live = false;
    });
    ws.on("message", (data, isBinary) => {
      if (!isBinary) {
        conn.control({ type: "error", error: { code: 1, message: "a text message" } });
        conn.close(CloseCode.ProtocolError, "BadFrame: a text message");
        return;
      }
      const bytes = new Uint8Array(data as Buffer);
      if (conn.hello === null) this.hello(conn, bytes);
      else this.request(conn, decodeRequestFrame(bytes));
    });
  }

  private hello(conn: FakeConnection, bytes: Uint8Array): void {
    const hello = decodeHello(bytes);
    if (this.refuse) {
      conn.hello = hello;
      conn.control({ type: "error", error: this.refuse.error });
      conn.close(this.refuse.code, this.refuse.reason);
      return;
    }
    const old = hello.resume === null ? undefined : this.sessions.get(hello.resume);
    const resumed = old !== undefined && old.live;
    if (old) this.sessions.delete(old.id);
    const session: Session = { id: this.nextSession++, subs: resumed ? old.subs : new Map(), groups: resumed ? old.groups : new Set(), live: true };
    this.sessions.set(session.id, session);
    conn.session = session;
    for (let i = 0; i < this.pushesBeforeWelcome; i++) conn.send(1, encodePush({ type: "stream", tier: "batched" }));
    conn.control({
      type: "welcome",
      welcome: {
        version: 1,
        session: session.id,
        resumed,
        user: "al",
        device: "phone",
        snapshots: [...session.subs].map(([target, tier]) => ({ target, tier, presence: this.presenceOf(target) })),
        maxFrame: 65_536,
      },
    });
    conn.send(1, encodePush({ type: "stream", tier: "batched" }));
    conn.send(2, encodePush({ type: "stream", tier: "realtime" }));
    conn.hello = hello;
  }

  private request(conn: FakeConnection, frame: RequestFrame): void {
    conn.requests.push(frame);
    const req = frame.request;
    if (this.hold.has(req.type)) return;
    const session = conn.session!;
    let answer: Answer | WireError;
    switch (req.type) {
      case "subscribe":
        for (const t of req.targets) session.subs.set(t, req.tier);
        answer = {
          type: "subscribed",
          snapshots: req.targets.map((target) => ({ target, tier: req.tier, presence: this.presenceOf(target) })),
          refused: [],
        };
        break;
      case "unsubscribe":
        answer = session.subs.delete(req.target) ? { type: "done" } : { code: 9, message: "not subscribed" };
        break;
      case "query":
        answer = { type: "presences", results: req.targets.map((target) => ({ target, result: { ok: true, value: this.presenceOf(target) } })) };
        break;
      case "route":
        answer = { type: "route", entries: [{ device: "phone", kind: "web", session: session.id }] };
        break;
      case "refresh": {
        // The ended subscriptions: those `refreshEnds` names.
        const ended = this.refreshEnds.filter((t) => session.subs.delete(t));
        answer = { type: "refreshed", expires: 0n, ended };
        break;
      }
      case "revoke":
        answer = { type: "revoked", closed: 1 };
        break;
      case "setGroup": {
        const version = (this.groups.get(req.group)?.version ?? 0n) + 1n;
        const members = new Set([...req.members, ...req.admins]);
        this.groups.set(req.group, { members, admins: new Set(req.admins), version, count: 0, entries: [] });
        answer = { type: "groupSet", version };
        break;
      }
      case "removeGroup":
        answer = this.groups.delete(req.group) ? { type: "done" } : { code: 30, message: "unknown group" };
        break;
      case "groupSubscribe": {
        const g = this.groups.get(req.group);
        if (g === undefined || !g.members.has("al")) {
          answer = { code: 29, message: "not a member" };
          break;
        }
        session.groups.add(req.group);
        const role = g.admins.has("al") ? "admin" : "member";
        answer = { type: "groupSubscribed", snapshot: { group: req.group, role, version: g.version, count: g.count, members: g.members.size } };
        break;
      }
      case "groupUnsubscribe":
        answer = session.groups.delete(req.group) ? { type: "done" } : { code: 9, message: "not subscribed" };
        break;
      case "groupPage":
      case "groupWatchPage": {
        const g = this.groups.get(req.group);
        if (g === undefined || !g.members.has("al")) {
          answer = { code: 29, message: "not a member" };
          break;
        }
        // The cursor's `after`: the index of the previous page's last entry.
        const start = req.after === null ? 0 : Number(req.after.after) + 1;
        const entries = g.entries.slice(start, start + req.limit);
        const last = start + entries.length - 1;
        const next = last + 1 < g.entries.length ? { online: g.entries[last]!.presence.online, after: BigInt(last) } : null;
        answer = { type: "groupPage", page: { group: req.group, version: g.version, count: g.count, entries, next } };
        break;
      }
      default:
        answer = { type: "done" };
    }
    const result = "code" in answer ? { ok: false as const, error: answer } : { ok: true as const, value: answer };
    conn.control({ type: "reply", id: frame.id, result });
    if (req.type === "logout") {
      session.live = false;
      conn.close(CloseCode.Logout, "logout");
    }
  }
}
