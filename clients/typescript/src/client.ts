// The client: the Rust client's API (transport/src/client.rs) over the
// browser bindings. Snapshots and pushes go through a View, so stale or
// duplicate versions never reach the application. When the connection is lost
// (not closed by the application, not refused for good by the server) the
// client reconnects after a full-jitter wait (or within the server's
// retry_ms) and resumes its session; if the session could not be resumed it
// forgets its versions and subscribes again to what it had (groups too).

import { Backoff, retryHint } from "./backoff.js";
import type { Binding, Carrier, CarrierHandlers, Dial } from "./carrier.js";
import {
  ClosedError,
  ConfigError,
  ConnectError,
  GreendotError,
  LostError,
  ProtocolError,
  RejectedError,
  ServerError,
  TimeoutError,
} from "./errors.js";
import { decodePush, decodeServerFrame, encodeHello, encodeRequestFrame } from "./frames.js";
import {
  type Answer,
  CloseCode,
  type GroupChange,
  type GroupCursor,
  type GroupEntry,
  type GroupPage,
  type GroupSnapshot,
  type Push,
  DEFAULT_MAX_FRAME,
  ErrorCode,
  mayReconnect,
  type Presence,
  PROTOCOL_VERSION,
  type Refused,
  type Request,
  type Result,
  type RouteEntry,
  type ServerFrame,
  type Snapshot,
  type Status,
  type Tier,
  type Welcome,
  type WireError,
} from "./types.js";
import { View } from "./view.js";
import { dialWebSocket, type WebSocketConstructor } from "./websocket.js";
import { type CertificateHash, dialWebTransport, type WebTransportConstructor } from "./webtransport.js";

export interface ReconnectPolicy {
  /** The ceiling of the first wait after a loss; it doubles per attempt. Default 100 ms. */
  initialBackoffMs?: number;
  /** The largest ceiling of a wait (a server's retry_ms may exceed it). Default 5000 ms. */
  maxBackoffMs?: number;
  /** Stop trying after this long without a connection (null: never). Default 300 000 ms. */
  giveUpAfterMs?: number | null;
}

export interface ClientOptions {
  /** The hello's token (a JWT, docs/protocol.md "Credentials"). */
  token: string;
  /** Server host; the URLs below are built from it unless given. */
  host?: string;
  /** Server port: the QUIC UDP port for WebTransport, the same number on TCP for WebSocket. Default 4433. */
  port?: number;
  /** Default `wss://HOST:PORT/greendot`. */
  webSocketUrl?: string;
  /** Default `https://HOST:PORT/greendot`. */
  webTransportUrl?: string;
  /** Try WebTransport first when it exists (default true). */
  webTransport?: boolean;
  /** For a dev server's self-signed certificate: the SHA-256 of its DER. */
  serverCertificateHashes?: CertificateHash[];
  /** The WebSocket class (default `globalThis.WebSocket`; in Node 20 pass the `ws` package's). */
  WebSocket?: WebSocketConstructor;
  /** The WebTransport class (default `globalThis.WebTransport`). */
  WebTransport?: WebTransportConstructor;
  /** How long WebTransport may take to open before the client tries WebSocket. Default 3000 ms. */
  webTransportTimeoutMs?: number;
  /** How long one attempt to connect and say hello may take. Default 5000 ms. */
  connectTimeoutMs?: number;
  /** How long a request may wait for its answer. Default 10 000 ms. */
  requestTimeoutMs?: number;
  /** WebSocket only: send a Ping request after this long without a message. Default 15 000 ms. */
  keepAliveMs?: number;
  /** WebSocket only: the connection counts as lost after this long without a message. Default 45 000 ms. */
  idleTimeoutMs?: number;
  /** null: a lost connection ends the client. */
  reconnect?: ReconnectPolicy | null;
  /** Uniform in [0, 1): the source of the backoff's jitter (default Math.random). */
  random?: () => number;
  /** The hello's protocol version (change it only to test a server). */
  version?: number;
  /**
   * Fetches a new token for the same user and device (from the application's
   * backend). Called ahead of the token's `exp` (the new token is sent on the
   * live connection: docs/protocol.md "Tokens on live sessions"), and before
   * reconnecting once the token has run out. A rejection is retried a second
   * later. Without it the connection ends with `TokenExpired` at expiry.
   */
  refreshToken?: () => Promise<string>;
  /** How long before `exp` to refresh (at most 1/5 of the remaining life earlier). Default 60 000 ms. */
  refreshAheadMs?: number;
  /**
   * Whether the app is in the foreground at connect. Default true. A
   * backgrounded device is not present: its user is shown offline unless
   * another device is in the foreground (docs/protocol.md "Foreground and
   * background").
   */
  foreground?: boolean;
}

/** A JWT's `exp` (Unix seconds), unchecked (the server checks); null if unreadable. */
export function tokenExpiry(token: string): number | null {
  try {
    const part = token.split(".")[1];
    if (part === undefined) return null;
    const b64 = part.replace(/-/g, "+").replace(/_/g, "/");
    const json = JSON.parse(atob(b64 + "=".repeat((4 - (b64.length % 4)) % 4))) as { exp?: unknown };
    return typeof json.exp === "number" ? json.exp : null;
  } catch {
    return null;
  }
}

/** Milliseconds until `token` is due for refresh, or null without an `exp`. */
function refreshDelay(token: string, aheadMs: number): number | null {
  const exp = tokenExpiry(token);
  if (exp === null) return null;
  const left = Math.max(0, exp * 1000 - Date.now());
  return left - Math.min(aheadMs, left / 5);
}

