// The frames of protocol version 1 and their shared types, as in docs/protocol.md
// ("Frames", "Shared types"). Every u64 of the wire (ids, sessions, versions,
// last_seen) is a bigint so that no value is rounded; u8/u16/u32 are numbers.

export const PROTOCOL_VERSION = 1;
/** The default cap on a client frame's payload, until the welcome says the server's. */
export const DEFAULT_MAX_FRAME = 65_536;
/** The cap this client puts on a frame from the server (as the Rust client). */
export const MAX_SERVER_FRAME = 16 * 1024 * 1024;

/** Enum variants in declaration order: the index is the postcard variant index. */
export const TIERS = ["realtime", "batched"] as const;
export type Tier = (typeof TIERS)[number];
export const STATUSES = ["available", "away", "busy", "doNotDisturb"] as const;
export type Status = (typeof STATUSES)[number];
export const KINDS = ["mobile", "desktop", "web", "other"] as const;
export type Kind = (typeof KINDS)[number];

/** `kinds` bit set of `Presence`. */
export const KIND_BITS = { mobile: 1, desktop: 2, web: 4, other: 8 } as const;

export interface Presence {
  /** Per user, only grows: keep the highest seen (see `View`). */
  version: bigint;
  online: boolean;
  status: Status;
  message: string | null;
  /** Bit set of device kinds online: 1 mobile, 2 desktop, 4 web, 8 other. */
  kinds: number;
  /** While offline: Unix milliseconds (server's clock) the user was last heard from. */
  lastSeen: bigint | null;
  /** Only ever true in a user's view of themselves. */
  invisible: boolean;
}

/** `Result<T, E>` of the wire: `Ok` = variant 0, `Err` = variant 1. */
export type Result<T, E> = { ok: true; value: T } | { ok: false; error: E };

export interface WireError {
  /** An `ErrorCode`; codes this client does not know are kept as they are. */
  code: number;
  message: string;
}

export interface Hello {
  version: number;
  token: string;
  resume: bigint | null;
  /** Whether the app is in the foreground; left out, the server reads true. */
  foreground?: boolean;
}

export type Request =
  | { type: "ping" }
  | { type: "subscribe"; targets: string[]; tier: Tier }
  | { type: "unsubscribe"; target: string }
  | { type: "query"; targets: string[] }
  | { type: "setStatus"; status: Status; message: string | null }
  | { type: "setInvisible"; invisible: boolean }
  | { type: "route"; user: string }
  | { type: "logout" }
  | { type: "refresh"; token: string }
  | { type: "revoke"; user: string; device: string | null; before: bigint }
  | { type: "setForeground"; foreground: boolean }
  | { type: "setGroup"; group: bigint; members: string[]; admins: string[] }
  | { type: "removeGroup"; group: bigint }
  | { type: "groupSubscribe"; group: bigint }
  | { type: "groupUnsubscribe"; group: bigint }
  | { type: "groupPage"; group: bigint; after: GroupCursor | null; limit: number }
  | { type: "groupWatchPage"; group: bigint; after: GroupCursor | null; limit: number }
  | { type: "groupRenewWatch"; group: bigint; after: GroupCursor | null }
  | { type: "groupUnwatchPage"; group: bigint; after: GroupCursor | null }
  | {
      type: "changeGroup";
      group: bigint;
      add: string[];
      remove: string[];
      addAdmins: string[];
      removeAdmins: string[];
      expectVersion: bigint | null;
    };

/** Variant order of `Request` on the wire. */
export const REQUEST_TYPES = [
  "ping",
  "subscribe",
  "unsubscribe",
  "query",
  "setStatus",
  "setInvisible",
  "route",
  "logout",
  "refresh",
  "revoke",
  "setForeground",
  "setGroup",
  "removeGroup",
  "groupSubscribe",
  "groupUnsubscribe",
  "groupPage",
  "groupWatchPage",
  "groupRenewWatch",
  "groupUnwatchPage",
  "changeGroup",
] as const satisfies readonly Request["type"][];

/** A change of a group by difference (`Client.changeGroup`); every list may be left out. */
export interface GroupChange {
  add?: string[];
  remove?: string[];
  addAdmins?: string[];
  removeAdmins?: string[];
  /** Change only a group at this membership version (0: one that does not exist). */
  expectVersion?: bigint | number | null;
}

/** What a group subscription gets: the count (member) or each member's change too (admin). */
export const GROUP_ROLES = ["member", "admin"] as const;
export type GroupRole = (typeof GROUP_ROLES)[number];

/** Where a member page starts. Opaque: pass back what `GroupPage.next` gave. */
export interface GroupCursor {
  online: boolean;
  after: bigint;
}

/** The answer to a group subscribe; the member list is read in pages. */
export interface GroupSnapshot {
  group: bigint;
  role: GroupRole;
  /** Per group, only grows: keep the highest seen, drop older pushes. */
  version: bigint;
  /** Members shown online. */
  count: number;
  /** Members, admins included. */
  members: number;
}

/** A member and what everybody is shown of them. */
export interface GroupEntry {
  user: string;
  presence: Presence;
}

