// Encoders and decoders of every frame of docs/protocol.md, both directions
// (a client needs half of them; tests and fake servers the other half).
// Field order is the wire order: keep it as in transport/proto/src/frames.rs.

import { DecodeError, Reader, Writer } from "./postcard.js";
import {
  type Answer,
  GROUP_ROLES,
  type GroupCursor,
  type GroupEntry,
  type GroupPage,
  type GroupRole,
  type GroupSnapshot,
  type Hello,
  KINDS,
  type Kind,
  type Presence,
  type Push,
  type QueryResult,
  type Refused,
  REQUEST_TYPES,
  type Request,
  type RequestFrame,
  type Result,
  type RouteEntry,
  type ServerFrame,
  type Snapshot,
  STATUSES,
  type Status,
  TIERS,
  type Tier,
  type Welcome,
  type WireError,
} from "./types.js";

function index<T extends string>(names: readonly T[], name: T, what: string): number {
  const i = names.indexOf(name);
  if (i < 0) throw new RangeError(`unknown ${what} ${String(name)}`);
  return i;
}

function named<T>(names: readonly T[], i: number, what: string): T {
  const name = names[i];
  if (name === undefined) throw new DecodeError(`unknown ${what} variant ${i}`);
  return name;
}

// ----- shared types ---------------------------------------------------------

const writeTier = (w: Writer, tier: Tier) => w.variant(index(TIERS, tier, "tier"));
const readTier = (r: Reader): Tier => named(TIERS, r.variant(), "Tier");
const writeStatus = (w: Writer, s: Status) => w.variant(index(STATUSES, s, "status"));
const readStatus = (r: Reader): Status => named(STATUSES, r.variant(), "Status");
const writeKind = (w: Writer, k: Kind) => w.variant(index(KINDS, k, "kind"));
const readKind = (r: Reader): Kind => named(KINDS, r.variant(), "Kind");
const writeString = (w: Writer, s: string) => w.string(s);
const readString = (r: Reader) => r.string();

// (Field order: version, online, status, message, kinds, last_seen, invisible.)
function writePresenceFields(w: Writer, p: Presence): void {
  w.u64(p.version).bool(p.online);
  writeStatus(w, p.status);
  w.option(p.message, writeString).u8(p.kinds);
  w.option(p.lastSeen, (w, v) => w.u64(v)).bool(p.invisible);
}

function readPresence(r: Reader): Presence {
  return {
    version: r.u64(),
    online: r.bool(),
    status: readStatus(r),
    message: r.option(readString),
    kinds: r.u8(),
    lastSeen: r.option((r) => r.u64()),
    invisible: r.bool(),
  };
}

function writeWireError(w: Writer, e: WireError): void {
  w.u16(e.code).string(e.message);
}
function readWireError(r: Reader): WireError {
  return { code: r.u16(), message: r.string() };
}

function writeResult<T>(w: Writer, result: Result<T, WireError>, ok: (w: Writer, v: T) => void): void {
  if (result.ok) {
    w.variant(0);
    ok(w, result.value);
  } else {
    w.variant(1);
    writeWireError(w, result.error);
  }
}
function readResult<T>(r: Reader, ok: (r: Reader) => T): Result<T, WireError> {
  const v = r.variant();
  if (v === 0) return { ok: true, value: ok(r) };
  if (v === 1) return { ok: false, error: readWireError(r) };
  throw new DecodeError(`unknown Result variant ${v}`);
}

const writeGroupRole = (w: Writer, role: GroupRole) => w.variant(index(GROUP_ROLES, role, "group role"));
const readGroupRole = (r: Reader): GroupRole => named(GROUP_ROLES, r.variant(), "GroupRole");

function writeGroupCursor(w: Writer, c: GroupCursor): void {
  w.bool(c.online).u64(c.after);
}
function readGroupCursor(r: Reader): GroupCursor {
  return { online: r.bool(), after: r.u64() };
}

function writeGroupSnapshot(w: Writer, s: GroupSnapshot): void {
  w.u64(s.group);
  writeGroupRole(w, s.role);
  w.u64(s.version).u32(s.count).u32(s.members);
}
function readGroupSnapshot(r: Reader): GroupSnapshot {
  return { group: r.u64(), role: readGroupRole(r), version: r.u64(), count: r.u32(), members: r.u32() };
}

function writeGroupEntry(w: Writer, e: GroupEntry): void {
  w.string(e.user);
  writePresenceFields(w, e.presence);
}
const readGroupEntry = (r: Reader): GroupEntry => ({ user: r.string(), presence: readPresence(r) });

function writeGroupPage(w: Writer, p: GroupPage): void {
  w.u64(p.group).u64(p.version).u32(p.count);
  w.seq(p.entries, writeGroupEntry);
  w.option(p.next, writeGroupCursor);
}
function readGroupPage(r: Reader): GroupPage {
  return {
    group: r.u64(),
    version: r.u64(),
    count: r.u32(),
    entries: r.seq(readGroupEntry),
    next: r.option(readGroupCursor),
  };
}