/** Where an update came from. */
export type Source = "snapshot" | "realtime" | "batched";

export type ClientEvent =
  /** What the client knows of `target` changed (a newer version only). */
  | { type: "presence"; target: string; presence: Presence; source: Source }
  /** The connection was lost; the client is reconnecting. */
  | { type: "disconnected"; reason: string }
  /** A new connection; `resumed` false means a fresh session (the client subscribed again). */
  | { type: "reconnected"; session: bigint; resumed: boolean; binding: Binding }
  /** A new token took over on the live connection; `ended`: subscriptions its `watch` no longer allows. */
  | { type: "tokenRefreshed"; ended: string[] }
  /**
   * A subscribed group's online count (members shown online). Members get it
   * batched, when it changed; admins in realtime, after each membership
   * write. `snapshot`: the answer to the client's own subscribe again after
   * a reconnect that did not resume. Versions rise per group: older ones are
   * dropped.
   */
  | { type: "groupCount"; group: bigint; version: bigint; count: number; source: Source }
  /** To an admin: `member` is now shown online (or offline), and the count after it. */
  | { type: "groupMember"; group: bigint; version: bigint; member: string; online: boolean; count: number }
  /** The group subscription is over: the user left the group, or it was removed. */
  | { type: "groupEnded"; group: bigint }
  /**
   * Members of a watched page (`groupWatchPage`) whose view changed, each with
   * its latest view; batched.
   */
  | { type: "groupPageDelta"; group: bigint; entries: GroupEntry[] }
  /**
   * The client is finished: closed by the application, logged out, or refused
   * for good. `code` is the close code (the server's, or the one the client
   * closed with), null when it gave up reconnecting; `reason` the server's
   * error message or close reason.
   */
  | { type: "closed"; code: number | null; reason: string };

export interface Subscribed {
  /** Granted targets with the tier granted. */
  snapshots: Snapshot[];
  refused: Refused[];
}

interface Pending {
  request: Request;
  /** Requests the client sends itself (resubscribe, keep-alive) have no caller. */
  caller: { resolve(a: Answer): void; reject(e: Error): void } | null;
  timer?: ReturnType<typeof setTimeout>;
  /** Where it was sent, to forget it there when its caller gives up. */
  sent?: { conn: Connection; id: bigint };
  done: boolean;
}

interface Settings {
  requestTimeoutMs: number;
  connectTimeoutMs: number;
  webTransportTimeoutMs: number;
  keepAliveMs: number;
  idleTimeoutMs: number;
  reconnect: Required<ReconnectPolicy> | null;
  random: () => number;
  version: number;
  token: string;
  refreshToken: (() => Promise<string>) | null;
  refreshAheadMs: number;
  /** The app's state as last reported by the application; every hello carries it. */
  foreground: boolean;
  dials: { binding: Binding; dial: Dial; timeoutMs: number | null }[];
}

function settingsOf(o: ClientOptions): Settings {
  const port = o.port ?? 4433;
  const g = globalThis as { WebSocket?: unknown; WebTransport?: unknown };
  const WS = o.WebSocket ?? (g.WebSocket as WebSocketConstructor | undefined);
  const WT = o.WebTransport ?? (g.WebTransport as WebTransportConstructor | undefined);
  const need = (url: string | undefined, scheme: string) => {
    if (url !== undefined) return url;
    if (o.host === undefined) throw new ConfigError("give host, or the URLs");
    // An IPv6 literal needs brackets in a URL.
    const host = o.host.includes(":") && !o.host.startsWith("[") ? `[${o.host}]` : o.host;
    return `${scheme}://${host}:${port}/greendot`;
  };
  const s: Settings = {
    requestTimeoutMs: o.requestTimeoutMs ?? 10_000,
    connectTimeoutMs: o.connectTimeoutMs ?? 5_000,
    webTransportTimeoutMs: o.webTransportTimeoutMs ?? 3_000,
    keepAliveMs: o.keepAliveMs ?? 15_000,
    idleTimeoutMs: o.idleTimeoutMs ?? 45_000,
    reconnect:
      o.reconnect === null
        ? null
        : {
            initialBackoffMs: o.reconnect?.initialBackoffMs ?? 100,
            maxBackoffMs: o.reconnect?.maxBackoffMs ?? 5_000,
            giveUpAfterMs: o.reconnect?.giveUpAfterMs === undefined ? 300_000 : o.reconnect.giveUpAfterMs,
          },
    random: o.random ?? Math.random,
    version: o.version ?? PROTOCOL_VERSION,
    token: o.token,
    refreshToken: o.refreshToken ?? null,
    refreshAheadMs: o.refreshAheadMs ?? 60_000,
    foreground: o.foreground ?? true,
    dials: [],
  };
  if (s.idleTimeoutMs <= s.keepAliveMs) throw new ConfigError("idleTimeoutMs must exceed keepAliveMs");
  if (WT !== undefined && o.webTransport !== false) {
    s.dials.push({
      binding: "webtransport",
      dial: dialWebTransport(need(o.webTransportUrl, "https"), WT, o.serverCertificateHashes),
      timeoutMs: s.webTransportTimeoutMs,
    });
  }
  if (WS !== undefined) {
    s.dials.push({ binding: "websocket", dial: dialWebSocket(need(o.webSocketUrl, "wss"), WS), timeoutMs: null });
  }
  if (s.dials.length === 0) throw new ConfigError("neither WebTransport nor WebSocket is available: pass options.WebSocket");
  return s;
}

