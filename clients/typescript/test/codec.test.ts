// The codec against every byte example of docs/protocol.md: the two of
// "postcard in brief", every row of "Every frame, byte for byte" and every
// message of "A WebSocket session, message by message", every row of the
// byte table of "Groups". They are parsed out
// of the document, so an example added there without a value here fails.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import {
  DecodeError,
  decodeHello,
  decodePush,
  decodeRequestFrame,
  decodeServerFrame,
  encodeHello,
  encodePush,
  encodeRequestFrame,
  encodeServerFrame,
  FrameError,
  FrameReader,
  type Hello,
  prefixFrame,
  type Presence,
  type Push,
  Reader,
  type RequestFrame,
  type ServerFrame,
  type WireError,
  Writer,
} from "../src/index.js";

const doc = readFileSync(new URL("../../../../docs/protocol.md", import.meta.url), "utf8");

function hex(s: string): Uint8Array {
  const digits = s.replace(/[|\s]/g, "");
  assert.match(digits, /^([0-9a-f]{2})*$/, `not hex: ${s}`);
  return Uint8Array.from(digits.match(/../g) ?? [], (b) => parseInt(b, 16));
}

function section(title: string): string {
  const start = doc.indexOf(title);
  assert.ok(start >= 0, `no section ${title}`);
  const rest = doc.slice(start + title.length);
  const end = rest.search(/\n#{2,3} /);
  return end < 0 ? rest : rest.slice(0, end);
}

const P: Presence = {
  version: 7n,
  online: true,
  status: "away",
  message: "lunch",
  kinds: 5,
  lastSeen: null,
  invisible: false,
};
const Q: Presence = {
  version: 300n,
  online: false,
  status: "available",
  message: null,
  kinds: 0,
  lastSeen: 1_700_000_000_000n,
  invisible: false,
};

type Example =
  | { kind: "hello"; value: Hello }
  | { kind: "request"; value: RequestFrame }
  | { kind: "server"; value: ServerFrame }
  | { kind: "push"; value: Push }
  | { kind: "wireError"; value: WireError };

function check(name: string, bytes: Uint8Array, ex: Example): void {
  switch (ex.kind) {
    case "hello":
      assert.deepEqual(encodeHello(ex.value), bytes, `${name}: encode`);
      assert.deepEqual(decodeHello(bytes), ex.value, `${name}: decode`);
      break;
    case "request":
      assert.deepEqual(encodeRequestFrame(ex.value), bytes, `${name}: encode`);
      assert.deepEqual(decodeRequestFrame(bytes), ex.value, `${name}: decode`);
      break;
    case "server":
      assert.deepEqual(encodeServerFrame(ex.value), bytes, `${name}: encode`);
      assert.deepEqual(decodeServerFrame(bytes), ex.value, `${name}: decode`);
      break;
    case "push":
      assert.deepEqual(encodePush(ex.value), bytes, `${name}: encode`);
      assert.deepEqual(decodePush(bytes), ex.value, `${name}: decode`);
      break;
    case "wireError": {
      // A WireError alone: the payload of an Error frame after its variant byte.
      const frame = encodeServerFrame({ type: "error", error: ex.value });
      assert.deepEqual(frame.subarray(1), bytes, `${name}: encode`);
      assert.deepEqual(decodeServerFrame(Uint8Array.of(2, ...bytes)), { type: "error", error: ex.value }, `${name}: decode`);
      break;
    }
  }
}

test('"postcard in brief": the two framed examples', () => {
  const found = [...section("### postcard in brief").matchAll(/\sis(?: the frame)?\s+`([0-9a-f |]+)`/g)].map((m) => m[1]!);
  const expected: Example[] = [
    { kind: "hello", value: { version: 1, token: "ab", resume: 5n } },
    {
      kind: "request",
      value: { id: 300n, request: { type: "subscribe", targets: ["bob"], tier: "batched" } },
    },
  ];
  assert.equal(found.length, expected.length, "examples in the document");
  found.forEach((text, i) => {
    const [prefix, payload] = text.split("|").map(hex) as [Uint8Array, Uint8Array];
    const ex = expected[i]!;
    check(`example ${i}`, payload, ex);
    // The stream form: the 4-byte big-endian length, then the payload.
    const framed = prefixFrame(payload);
    assert.deepEqual(framed.subarray(0, 4), prefix);
    const reader = new FrameReader(65_536);
    reader.push(framed);
    assert.deepEqual(reader.next(), payload);
  });
});

const table: Record<string, Example> = {
  hello: { kind: "hello", value: { version: 1, token: "ab", resume: 5n } },
  hello_none: { kind: "hello", value: { version: 1, token: "t", resume: null } },
  hello_big_resume: { kind: "hello", value: { version: 1, token: "", resume: (1n << 64n) - 1n } },
  hello_background: { kind: "hello", value: { version: 1, token: "t", resume: null, foreground: false } },
  req_sub: { kind: "request", value: { id: 300n, request: { type: "subscribe", targets: ["bob"], tier: "batched" } } },
  req_ping: { kind: "request", value: { id: 1n, request: { type: "ping" } } },
  req_unsub: { kind: "request", value: { id: 2n, request: { type: "unsubscribe", target: "bob" } } },
  req_query: { kind: "request", value: { id: 3n, request: { type: "query", targets: ["a", "b"] } } },
  req_status: { kind: "request", value: { id: 4n, request: { type: "setStatus", status: "doNotDisturb", message: "é" } } },
  req_invisible: { kind: "request", value: { id: 5n, request: { type: "setInvisible", invisible: true } } },
  req_route: { kind: "request", value: { id: 6n, request: { type: "route", user: "al" } } },
  req_logout: { kind: "request", value: { id: 7n, request: { type: "logout" } } },
  req_background: { kind: "request", value: { id: 8n, request: { type: "setForeground", foreground: false } } },
  welcome: {
    kind: "server",
    value: {
      type: "welcome",
      welcome: {
        version: 1,
        session: 1234567890123n,
        resumed: true,
        user: "al",
        device: "ph",
        snapshots: [{ target: "bob", tier: "realtime", presence: P }],
        maxFrame: 65536,
      },
    },
  },
  reply_done: { kind: "server", value: { type: "reply", id: 1n, result: { ok: true, value: { type: "done" } } } },
  reply_err: { kind: "server", value: { type: "reply", id: 2n, result: { ok: false, error: { code: 9, message: "no" } } } },
  reply_sub: {
    kind: "server",
    value: {
      type: "reply",
      id: 3n,
      result: {
        ok: true,
        value: {
          type: "subscribed",
          snapshots: [{ target: "bob", tier: "batched", presence: Q }],
          refused: [{ target: "eve", error: { code: 8, message: "" } }],
        },
      },
    },
  },
  reply_presences: {
    kind: "server",
    value: {
      type: "reply",
      id: 4n,
      result: {
        ok: true,
        value: {
          type: "presences",
          results: [
            { target: "bob", result: { ok: true, value: P } },
            { target: "x", result: { ok: false, error: { code: 999, message: "?" } } },
          ],
        },
      },
    },
  },
  reply_route: {
    kind: "server",
    value: {
      type: "reply",
      id: 5n,
      result: { ok: true, value: { type: "route", entries: [{ device: "ph", kind: "web", session: 9n }] } },
    },
  },
  error: { kind: "server", value: { type: "error", error: { code: 4, message: "bad" } } },
  push_stream_rt: { kind: "push", value: { type: "stream", tier: "realtime" } },
  push_stream_b: { kind: "push", value: { type: "stream", tier: "batched" } },
  push_update: { kind: "push", value: { type: "update", target: "bob", presence: P } },
  push_update_off: { kind: "push", value: { type: "update", target: "bob", presence: { ...Q, invisible: true } } },
};

test('"Every frame, byte for byte": every row decodes and re-encodes', () => {
  const rows = [...section("### Every frame, byte for byte").matchAll(/^\| `(\w+)` \| .* \| `([0-9a-f ]+)` \|$/gm)];
  const names = rows.map((m) => m[1]!);
  assert.deepEqual([...names].sort(), Object.keys(table).sort(), "rows of the table and examples here");
  for (const [, name, bytes] of rows) check(name!, hex(bytes!), table[name!]!);
});

// The rows of "Groups", keyed by the frame as the document writes it.
const groupTable: Record<string, Example> = {
  'RequestFrame { id: 5, request: SetGroup { group: 42, members: ["ann", "bob"], admins: ["ann"] } }': {
    kind: "request",
    value: { id: 5n, request: { type: "setGroup", group: 42n, members: ["ann", "bob"], admins: ["ann"] } },
  },
  "RequestFrame { id: 4, request: GroupSubscribe { group: 42 } }": {
    kind: "request",
    value: { id: 4n, request: { type: "groupSubscribe", group: 42n } },
  },
  "Reply { id: 4, result: Ok(GroupSubscribed(GroupSnapshot { group: 42, role: Member, version: 7, count: 3, members: 10 })) }": {
    kind: "server",
    value: {
      type: "reply",
      id: 4n,
      result: { ok: true, value: { type: "groupSubscribed", snapshot: { group: 42n, role: "member", version: 7n, count: 3, members: 10 } } },
    },
  },
  "GroupCount { group: 42, version: 8, count: 4 }": { kind: "push", value: { type: "groupCount", group: 42n, version: 8n, count: 4 } },
  'WireError { code: 29, message: "" }': { kind: "wireError", value: { code: 29, message: "" } },
  'WireError { code: 36, message: "" }': { kind: "wireError", value: { code: 36, message: "" } },
  'WireError { code: 37, message: "" }': { kind: "wireError", value: { code: 37, message: "" } },
  "RequestFrame { id: 6, request: RemoveGroup { group: 42 } }": { kind: "request", value: { id: 6n, request: { type: "removeGroup", group: 42n } } },
  "RequestFrame { id: 7, request: GroupUnsubscribe { group: 42 } }": {
    kind: "request",
    value: { id: 7n, request: { type: "groupUnsubscribe", group: 42n } },
  },
  "RequestFrame { id: 8, request: GroupPage { group: 300, after: None, limit: 200 } }": {
    kind: "request",
    value: { id: 8n, request: { type: "groupPage", group: 300n, after: null, limit: 200 } },
  },
  "RequestFrame { id: 9, request: GroupPage { group: 42, after: Some(GroupCursor { online: true, after: 300 }), limit: 50 } }": {
    kind: "request",
    value: { id: 9n, request: { type: "groupPage", group: 42n, after: { online: true, after: 300n }, limit: 50 } },
  },
  "Reply { id: 5, result: Ok(GroupSet { version: 1 }) }": {
    kind: "server",
    value: { type: "reply", id: 5n, result: { ok: true, value: { type: "groupSet", version: 1n } } },
  },
  "Reply { id: 4, result: Ok(GroupSubscribed(GroupSnapshot { group: 42, role: Admin, version: 7, count: 3, members: 10 })) }": {
    kind: "server",
    value: {
      type: "reply",
      id: 4n,
      result: { ok: true, value: { type: "groupSubscribed", snapshot: { group: 42n, role: "admin", version: 7n, count: 3, members: 10 } } },
    },
  },
  'Reply { id: 9, result: Ok(GroupPage(GroupPage { group: 42, version: 9, count: 1, entries: [GroupEntry { user: "ann", presence: Presence { version: 3, online: true, status: Available, message: None, kinds: 4, last_seen: None, invisible: false } }], next: Some(GroupCursor { online: true, after: 3 }) })) }':
    {
      kind: "server",
      value: {
        type: "reply",
        id: 9n,
        result: {
          ok: true,
          value: {
            type: "groupPage",
            page: {
              group: 42n,
              version: 9n,
              count: 1,
              entries: [
                {
                  user: "ann",
                  presence: { version: 3n, online: true, status: "available", message: null, kinds: 4, lastSeen: null, invisible: false },
                },
              ],
              next: { online: true, after: 3n },
            },
          },
        },
      },
    },
  'GroupMember { group: 42, version: 9, member: "bob", online: false, count: 3 }': {
    kind: "push",
    value: { type: "groupMember", group: 42n, version: 9n, member: "bob", online: false, count: 3 },
  },
  "GroupEnded { group: 18446744073709551615 }": { kind: "push", value: { type: "groupEnded", group: (1n << 64n) - 1n } },
  'RequestFrame { id: 10, request: ChangeGroup { group: 42, add: ["cy"], remove: ["bob"], add_admins: [], remove_admins: ["ann"], expect_version: Some(3) } }': {
    kind: "request",
    value: {
      id: 10n,
      request: { type: "changeGroup", group: 42n, add: ["cy"], remove: ["bob"], addAdmins: [], removeAdmins: ["ann"], expectVersion: 3n },
    },
  },
  'RequestFrame { id: 11, request: ChangeGroup { group: 42, add: [], remove: [], add_admins: ["dee"], remove_admins: [], expect_version: None } }': {
    kind: "request",
    value: {
      id: 11n,
      request: { type: "changeGroup", group: 42n, add: [], remove: [], addAdmins: ["dee"], removeAdmins: [], expectVersion: null },
    },
  },
  'WireError { code: 38, message: "" }': { kind: "wireError", value: { code: 38, message: "" } },
  "RequestFrame { id: 6, request: GroupWatchPage { group: 42, after: None, limit: 50 } }": {
    kind: "request",
    value: { id: 6n, request: { type: "groupWatchPage", group: 42n, after: null, limit: 50 } },
  },
  "RequestFrame { id: 7, request: GroupRenewWatch { group: 42, after: Some(GroupCursor { online: false, after: 7 }) } }": {
    kind: "request",
    value: { id: 7n, request: { type: "groupRenewWatch", group: 42n, after: { online: false, after: 7n } } },
  },
  "RequestFrame { id: 8, request: GroupUnwatchPage { group: 42, after: Some(GroupCursor { online: false, after: 7 }) } }": {
    kind: "request",
    value: { id: 8n, request: { type: "groupUnwatchPage", group: 42n, after: { online: false, after: 7n } } },
  },
  'GroupPageDelta { group: 42, entries: [GroupEntry { user: "bob", presence: Presence { version: 9, online: true, status: Available, message: None, kinds: 1, last_seen: None, invisible: false } }] }': {
    kind: "push",
    value: {
      type: "groupPageDelta",
      group: 42n,
      entries: [
        {
          user: "bob",
          presence: { version: 9n, online: true, status: "available", message: null, kinds: 1, lastSeen: null, invisible: false },
        },
      ],
    },
  },
};

test('"Groups": every row of the byte table decodes and re-encodes', () => {
  const rows = [...section("### Groups").matchAll(/^\| `([^`]+)`[^|]* \| `([0-9a-f ]+)` \|$/gm)];
  const frames = rows.map((m) => m[1]!);
  assert.deepEqual([...frames].sort(), Object.keys(groupTable).sort(), "rows of the table and examples here");
  for (const [, frame, bytes] of rows) check(frame!, hex(bytes!), groupTable[frame!]!);
});

test('"A WebSocket session, message by message": every message', () => {
  const lines = [...section("### A WebSocket session, message by message").matchAll(/^(client|server): ([0-9a-f |]+)$/gm)];
  const session: Example[] = [
    { kind: "hello", value: { version: 1, token: "ab", resume: null } },
    {
      kind: "server",
      value: {
        type: "welcome",
        welcome: { version: 1, session: 7n, resumed: false, user: "al", device: "ph", snapshots: [], maxFrame: 65536 },
      },
    },
    { kind: "push", value: { type: "stream", tier: "batched" } },
    { kind: "push", value: { type: "stream", tier: "realtime" } },
    { kind: "request", value: { id: 1n, request: { type: "subscribe", targets: ["bob"], tier: "realtime" } } },
    {
      kind: "server",
      value: {
        type: "reply",
        id: 1n,
        result: { ok: true, value: { type: "subscribed", snapshots: [{ target: "bob", tier: "realtime", presence: P }], refused: [] } },
      },
    },
    {
      kind: "push",
      value: {
        type: "update",
        target: "bob",
        presence: { version: 8n, online: false, status: "available", message: null, kinds: 0, lastSeen: 1_700_000_000_000n, invisible: false },
      },
    },
    { kind: "hello", value: { version: 1, token: "ab", resume: 7n } },
  ];
  const streams = [null, 0, 1, 2, null, 0, 2, null];
  assert.equal(lines.length, session.length, "messages in the document");
  lines.forEach(([, side, text], i) => {
    const ex = session[i]!;
    if (side === "client") {
      assert.equal(streams[i], null);
      assert.ok(ex.kind === "hello" || ex.kind === "request", `message ${i} is a client frame`);
      assert.ok(!text!.includes("|"), "client messages carry no stream byte");
      check(`message ${i}`, hex(text!), ex);
    } else {
      const [stream, payload] = text!.split("|").map(hex) as [Uint8Array, Uint8Array];
      assert.deepEqual([...stream], [streams[i]], `message ${i}: stream byte`);
      assert.equal(ex.kind, stream[0] === 0 ? "server" : "push", `message ${i}: stream 0 is control, 1 and 2 push`);
      check(`message ${i}`, payload, ex);
    }
  });
});

test("decoding is as strict as postcard", () => {
  const bad = (bytes: number[], decode: (b: Uint8Array) => unknown, what: RegExp) =>
    assert.throws(() => decode(Uint8Array.from(bytes)), (e: unknown) => e instanceof DecodeError && what.test(e.message));
  // Trailing bytes.
  bad([0x01, 0x01, 0x74, 0x00, 0x00, 0x00], decodeHello, /trailing/);
  bad([0x01, 0x01, 0x74, 0x00, 0x02], decodeHello, /bool/);
  // Truncated.
  bad([0x01, 0x05, 0x61], decodeHello, /length|end/);
  bad([0x01, 0x01, 0x74], decodeHello, /end/);
  // Option tag and bool other than 0/1.
  bad([0x01, 0x01, 0x74, 0x02], decodeHello, /option/);
  bad([0x05, 0x05, 0x02], decodeRequestFrame, /bool/);
  // Unknown variants.
  bad([0x01, 0x7f], decodeRequestFrame, /Request variant 127/);
  bad([0x7f, 0x2a], decodePush, /Push variant 127/);
  bad([0x01, 0x04, 0x00, 0x7f], decodeServerFrame, /Answer variant 127/);
  bad([0x01, 0x04, 0x00, 0x07, 0x2a, 0x02, 0x07, 0x03, 0x0a], decodeServerFrame, /GroupRole variant 2/);
  bad([0x03, 0x00], decodeServerFrame, /ServerFrame variant 3/);
  bad([0x00, 0x02], decodePush, /Tier variant 2/);
  bad([0x01, 0x01, 0x02, 0x00, 0x00], decodeServerFrame, /Result variant 2/);
  // A u32 varint of 6 bytes, or 5 with bits past 32; a u16 past 16 bits.
  bad([0x80, 0x80, 0x80, 0x80, 0x80, 0x00], decodeHello, /longer than u32/);
  bad([0xff, 0xff, 0xff, 0xff, 0x10, 0x00, 0x00], decodeHello, /overflows u32/);
  bad([0x02, 0xff, 0xff, 0x04, 0x00], decodeServerFrame, /overflows u16/);
  // A u64 of 10 bytes whose last carries more than the 64th bit.
  bad([0x01, 0x00, 0x01, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02], decodeHello, /overflows u64/);
  // A string that is not UTF-8; a length or count past the end (no allocation for it).
  bad([0x01, 0x01, 0xff, 0x00], decodeHello, /UTF-8/);
  bad([0x01, 0xff, 0xff, 0xff, 0xff, 0x0f], decodeHello, /exceeds/);
  bad([0x01, 0x03, 0xff, 0xff, 0xff, 0xff, 0x0f], decodeRequestFrame, /exceeds/);
  // Non-canonical varints are accepted, as postcard does.
  assert.equal(decodeHello(Uint8Array.from([0x81, 0x00, 0x00, 0x00])).version, 1);
  // The writer refuses values its type cannot hold.
  assert.throws(() => new Writer().u32(2 ** 32), RangeError);
  assert.throws(() => new Writer().u64(-1n), RangeError);
  assert.throws(() => new Writer().u64(1n << 64n), RangeError);
  assert.throws(() => new Writer().u8(256), RangeError);
  assert.equal(new Reader(new Writer().u64((1n << 64n) - 1n).finish()).u64(), (1n << 64n) - 1n);
});

test("the frame reader: caps from the prefix alone, empty frames, any split", () => {
  // Over the cap: refused on the 4 bytes of the prefix, nothing more read.
  const reader = new FrameReader(16);
  reader.push(Uint8Array.from([0, 0, 0, 17]));
  assert.throws(() => reader.next(), (e: unknown) => e instanceof FrameError && e.kind === "tooLarge");
  // At the cap: fine.
  const atCap = new FrameReader(16);
  atCap.push(prefixFrame(new Uint8Array(16).fill(7)));
  assert.deepEqual(atCap.next(), new Uint8Array(16).fill(7));
  // A length of 0 is a bad frame.
  const empty = new FrameReader(16);
  empty.push(Uint8Array.from([0, 0, 0, 0]));
  assert.throws(() => empty.next(), (e: unknown) => e instanceof FrameError && e.kind === "empty");
  // Frames split at every byte come out whole and in order; the end of the stream inside one is an error.
  const frames = [encodeHello({ version: 1, token: "x".repeat(300), resume: 9n }), encodePush({ type: "stream", tier: "batched" })];
  const wire = Uint8Array.from([...prefixFrame(frames[0]!), ...prefixFrame(frames[1]!), 0, 0]);
  const split = new FrameReader(65_536);
  const out: Uint8Array[] = [];
  for (const byte of wire) {
    split.push(Uint8Array.of(byte));
    for (let f = split.next(); f !== null; f = split.next()) out.push(f);
  }
  assert.deepEqual(out, frames);
  assert.equal(split.pending, 2);
  assert.throws(() => split.finish(), (e: unknown) => e instanceof FrameError && e.kind === "truncated");
});