function writeSnapshot(w: Writer, s: Snapshot): void {
  w.string(s.target);
  writeTier(w, s.tier);
  writePresenceFields(w, s.presence);
}
function readSnapshot(r: Reader): Snapshot {
  return { target: r.string(), tier: readTier(r), presence: readPresence(r) };
}

// ----- client → server ------------------------------------------------------

export function encodeHello(hello: Hello): Uint8Array {
  const w = new Writer()
    .u32(hello.version)
    .string(hello.token)
    .option(hello.resume, (w, v) => w.u64(v));
  if (hello.foreground !== undefined) w.bool(hello.foreground);
  return w.finish();
}

export function decodeHello(payload: Uint8Array): Hello {
  const r = new Reader(payload);
  const hello: Hello = { version: r.u32(), token: r.string(), resume: r.option((r) => r.u64()) };
  // The last field may be left out (docs/protocol.md, "Control stream").
  if (r.remaining > 0) hello.foreground = r.bool();
  r.end();
  return hello;
}

function writeRequest(w: Writer, req: Request): void {
  w.variant(index(REQUEST_TYPES, req.type, "request"));
  switch (req.type) {
    case "ping":
    case "logout":
      return;
    case "subscribe":
      w.seq(req.targets, writeString);
      writeTier(w, req.tier);
      return;
    case "unsubscribe":
      w.string(req.target);
      return;
    case "query":
      w.seq(req.targets, writeString);
      return;
    case "setStatus":
      writeStatus(w, req.status);
      w.option(req.message, writeString);
      return;
    case "setInvisible":
      w.bool(req.invisible);
      return;
    case "route":
      w.string(req.user);
      return;
    case "refresh":
      w.string(req.token);
      return;
    case "revoke":
      w.string(req.user);
      w.option(req.device, writeString);
      w.u64(req.before);
      return;
    case "setForeground":
      w.bool(req.foreground);
      return;
    case "setGroup":
      w.u64(req.group).seq(req.members, writeString).seq(req.admins, writeString);
      return;
    case "removeGroup":
    case "groupSubscribe":
    case "groupUnsubscribe":
      w.u64(req.group);
      return;
    case "groupPage":
    case "groupWatchPage":
      w.u64(req.group).option(req.after, writeGroupCursor).u32(req.limit);
      return;
    case "groupRenewWatch":
    case "groupUnwatchPage":
      w.u64(req.group).option(req.after, writeGroupCursor);
      return;
    case "changeGroup":
      w.u64(req.group).seq(req.add, writeString).seq(req.remove, writeString);
      w.seq(req.addAdmins, writeString).seq(req.removeAdmins, writeString);
      w.option(req.expectVersion, (w, v) => w.u64(v));
      return;
  }
}

function readRequest(r: Reader): Request {
  const type = named(REQUEST_TYPES, r.variant(), "Request");
  switch (type) {
    case "ping":
    case "logout":
      return { type };
    case "subscribe":
      return { type, targets: r.seq(readString), tier: readTier(r) };
    case "unsubscribe":
      return { type, target: r.string() };
    case "query":
      return { type, targets: r.seq(readString) };
    case "setStatus":
      return { type, status: readStatus(r), message: r.option(readString) };
    case "setInvisible":
      return { type, invisible: r.bool() };
    case "route":
      return { type, user: r.string() };
    case "refresh":
      return { type, token: r.string() };
    case "revoke":
      return { type, user: r.string(), device: r.option(readString), before: r.u64() };
    case "setForeground":
      return { type, foreground: r.bool() };
    case "setGroup":
      return { type, group: r.u64(), members: r.seq(readString), admins: r.seq(readString) };
    case "removeGroup":
    case "groupSubscribe":
    case "groupUnsubscribe":
      return { type, group: r.u64() };
    case "groupPage":
    case "groupWatchPage":
      return { type, group: r.u64(), after: r.option(readGroupCursor), limit: r.u32() };
    case "groupRenewWatch":
    case "groupUnwatchPage":
      return { type, group: r.u64(), after: r.option(readGroupCursor) };
    case "changeGroup":
      return {
        type,
        group: r.u64(),
        add: r.seq(readString),
        remove: r.seq(readString),
        addAdmins: r.seq(readString),
        removeAdmins: r.seq(readString),
        expectVersion: r.option((r) => r.u64()),
      };
  }
}

export function encodeRequestFrame(frame: RequestFrame): Uint8Array {
  const w = new Writer().u64(frame.id);
  writeRequest(w, frame.request);
  return w.finish();
}

export function decodeRequestFrame(payload: Uint8Array): RequestFrame {
  const r = new Reader(payload);
  const frame = { id: r.u64(), request: readRequest(r) };
  r.end();
  return frame;
}

// ----- server → client: control stream ---------------------------------------