/** A close code's error code, for a close that came without an error frame (as the Rust client). */
function errorCodeForClose(code: number): number {
  switch (code) {
    case CloseCode.Unauthorized:
      return ErrorCode.BadToken;
    case CloseCode.TokenExpired:
      return ErrorCode.TokenExpired;
    case CloseCode.UnsupportedVersion:
      return ErrorCode.UnsupportedVersion;
    case CloseCode.FrameTooLarge:
      return ErrorCode.FrameTooLarge;
    case CloseCode.ProtocolError:
      return ErrorCode.BadFrame;
    case CloseCode.TooManyConnections:
      return ErrorCode.TooManyConnections;
    case CloseCode.Shutdown:
    case CloseCode.Draining:
      return ErrorCode.ShuttingDown;
    case CloseCode.Superseded:
    case CloseCode.SessionExpired:
      return ErrorCode.Stale;
    default:
      return 0;
  }
}

/** Push frames kept while the welcome is awaited (more is a protocol error). */
const MAX_EARLY_PUSHES = 64;

/** Groups whose version the client tracks at most (the server allows 100 group subscriptions per session by default). */
const MAX_TRACKED_GROUPS = 1024;

/** A group id as the wire has it: a u64 (a number must be a safe integer). */
function groupId(group: bigint | number): bigint {
  if (typeof group === "number" && !Number.isSafeInteger(group)) throw new ConfigError(`group ${group} is not an exact integer: pass a bigint`);
  return BigInt(group);
}

/** One connection: its carrier, its requests in flight, its push streams. */
class Connection implements CarrierHandlers {
  carrier: Carrier | null = null;
  welcome: Welcome | null = null;
  maxFrame = DEFAULT_MAX_FRAME;
  readonly pending = new Map<bigint, Pending>();
  /** What this connection's hello said of the foreground. */
  helloForeground = true;
  private readonly tiers = new Map<number, Tier>();
  /** Pushes that came before the welcome was taken (WebTransport streams may overtake it). */
  private early: [number, Uint8Array][] | null = [];
  /** The server's error frame, told with the close that follows it. */
  private errorFrame: WireError | null = null;
  private ended = false;
  /** Why it ended, if it did. */
  endError: GreendotError | null = null;
  private lastHeard = Date.now();
  private pingSent = false;
  private heartbeat: ReturnType<typeof setTimeout> | undefined;
  /** Settles the hello: the welcome, or why there is none. */
  private helloWaiter: { resolve(w: Welcome): void; reject(e: Error): void } | null = null;

  constructor(private readonly client: Client) {}

  /** Sends the hello and waits for the welcome. */
  hello(carrier: Carrier, hello: Uint8Array): Promise<Welcome> {
    this.carrier = carrier;
    return new Promise<Welcome>((resolve, reject) => {
      this.helloWaiter = { resolve, reject };
      carrier.send(hello);
    });
  }

  control(payload: Uint8Array): void {
    if (this.ended) return;
    this.heard();
    let frame: ServerFrame;
    try {
      frame = decodeServerFrame(payload);
    } catch (e) {
      return this.fail(new ProtocolError(`undecodable control frame: ${(e as Error).message}`));
    }
    if (this.helloWaiter !== null) {
      const waiter = this.helloWaiter;
      if (frame.type === "welcome") {
        this.helloWaiter = null;
        this.welcome = frame.welcome;
        this.maxFrame = Math.max(frame.welcome.maxFrame, 1024);
        waiter.resolve(frame.welcome);
      } else if (frame.type === "error") {
        // The server closes next: the rejection is told with its close code.
        this.errorFrame = frame.error;
      } else {
        this.fail(new ProtocolError("a reply before the welcome"));
      }
      return;
    }
    switch (frame.type) {
      case "welcome":
        return this.fail(new ProtocolError("a second welcome"));
      case "error":
        this.errorFrame = frame.error;
        return;
      case "reply":
        return this.client.reply(this, frame.id, frame.result);
    }
  }

  push(stream: number, payload: Uint8Array): void {
    if (this.ended) return;
    this.heard();
    if (this.early !== null) {
      // Before the welcome a server sends at most its two streams' first frames.
      if (this.early.length >= MAX_EARLY_PUSHES) return this.fail(new ProtocolError("pushes flood in before the welcome"));
      this.early.push([stream, payload]);
      return;
    }
    let push;
    try {
      push = decodePush(payload);
    } catch (e) {
      return this.fail(new ProtocolError(`undecodable push frame: ${(e as Error).message}`));
    }
    if (push.type === "stream") {
      this.tiers.set(stream, push.tier);
      return;
    }
    // A push before its stream's first frame has no tier: dropped (as the Rust client).
    const tier = this.tiers.get(stream);
    if (tier === undefined) return;
    if (push.type === "update") this.client.applyPresence(push.target, push.presence, tier);
    else this.client.applyGroupPush(push, tier);
  }

  /** The welcome was taken: pushes that waited for it go through now. */
  start(): void {
    const early = this.early ?? [];
    this.early = null;
    for (const [stream, payload] of early) this.push(stream, payload);
    if (this.carrier?.needsHeartbeat) this.scheduleHeartbeat(this.client.settings.keepAliveMs);
  }

  closed(code: number | null, reason: string): void {
    if (this.ended) return;
    let error: GreendotError;
    if (code === null || code === CloseCode.Normal) {
      error = new LostError(reason === "" ? "connection lost" : reason);
    } else {
      let wire = this.errorFrame ?? { code: errorCodeForClose(code), message: reason };
      // Keep the close reason's retry_ms with the error frame if only the reason has it.
      const hint = retryHint(reason);
      if (this.errorFrame !== null && retryHint(wire.message) === null && hint !== null) {
        wire = { code: wire.code, message: `${wire.message} retry_ms=${hint}` };
      }
      error = new RejectedError(code, wire);
    }
    this.end(error);
  }

