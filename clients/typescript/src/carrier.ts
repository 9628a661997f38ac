// What the client needs of a binding: control frames out, control and push
// frames in, a close with a greendot close code. Each binding (WebTransport,
// WebSocket; docs/protocol.md "Bindings for browsers") implements it, so the
// session logic in client.ts is the same over both.

export type Binding = "webtransport" | "websocket";

export interface CarrierHandlers {
  /** One control-stream frame's payload from the server. */
  control(payload: Uint8Array): void;
  /** One push frame's payload; `stream` tells the push streams apart (its tier is its first frame). */
  push(stream: number, payload: Uint8Array): void;
  /**
   * The connection ended without the client closing it: `code` is the
   * server's greendot close code, or null when there was none (a lost
   * connection, or a protocol error of the server's that the carrier closed on).
   * Called at most once, and never after `Carrier.close`.
   */
  closed(code: number | null, reason: string): void;
}

export interface Carrier {
  readonly binding: Binding;
  /**
   * Whether the client must watch the connection itself: a browser cannot
   * see WebSocket pings, while WebTransport has QUIC's keep-alive and idle
   * timeout.
   */
  readonly needsHeartbeat: boolean;
  /** Sends one control frame (its payload; the carrier adds any framing). */
  send(payload: Uint8Array): void;
  /** Closes with a greendot close code (0 plain disconnect, 1 logout). No `closed` call follows. */
  close(code: number, reason: string): void;
}

/** Opens a connection; rejects if its handshake fails or `signal` aborts it. */
export type Dial = (handlers: CarrierHandlers, signal: AbortSignal) => Promise<Carrier>;

/** A close reason cut to `max` bytes of UTF-8 at a character boundary. */
export function cutReason(reason: string, max: number): string {
  const bytes = new TextEncoder().encode(reason);
  if (bytes.length <= max) return reason;
  let end = max;
  // Back up over UTF-8 continuation bytes (10xxxxxx).
  while (end > 0 && ((bytes[end] ?? 0) & 0xc0) === 0x80) end--;
  return new TextDecoder().decode(bytes.subarray(0, end));
}