function writeAnswer(w: Writer, a: Answer): void {
  switch (a.type) {
    case "done":
      w.variant(0);
      return;
    case "subscribed":
      w.variant(1).seq(a.snapshots, writeSnapshot);
      w.seq(a.refused, (w, x: Refused) => {
        w.string(x.target);
        writeWireError(w, x.error);
      });
      return;
    case "presences":
      w.variant(2).seq(a.results, (w, x: QueryResult) => {
        w.string(x.target);
        writeResult(w, x.result, writePresenceFields);
      });
      return;
    case "route":
      w.variant(3).seq(a.entries, (w, x: RouteEntry) => {
        w.string(x.device);
        writeKind(w, x.kind);
        w.u64(x.session);
      });
      return;
    case "refreshed":
      w.variant(4).u64(a.expires);
      w.seq(a.ended, writeString);
      return;
    case "revoked":
      w.variant(5).u32(a.closed);
      return;
    case "groupSet":
      w.variant(6).u64(a.version);
      return;
    case "groupSubscribed":
      writeGroupSnapshot(w.variant(7), a.snapshot);
      return;
    case "groupPage":
      writeGroupPage(w.variant(8), a.page);
      return;
  }
}

function readAnswer(r: Reader): Answer {
  const v = r.variant();
  switch (v) {
    case 0:
      return { type: "done" };
    case 1:
      return {
        type: "subscribed",
        snapshots: r.seq(readSnapshot),
        refused: r.seq((r) => ({ target: r.string(), error: readWireError(r) })),
      };
    case 2:
      return {
        type: "presences",
        results: r.seq((r) => ({ target: r.string(), result: readResult(r, readPresence) })),
      };
    case 3:
      return {
        type: "route",
        entries: r.seq((r) => ({ device: r.string(), kind: readKind(r), session: r.u64() })),
      };
    case 4:
      return { type: "refreshed", expires: r.u64(), ended: r.seq(readString) };
    case 5:
      return { type: "revoked", closed: r.u32() };
    case 6:
      return { type: "groupSet", version: r.u64() };
    case 7:
      return { type: "groupSubscribed", snapshot: readGroupSnapshot(r) };
    case 8:
      return { type: "groupPage", page: readGroupPage(r) };
    default:
      throw new DecodeError(`unknown Answer variant ${v}`);
  }
}

export function encodeServerFrame(frame: ServerFrame): Uint8Array {
  const w = new Writer();
  switch (frame.type) {
    case "welcome": {
      const x: Welcome = frame.welcome;
      w.variant(0).u32(x.version).u64(x.session).bool(x.resumed).string(x.user).string(x.device);
      w.seq(x.snapshots, writeSnapshot).u32(x.maxFrame);
      break;
    }
    case "reply":
      w.variant(1).u64(frame.id);
      writeResult(w, frame.result, writeAnswer);
      break;
    case "error":
      w.variant(2);
      writeWireError(w, frame.error);
      break;
  }
  return w.finish();
}

export function decodeServerFrame(payload: Uint8Array): ServerFrame {
  const r = new Reader(payload);
  let frame: ServerFrame;
  const v = r.variant();
  switch (v) {
    case 0:
      frame = {
        type: "welcome",
        welcome: {
          version: r.u32(),
          session: r.u64(),
          resumed: r.bool(),
          user: r.string(),
          device: r.string(),
          snapshots: r.seq(readSnapshot),
          maxFrame: r.u32(),
        },
      };
      break;
    case 1:
      frame = { type: "reply", id: r.u64(), result: readResult(r, readAnswer) };
      break;
    case 2:
      frame = { type: "error", error: readWireError(r) };
      break;
    default:
      throw new DecodeError(`unknown ServerFrame variant ${v}`);
  }
  r.end();
  return frame;
}

// ----- server → client: push streams ------------------------------------------

export function encodePush(push: Push): Uint8Array {
  const w = new Writer();
  switch (push.type) {
    case "stream":
      writeTier(w.variant(0), push.tier);
      break;
    case "update":
      w.variant(1).string(push.target);
      writePresenceFields(w, push.presence);
      break;
    case "groupCount":
      w.variant(2).u64(push.group).u64(push.version).u32(push.count);
      break;
    case "groupMember":
      w.variant(3).u64(push.group).u64(push.version).string(push.member).bool(push.online).u32(push.count);
      break;
    case "groupEnded":
      w.variant(4).u64(push.group);
      break;
    case "groupPageDelta":
      w.variant(5).u64(push.group).seq(push.entries, writeGroupEntry);
      break;
  }
  return w.finish();
}

export function decodePush(payload: Uint8Array): Push {
  const r = new Reader(payload);
  let push: Push;
  const v = r.variant();
  switch (v) {
    case 0:
      push = { type: "stream", tier: readTier(r) };
      break;
    case 1:
      push = { type: "update", target: r.string(), presence: readPresence(r) };
      break;
    case 2:
      push = { type: "groupCount", group: r.u64(), version: r.u64(), count: r.u32() };
      break;
    case 3:
      push = { type: "groupMember", group: r.u64(), version: r.u64(), member: r.string(), online: r.bool(), count: r.u32() };
      break;
    case 4:
      push = { type: "groupEnded", group: r.u64() };
      break;
    case 5:
      push = { type: "groupPageDelta", group: r.u64(), entries: r.seq(readGroupEntry) };
      break;
    default:
      throw new DecodeError(`unknown Push variant ${v}`);
  }
  r.end();
  return push;
}