  /** Ends the connection on the client's side (a protocol error of the server's, a silent server). */
  fail(error: GreendotError): void {
    if (this.ended) return;
    this.carrier?.close(error instanceof ProtocolError ? CloseCode.ProtocolError : CloseCode.Normal, error.message);
    this.end(error);
  }

  /** Closed by the application: no reconnect follows. */
  shut(code: number, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    this.stopHeartbeat();
    this.carrier?.close(code, reason);
  }

  get isEnded(): boolean {
    return this.ended;
  }

  private end(error: GreendotError): void {
    this.ended = true;
    this.endError = error;
    this.stopHeartbeat();
    if (this.helloWaiter !== null) {
      this.helloWaiter.reject(error);
      this.helloWaiter = null;
      return;
    }
    this.client.connectionEnded(this, error);
  }

  sendRequest(p: Pending, id: bigint): boolean {
    const payload = encodeRequestFrame({ id, request: p.request });
    if (payload.length > this.maxFrame) {
      this.client.settle(p, new ConfigError(`request of ${payload.length} bytes exceeds the server's frame cap of ${this.maxFrame}`));
      return false;
    }
    this.pending.set(id, p);
    p.sent = { conn: this, id };
    this.carrier?.send(payload);
    return true;
  }

  private heard(): void {
    this.lastHeard = Date.now();
    this.pingSent = false;
  }

  // WebSocket keep-alive: a browser cannot see the server's pings, so after a
  // quiet spell the client asks a Ping itself; a server silent for the idle
  // timeout is lost.
  private scheduleHeartbeat(delay: number): void {
    this.stopHeartbeat();
    this.heartbeat = setTimeout(() => this.checkHeartbeat(), Math.max(delay, 1));
  }

  private checkHeartbeat(): void {
    if (this.ended) return;
    const { keepAliveMs, idleTimeoutMs } = this.client.settings;
    const quiet = Date.now() - this.lastHeard;
    if (quiet >= idleTimeoutMs) {
      return this.fail(new LostError(`no message from the server for ${quiet} ms`));
    }
    if (quiet >= keepAliveMs && !this.pingSent) {
      this.pingSent = true;
      this.client.sendInternal(this, { type: "ping" });
    }
    const next = quiet < keepAliveMs ? keepAliveMs - quiet : idleTimeoutMs - quiet;
    this.scheduleHeartbeat(next);
  }

  private stopHeartbeat(): void {
    if (this.heartbeat !== undefined) clearTimeout(this.heartbeat);
    this.heartbeat = undefined;
  }
}

export class Client {
  /** @internal */
  readonly settings: Settings;
  private sessionId: bigint = 0n;
  private userName = "";
  private deviceName = "";
  private bindingName: Binding = "websocket";
  private readonly view = new View();
  /** What the application subscribed to, to subscribe again after a reconnect that did not resume. */
  private readonly wanted = new Map<string, Tier>();
  /** The highest version told of each subscribed group (its keys: the groups to subscribe again). */
  private readonly groupVersions = new Map<bigint, bigint>();
  private conn: Connection | null = null;
  /** Requests waiting for a connection (made while reconnecting). */
  private queue: Pending[] = [];
  private nextId = 0n;
  private finished = false;
  private readonly listeners = new Set<(e: ClientEvent) => void>();
  private cancelWait: (() => void) | null = null;
  private refreshTimer: ReturnType<typeof setTimeout> | undefined;
  /** Set by appForegrounded: the reconnect loop's backoff starts over. */
  private restartBackoff = false;

  private constructor(settings: Settings) {
    this.settings = settings;
  }

  /** Connects (WebTransport first when available, else or on its failure WebSocket), says hello. */
  static async connect(options: ClientOptions): Promise<Client> {
    const client = new Client(settingsOf(options));
    const [conn, welcome] = await client.establish(null);
    client.take(conn, welcome, true);
    return client;
  }

  /** The current session (it changes with every welcome). */
  get session(): bigint {
    return this.sessionId;
  }
  get user(): string {
    return this.userName;
  }
  get device(): string {
    return this.deviceName;
  }
  /** The binding of the current (or last) connection. */
  get binding(): Binding {
    return this.bindingName;
  }
  /** Whether the client is finished (see the `closed` event). */
  get isClosed(): boolean {
    return this.finished;
  }
  /** Whether a connection is up now (false while reconnecting). */
  get isConnected(): boolean {
    return this.conn !== null;
  }

  /** What the client knows of `target`. */
  presence(target: string): Presence | undefined {
    return this.view.get(target);
  }

  /** Everything the client knows. */
  presences(): Map<string, Presence> {
    return new Map(this.view.entries());
  }

  /** Calls `listener` with every event from now on; returns a function that stops it. */
  on(listener: (event: ClientEvent) => void): () => void {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }

  /** Every event from now on, until (and including) `closed`. */
  updates(): AsyncIterableIterator<ClientEvent> {
    const buffered: ClientEvent[] = [];
    let wake: (() => void) | null = null;
    let over = this.finished;
    const off = this.on((event) => {
      buffered.push(event);
      if (event.type === "closed") off();
      wake?.();
    });
    if (over) off();
    const iterator: AsyncIterableIterator<ClientEvent> = {
      next: async () => {
        for (;;) {
          const event = buffered.shift();
          if (event !== undefined) {
            if (event.type === "closed") over = true;
            return { value: event, done: false };
          }
          if (over) return { value: undefined, done: true };
          await new Promise<void>((r) => (wake = r));
          wake = null;
        }
      },
      return: async () => {
        off();
        over = true;
        buffered.length = 0;
        return { value: undefined, done: true };
      },
      [Symbol.asyncIterator]: () => iterator,
    };
    return iterator;
  }