/** One page of a group's member list: online members first. */
export interface GroupPage {
  group: bigint;
  /** The group's version when the page was taken. */
  version: bigint;
  /** Members shown online, in all. */
  count: number;
  entries: GroupEntry[];
  /** Where the next page starts; null on the last page. */
  next: GroupCursor | null;
}

export interface RequestFrame {
  id: bigint;
  request: Request;
}

export interface Snapshot {
  target: string;
  /** The tier granted (a realtime request may be downgraded to batched). */
  tier: Tier;
  presence: Presence;
}

export interface Refused {
  target: string;
  error: WireError;
}

export interface QueryResult {
  target: string;
  result: Result<Presence, WireError>;
}

export interface RouteEntry {
  device: string;
  kind: Kind;
  session: bigint;
}

export interface Welcome {
  version: number;
  session: bigint;
  resumed: boolean;
  user: string;
  device: string;
  snapshots: Snapshot[];
  maxFrame: number;
}

export type Answer =
  | { type: "done" }
  | { type: "subscribed"; snapshots: Snapshot[]; refused: Refused[] }
  | { type: "presences"; results: QueryResult[] }
  | { type: "route"; entries: RouteEntry[] }
  | { type: "refreshed"; expires: bigint; ended: string[] }
  | { type: "revoked"; closed: number }
  | { type: "groupSet"; version: bigint }
  | { type: "groupSubscribed"; snapshot: GroupSnapshot }
  | { type: "groupPage"; page: GroupPage };

export type ServerFrame =
  | { type: "welcome"; welcome: Welcome }
  | { type: "reply"; id: bigint; result: Result<Answer, WireError> }
  | { type: "error"; error: WireError };

export type Push =
  | { type: "stream"; tier: Tier }
  | { type: "update"; target: string; presence: Presence }
  | { type: "groupCount"; group: bigint; version: bigint; count: number }
  | { type: "groupMember"; group: bigint; version: bigint; member: string; online: boolean; count: number }
  | { type: "groupEnded"; group: bigint }
  | { type: "groupPageDelta"; group: bigint; entries: GroupEntry[] };

/** `WireError.code` values (docs/protocol.md, "Error codes"). */
export const ErrorCode = {
  BadFrame: 1,
  FrameTooLarge: 2,
  UnsupportedVersion: 3,
  BadToken: 4,
  TokenExpired: 5,
  UnexpectedFrame: 6,
  RateLimited: 7,
  NotAllowed: 8,
  NotSubscribed: 9,
  Stale: 10,
  UnknownSession: 11,
  ServiceOnly: 12,
  TooManyConnections: 13,
  BadRequest: 14,
  Internal: 15,
  ShuttingDown: 16,
  TooManySubscriptions: 20,
  RealtimeFull: 21,
  MessageTooLong: 22,
  TooManyDevices: 23,
  TooManySessions: 24,
  TooManyUsers: 25,
  TooManyTargets: 26,
  TokenRevoked: 27,
  TooManyRevocations: 28,
  NotMember: 29,
  UnknownGroup: 30,
  TooManyGroupMembers: 31,
  TooManyGroupAdmins: 32,
  TooManyGroupSubscriptions: 33,
  TooManyGroups: 34,
  Unsupported: 35,
  TooManyWatchedPages: 36,
  PageRateLimited: 37,
  VersionMismatch: 38,
} as const;

/** Close codes (docs/protocol.md, "Close codes"). */
export const CloseCode = {
  Normal: 0,
  Logout: 1,
  Superseded: 2,
  SessionExpired: 3,
  ProtocolError: 4,
  FrameTooLarge: 5,
  UnsupportedVersion: 6,
  Unauthorized: 7,
  TokenExpired: 8,
  TooManyConnections: 9,
  Shutdown: 10,
  Overloaded: 11,
  HelloTimeout: 12,
  Refused: 13,
  Draining: 14,
  RateLimited: 15,
  StreamStopped: 16,
  Revoked: 17,
} as const;

/**
 * The "reconnect?" column of the close-code table: whether a client
 * reconnects (resuming its session) after the server closed with `code`.
 * Unknown codes do not reconnect (as the Rust client).
 */
export function mayReconnect(code: number): boolean {
  switch (code) {
    case CloseCode.Normal:
    case CloseCode.SessionExpired:
    case CloseCode.ProtocolError:
    case CloseCode.FrameTooLarge:
    case CloseCode.TooManyConnections:
    case CloseCode.Shutdown:
    case CloseCode.Overloaded:
    case CloseCode.HelloTimeout:
    case CloseCode.Draining:
    case CloseCode.RateLimited:
    case CloseCode.StreamStopped:
      return true;
    default:
      return false;
  }
}

/** The name of a close code, or its number for one not in the table. */
export function closeCodeName(code: number): string {
  for (const [name, value] of Object.entries(CloseCode)) if (value === code) return name;
  return String(code);
}

/** The name of an error code, or its number for one not in the table. */
export function errorCodeName(code: number): string {
  for (const [name, value] of Object.entries(ErrorCode)) if (value === code) return name;
  return String(code);
}