  /** A round trip (renews the session's lease). */
  async ping(): Promise<void> {
    expect(await this.call({ type: "ping" }), "done");
  }

  /** Watches `targets` in `tier`: snapshots now (already applied), updates as events. */
  async subscribe(targets: string[], tier: Tier): Promise<Subscribed> {
    const answer = expect(await this.call({ type: "subscribe", targets, tier }), "subscribed");
    return { snapshots: answer.snapshots, refused: answer.refused };
  }

  async unsubscribe(target: string): Promise<void> {
    this.wanted.delete(target);
    expect(await this.call({ type: "unsubscribe", target }), "done");
    this.view.forget(target);
  }

  /** What this session may see of one user now. */
  async query(target: string): Promise<Presence> {
    const results = await this.queryMany([target]);
    const last = results[results.length - 1];
    if (last === undefined) throw new ProtocolError("empty query answer");
    if (!last.result.ok) throw new ServerError(last.result.error);
    return last.result.value;
  }

  /** Several users at once (service tokens only). */
  async queryMany(targets: string[]): Promise<{ target: string; result: Result<Presence, WireError> }[]> {
    return expect(await this.call({ type: "query", targets }), "presences").results;
  }

  /** The user's status and message. Idempotent: after a TimeoutError, call it again. */
  async setStatus(status: Status, message: string | null = null): Promise<void> {
    expect(await this.call({ type: "setStatus", status, message }), "done");
  }

  /** Appear offline to everybody else (or stop). Idempotent like setStatus. */
  async setInvisible(invisible: boolean): Promise<void> {
    expect(await this.call({ type: "setInvisible", invisible }), "done");
  }

  /** The Online devices of `user` (service tokens only). */
  async route(user: string): Promise<RouteEntry[]> {
    return expect(await this.call({ type: "route", user }), "route").entries;
  }

  /**
   * Sends a new token for this user and device on the live connection (and
   * uses it for later hellos); resolves to the subscriptions its `watch` no
   * longer allows, which ended. Refused, the connection goes on as it was.
   */
  async refresh(token: string): Promise<string[]> {
    const { ended } = expect(await this.call({ type: "refresh", token }), "refreshed");
    this.settings.token = token;
    for (const target of ended) this.wanted.delete(target);
    this.scheduleRefresh();
    this.emit({ type: "tokenRefreshed", ended });
    return ended;
  }

  /** Service tokens only: revokes the tokens of `user` (of `device` only, if given) issued before `before` (Unix seconds). */
  async revoke(user: string, device: string | null, before: number): Promise<number> {
    return expect(await this.call({ type: "revoke", user, device, before: BigInt(before) }), "revoked").closed;
  }

  /**
   * Service tokens only: writes group `group` whole, its members and its
   * admins (an admin is a member whether listed or not); creates it if new.
   * Resolves to the membership version (1, 2, ... per write).
   */
  async setGroup(group: bigint | number, members: string[], admins: string[] = []): Promise<bigint> {
    return expect(await this.call({ type: "setGroup", group: groupId(group), members, admins }), "groupSet").version;
  }

  /**
   * Service tokens only: changes group `group` by difference. `remove`
   * leave (admins too), `removeAdmins` stay members only; then `add` join
   * as members and `addAdmins` as admins (and members). Creates the group
   * if new (a group that does not exist is at version 0). With
   * `expectVersion`, changes only a group at that membership version, else
   * a `ServerError` with code `VersionMismatch` (38) and nothing changes:
   * a backend writing in several steps sees a concurrent writer. Resolves
   * to the new membership version. The same limits as `setGroup`.
   */
  async changeGroup(group: bigint | number, change: GroupChange): Promise<bigint> {
    const request = {
      type: "changeGroup" as const,
      group: groupId(group),
      add: change.add ?? [],
      remove: change.remove ?? [],
      addAdmins: change.addAdmins ?? [],
      removeAdmins: change.removeAdmins ?? [],
      expectVersion: change.expectVersion === undefined || change.expectVersion === null ? null : BigInt(change.expectVersion),
    };
    return expect(await this.call(request), "groupSet").version;
  }

  /** Service tokens only: removes a group; its subscribers get `groupEnded`. */
  async removeGroup(group: bigint | number): Promise<void> {
    expect(await this.call({ type: "removeGroup", group: groupId(group) }), "done");
  }

  /**
   * Subscribes to a group this user is a member of: the snapshot (role,
   * version, online count, number of members) now, then `groupCount` events
   * (and for an admin `groupMember`). It lasts across reconnects: a resumed
   * session keeps it; after one that did not resume the client subscribes
   * again itself (`groupEnded` if refused).
   */
  async groupSubscribe(group: bigint | number): Promise<GroupSnapshot> {
    // The reply handler noted its version.
    return expect(await this.call({ type: "groupSubscribe", group: groupId(group) }), "groupSubscribed").snapshot;
  }

  async groupUnsubscribe(group: bigint | number): Promise<void> {
    const id = groupId(group);
    expect(await this.call({ type: "groupUnsubscribe", group: id }), "done");
    this.groupVersions.delete(id);
  }

  /**
   * A page of a group's member list (members only), online members first:
   * `after` is the previous page's `next` (null: the first page); at most
   * `limit` entries (the server clamps it into 1..=200 by default).
   */
  async groupPage(group: bigint | number, after: GroupCursor | null, limit: number): Promise<GroupPage> {
    return expect(await this.call({ type: "groupPage", group: groupId(group), after, limit }), "groupPage").page;
  }

  /**
   * `groupPage`, and the page is watched: its members' changes come as
   * `groupPageDelta` events until the watch expires (60 s by default) unless
   * renewed. At most 3 pages and 600 entries per session
   * (`TooManyWatchedPages`). A resumed session keeps its watches; after a
   * reconnect that did not resume, watch again (watching a watched page
   * again only renews it).
   */
  async groupWatchPage(group: bigint | number, after: GroupCursor | null, limit: number): Promise<GroupPage> {
    return expect(await this.call({ type: "groupWatchPage", group: groupId(group), after, limit }), "groupPage").page;
  }

  /** Renews the watch of the page asked with this `group` and `after`, without reading it. */
  async groupRenewWatch(group: bigint | number, after: GroupCursor | null): Promise<void> {
    expect(await this.call({ type: "groupRenewWatch", group: groupId(group), after }), "done");
  }

  /** Ends the watch of the page asked with this `group` and `after`. */
  async groupUnwatchPage(group: bigint | number, after: GroupCursor | null): Promise<void> {
    expect(await this.call({ type: "groupUnwatchPage", group: groupId(group), after }), "done");
  }

  /** The groups the client holds a subscription to (it subscribes to them again after a fresh session). */
  groups(): bigint[] {
    return [...this.groupVersions.keys()];
  }

  /** Whether the application last said the app is in the foreground. */
  get isForeground(): boolean {
    return this.settings.foreground;
  }

  /**
   * The app went to the background (call it from the platform's lifecycle
   * event). The device stops being present: once no device of the user is
   * in the foreground, watchers see them offline after the debounce, last
   * seen now. The session and its subscriptions stay. While disconnected it
   * resolves at once: the next hello carries the state.
   */
  async appBackgrounded(): Promise<void> {
    await this.tellForeground(false);
  }

  /**
   * The app is in the foreground again. A client that is reconnecting tries
   * at once, with its backoff started over; a connected one tells the
   * server, and the device is present again after the debounce.
   */
  async appForegrounded(): Promise<void> {
    this.restartBackoff = true;
    this.cancelWait?.();
    await this.tellForeground(true);
  }

  private async tellForeground(foreground: boolean): Promise<void> {
    this.settings.foreground = foreground;
    if (this.conn === null) return;
    expect(await this.call({ type: "setForeground", foreground }), "done");
  }

  /** Graceful logout: the device goes offline at once, and the client is finished. */
  async logout(): Promise<void> {
    let failure: unknown = null;
    try {
      expect(await this.call({ type: "logout" }), "done");
    } catch (e) {
      // The server may close with the logout code before the answer lands.
      if (!(e instanceof RejectedError && e.closeCode === CloseCode.Logout)) failure = e;
    }
    this.closeWith(CloseCode.Logout, "logout");
    if (failure !== null) throw failure;
  }

  /** Closes without logging out: the device lingers for its grace (a resume can follow elsewhere). */
  close(): void {
    this.closeWith(CloseCode.Normal, "closed by the application");
  }

  // ----- internals -----------------------------------------------------------

  /** Arms the refresh timer for the current token (with a refresh callback). */
  private scheduleRefresh(delayMs?: number): void {
    clearTimeout(this.refreshTimer);
    if (this.finished || this.settings.refreshToken === null) return;
    const delay = delayMs ?? refreshDelay(this.settings.token, this.settings.refreshAheadMs);
    if (delay === null) return;
    this.refreshTimer = setTimeout(() => void this.refreshNow(), Math.max(delay, 0));
  }

  private async refreshNow(): Promise<void> {
    const fetch = this.settings.refreshToken;
    if (fetch === null || this.finished) return;
    try {
      await this.refresh(await fetch());
    } catch {
      // The token is still good until `exp`: try again shortly.
      this.scheduleRefresh(1_000);
    }
  }

  private closeWith(code: number, reason: string): void {
    if (this.finished) return;
    const conn = this.conn;
    this.conn = null;
    if (conn !== null) {
      conn.shut(code, reason);
      this.failAll(conn, new ClosedError("the client is closed"));
    }
    this.finish(code, "closed by the application");
  }

  private finish(code: number | null, reason: string): void {
    if (this.finished) return;
    this.finished = true;
    clearTimeout(this.refreshTimer);
    this.cancelWait?.();
    const queued = this.queue;
    this.queue = [];
    for (const p of queued) this.settle(p, new ClosedError(`the client is closed: ${reason}`));
    this.emit({ type: "closed", code, reason });
  }

  private emit(event: ClientEvent): void {
    for (const listener of [...this.listeners]) {
      try {
        listener(event);
      } catch {
        // A listener's failure is the application's; the client goes on.
      }
    }
  }

  /** @internal Applies a snapshot or a push; emits an event if it is news. */
  applyPresence(target: string, presence: Presence, source: Source): void {
    if (this.view.apply(target, presence) !== "dropped") this.emit({ type: "presence", target, presence, source });
  }

  /** @internal A group push on a stream of `tier`. */
  applyGroupPush(push: Exclude<Push, { type: "stream" | "update" }>, tier: Tier): void {
    switch (push.type) {
      case "groupCount":
        return this.applyGroup({ type: "groupCount", group: push.group, version: push.version, count: push.count, source: tier });
      case "groupMember":
        return this.applyGroup({ ...push });
      case "groupEnded":
        return this.applyGroup({ ...push });
      case "groupPageDelta":
        return this.emit({ ...push });
    }
  }

  /** Emits a group event unless it is older than what the application was told (as the Rust client). */
  private applyGroup(event: Extract<ClientEvent, { type: "groupCount" | "groupMember" | "groupEnded" }>): void {
    if (event.type === "groupEnded") {
      if (this.groupVersions.delete(event.group)) this.emit(event);
      return;
    }
    const seen = this.groupVersions.get(event.group);
    if (seen !== undefined && seen >= event.version) return;
    // A push may overtake the subscribe's answer (another stream); the server pushes only what is subscribed.
    if (seen !== undefined || this.groupVersions.size < MAX_TRACKED_GROUPS) this.groupVersions.set(event.group, event.version);
    this.emit(event);
  }

  /** @internal Settles a request once: an answer or an error. */
  settle(p: Pending, outcome: Answer | Error): void {
    if (p.done) return;
    p.done = true;
    if (p.timer !== undefined) clearTimeout(p.timer);
    if (p.caller === null) return;
    if (outcome instanceof Error) p.caller.reject(outcome);
    else p.caller.resolve(outcome);
  }

  private call(request: Request): Promise<Answer> {
    if (this.finished) return Promise.reject(new ClosedError("the client is closed"));
    return new Promise<Answer>((resolve, reject) => {
      const p: Pending = { request, caller: { resolve, reject }, done: false };
      p.timer = setTimeout(() => {
        // A request still waiting to be sent is dropped: it never takes effect.
        this.queue = this.queue.filter((q) => q !== p);
        // One sent is forgotten: its late answer, if any, finds nothing waiting.
        p.sent?.conn.pending.delete(p.sent.id);
        this.settle(p, new TimeoutError(`no answer to ${request.type} within ${this.settings.requestTimeoutMs} ms`));
      }, this.settings.requestTimeoutMs);
      if (this.conn !== null) this.send(this.conn, p);
      else this.queue.push(p);
    });
  }

  private send(conn: Connection, p: Pending): void {
    this.nextId += 1n;
    conn.sendRequest(p, this.nextId);
  }

  /** @internal A request the client makes itself (no application caller waits for it). */
  sendInternal(conn: Connection, request: Request, caller: Pending["caller"] = null): void {
    this.send(conn, { request, caller, done: false });
  }

  /** @internal An answer from the server. */
  reply(conn: Connection, id: bigint, result: Result<Answer, WireError>): void {
    const p = conn.pending.get(id);
    conn.pending.delete(id);
    if (result.ok && result.value.type === "subscribed") {
      for (const s of result.value.snapshots) this.wanted.set(s.target, s.tier);
      for (const s of result.value.snapshots) this.applyPresence(s.target, s.presence, "snapshot");
    }
    if (result.ok && result.value.type === "groupSubscribed") {
      const { group, version } = result.value.snapshot;
      const seen = this.groupVersions.get(group);
      if (seen === undefined || seen < version) {
        if (seen !== undefined || this.groupVersions.size < MAX_TRACKED_GROUPS) this.groupVersions.set(group, version);
      }
    }
    // An answer to no request in flight: nothing waits for it.
    if (p === undefined) return;
    this.settle(p, result.ok ? result.value : new ServerError(result.error));
  }

  private failAll(conn: Connection, error: Error): void {
    for (const p of conn.pending.values()) this.settle(p, error);
    conn.pending.clear();
  }

  /** Opens a connection over the first binding that opens, says hello, waits for the welcome. */
  private async establish(resume: bigint | null): Promise<[Connection, Welcome]> {
    const controller = new AbortController();
    const timer = setTimeout(
      () => controller.abort(`no welcome within ${this.settings.connectTimeoutMs} ms`),
      this.settings.connectTimeoutMs,
    );
    const conn = new Connection(this);
    try {
      let carrier: Carrier | null = null;
      const failures: string[] = [];
      for (const { dial, timeoutMs, binding } of this.settings.dials) {
        const attempt = new AbortController();
        const onAbort = () => attempt.abort(controller.signal.reason);
        controller.signal.addEventListener("abort", onAbort, { once: true });
        const attemptTimer =
          timeoutMs === null ? undefined : setTimeout(() => attempt.abort(`${binding} did not open within ${timeoutMs} ms`), timeoutMs);
        try {
          carrier = await dial(conn, attempt.signal);
          break;
        } catch (e) {
          failures.push(`${binding}: ${(e as Error).message}`);
        } finally {
          clearTimeout(attemptTimer);
          controller.signal.removeEventListener("abort", onAbort);
        }
        if (controller.signal.aborted) break;
      }
      if (carrier === null) throw new ConnectError(failures.join("; "));
      conn.helloForeground = this.settings.foreground;
      const hello = encodeHello({
        version: this.settings.version,
        token: this.settings.token,
        resume,
        foreground: conn.helloForeground,
      });
      const aborted = new Promise<never>((_, reject) =>
        controller.signal.addEventListener("abort", () => reject(new ConnectError(String(controller.signal.reason))), {
          once: true,
        }),
      );
      try {
        const welcome = await Promise.race([conn.hello(carrier, hello), aborted]);
        return [conn, welcome];
      } catch (e) {
        conn.shut(CloseCode.Normal, "hello failed");
        throw e;
      }
    } finally {
      clearTimeout(timer);
      controller.abort("done");
    }
  }

  /** Makes a welcomed connection the current one. */
  private take(conn: Connection, welcome: Welcome, first: boolean): void {
    this.conn = conn;
    this.sessionId = welcome.session;
    this.userName = welcome.user;
    this.deviceName = welcome.device;
    this.bindingName = conn.carrier!.binding;
    if (!welcome.resumed) {
      // A fresh session, perhaps on a restarted server whose versions begin
      // again: forget what the old one said, or its snapshots would be dropped.
      this.view.clear();
      for (const group of this.groupVersions.keys()) this.groupVersions.set(group, 0n);
    }
    if (!first) this.emit({ type: "reconnected", session: welcome.session, resumed: welcome.resumed, binding: this.bindingName });
    for (const s of welcome.snapshots) this.applyPresence(s.target, s.presence, "snapshot");
    conn.start();
    this.scheduleRefresh();
    if (!welcome.resumed) {
      for (const tier of ["realtime", "batched"] as const) {
        const targets = [...this.wanted].filter(([, t]) => t === tier).map(([name]) => name);
        if (targets.length > 0) this.sendInternal(conn, { type: "subscribe", targets, tier });
      }
      for (const group of [...this.groupVersions.keys()].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0))) {
        this.sendInternal(conn, { type: "groupSubscribe", group }, {
          resolve: (answer) => {
            // The reply handler noted the version; the count the application knew may be stale.
            if (answer.type !== "groupSubscribed") return;
            const s = answer.snapshot;
            if (this.groupVersions.get(group) === s.version) {
              this.emit({ type: "groupCount", group, version: s.version, count: s.count, source: "snapshot" });
            }
          },
          reject: (e) => {
            // No longer a member (or the group is gone): the subscription ended, as a push would say.
            // A lost connection is no answer: the next welcome tries again.
            if (e instanceof ServerError) this.applyGroup({ type: "groupEnded", group });
          },
        });
      }
    }
    if (conn.helloForeground !== this.settings.foreground) {
      // The app changed state while the hello was on its way.
      this.sendInternal(conn, { type: "setForeground", foreground: this.settings.foreground });
    }
    if (conn.isEnded) {
      // It ended between the welcome and now: handle that like any loss.
      this.connectionEnded(conn, conn.endError ?? new LostError("connection lost"));
      return;
    }
    const queued = this.queue;
    this.queue = [];
    for (const p of queued) if (!p.done) this.send(conn, p);
  }

  /** @internal The current connection ended without the application closing it. */
  connectionEnded(conn: Connection, error: GreendotError): void {
    if (conn !== this.conn) return;
    this.conn = null;
    this.failAll(conn, error);
    const final = error instanceof RejectedError && !this.mayReconnect(error.closeCode);
    const policy = this.settings.reconnect;
    if (final || policy === null) {
      this.finish(error instanceof RejectedError ? error.closeCode : null, reasonOf(error));
      return;
    }
    this.emit({ type: "disconnected", reason: error.message });
    void this.reconnect(policy, error instanceof RejectedError ? error.retryAfterMs : null);
  }

  private sleep(ms: number): Promise<void> {
    return new Promise<void>((resolve) => {
      const timer = setTimeout(() => {
        this.cancelWait = null;
        resolve();
      }, ms);
      this.cancelWait = () => {
        clearTimeout(timer);
        this.cancelWait = null;
        resolve();
      };
    });
  }

  /** An expired token is no end when the application gives new ones. */
  private mayReconnect(code: number | null): boolean {
    if (code === CloseCode.TokenExpired) return this.settings.refreshToken !== null;
    return code !== null && mayReconnect(code);
  }

  /** Before a reconnect: a new token if the current one is due (a failure keeps it: the server will say). */
  private async freshToken(): Promise<void> {
    const fetch = this.settings.refreshToken;
    if (fetch === null) return;
    const delay = refreshDelay(this.settings.token, this.settings.refreshAheadMs);
    if (delay !== null && delay > 0) return;
    try {
      this.settings.token = await fetch();
    } catch {
      // Kept: the hello's refusal says what is wrong.
    }
  }

  /** Tries again and again, resuming the session, until a welcome or a final refusal. */
  private async reconnect(policy: Required<ReconnectPolicy>, hint: number | null): Promise<void> {
    const started = Date.now();
    const fresh = () => new Backoff({ initialMs: policy.initialBackoffMs, maxMs: policy.maxBackoffMs }, this.settings.random);
    let backoff = fresh();
    this.restartBackoff = false;
    for (;;) {
      if (this.restartBackoff) {
        this.restartBackoff = false;
        backoff = fresh();
      }
      await this.sleep(backoff.next(hint));
      hint = null;
      if (this.finished) return;
      await this.freshToken();
      if (this.finished) return;
      try {
        const [conn, welcome] = await this.establish(this.sessionId);
        if (this.finished) {
          conn.shut(CloseCode.Normal, "closed by the application");
          return;
        }
        this.take(conn, welcome, false);
        return;
      } catch (e) {
        if (this.finished) return;
        if (e instanceof RejectedError && !this.mayReconnect(e.closeCode)) {
          this.finish(e.closeCode, reasonOf(e));
          return;
        }
        hint = e instanceof RejectedError ? e.retryAfterMs : null;
      }
      if (policy.giveUpAfterMs !== null && Date.now() - started >= policy.giveUpAfterMs) {
        this.finish(null, "gave up reconnecting");
        return;
      }
    }
  }
}

/** The server's words for a rejection (its error frame or close reason), else the error's message. */
function reasonOf(error: Error): string {
  return error instanceof RejectedError ? error.error.message : error.message;
}

function expect<T extends Answer["type"]>(answer: Answer, type: T): Extract<Answer, { type: T }> {
  if (answer.type !== type) throw new ProtocolError(`unexpected answer ${answer.type} (wanted ${type})`);
  return answer as Extract<Answer, { type: T }>;
}
