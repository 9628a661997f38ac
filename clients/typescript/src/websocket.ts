// The WebSocket binding (docs/protocol.md, "WebSocket over TLS"): one binary
// message per frame, no length prefix; server messages begin with a stream
// byte (0 control, 1 and 2 push streams); close code = 4000 + greendot code.

import type { Carrier, CarrierHandlers, Dial } from "./carrier.js";
import { cutReason } from "./carrier.js";
import { ConnectError } from "./errors.js";
import { CloseCode, MAX_SERVER_FRAME } from "./types.js";

export const WEBSOCKET_SUBPROTOCOL = "greendot.v1";
/** Greendot close code c travels as WebSocket close code 4000 + c. */
export const WEBSOCKET_CLOSE_BASE = 4000;
/** A WebSocket close reason holds at most 123 bytes. */
export const WEBSOCKET_REASON_MAX = 123;

/** The part of the WebSocket API used here: the browser's, and the `ws` package's in Node. */
export interface WebSocketLike {
  binaryType: string;
  readonly protocol: string;
  readonly readyState: number;
  onopen: ((ev: any) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code: number; reason: string }) => void) | null;
  onerror: ((ev: any) => void) | null;
  send(data: Uint8Array): void;
  close(code?: number, reason?: string): void;
}

export type WebSocketConstructor = new (url: string, protocols: string | string[]) => WebSocketLike;

/** The greendot close code of a WebSocket close code (null: not one of ours, e.g. 1006 for a lost connection). */
export function greendotCloseCode(wsCode: number): number | null {
  return wsCode >= WEBSOCKET_CLOSE_BASE && wsCode < WEBSOCKET_CLOSE_BASE + 1000 ? wsCode - WEBSOCKET_CLOSE_BASE : null;
}

/** The WebSocket close code a client sends for a greendot close code (0, a plain close, is 1000). */
export function webSocketCloseCode(code: number): number {
  return code === CloseCode.Normal ? 1000 : WEBSOCKET_CLOSE_BASE + code;
}

class WebSocketCarrier implements Carrier {
  readonly binding = "websocket";
  readonly needsHeartbeat = true;
  private ended = false;

  constructor(
    private readonly ws: WebSocketLike,
    private readonly handlers: CarrierHandlers,
  ) {
    ws.onmessage = (ev) => this.message(ev.data);
    ws.onclose = (ev) => this.end(greendotCloseCode(ev.code), ev.reason);
  }

  private message(data: unknown): void {
    if (this.ended) return;
    if (!(data instanceof ArrayBuffer)) {
      this.protocolError("a text message");
      return;
    }
    const bytes = new Uint8Array(data);
    // A stream byte and at least one payload byte (an empty frame is a bad frame).
    if (bytes.length < 2) return this.protocolError(`a message of ${bytes.length} bytes`);
    if (bytes.length > MAX_SERVER_FRAME + 1) return this.protocolError(`a message of ${bytes.length} bytes`);
    const stream = bytes[0]!;
    const payload = bytes.subarray(1);
    if (stream === 0) this.handlers.control(payload);
    else if (stream === 1 || stream === 2) this.handlers.push(stream, payload);
    else this.protocolError(`unknown stream byte ${stream}`);
  }

  private protocolError(what: string): void {
    const reason = `protocol error: the server sent ${what}`;
    this.close(CloseCode.ProtocolError, reason);
    this.handlers.closed(null, reason);
  }

  private end(code: number | null, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    this.handlers.closed(code, reason);
  }

  send(payload: Uint8Array): void {
    if (!this.ended) this.ws.send(payload);
  }

  close(code: number, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    try {
      this.ws.close(webSocketCloseCode(code), cutReason(reason, WEBSOCKET_REASON_MAX));
    } catch {
      // Already closing: nothing more to say.
    }
  }
}

/** Dials `url` (wss://HOST:PORT/greendot) with subprotocol greendot.v1. */
export function dialWebSocket(url: string, ctor: WebSocketConstructor): Dial {
  return (handlers, signal) =>
    new Promise<Carrier>((resolve, reject) => {
      let ws: WebSocketLike;
      try {
        ws = new ctor(url, [WEBSOCKET_SUBPROTOCOL]);
      } catch (e) {
        reject(new ConnectError(`websocket ${url}: ${String(e)}`));
        return;
      }
      ws.binaryType = "arraybuffer";
      const abort = () => {
        ws.close(1000, "connect aborted");
        reject(new ConnectError(`websocket ${url}: ${String(signal.reason ?? "aborted")}`));
      };
      if (signal.aborted) return abort();
      signal.addEventListener("abort", abort, { once: true });
      ws.onerror = () => {
        // A close event follows with the details there are.
      };
      ws.onclose = (ev) => {
        signal.removeEventListener("abort", abort);
        reject(new ConnectError(`websocket ${url}: handshake failed (close ${ev.code} ${ev.reason})`));
      };
      ws.onmessage = null;
      ws.onopen = () => {
        signal.removeEventListener("abort", abort);
        if (ws.protocol !== WEBSOCKET_SUBPROTOCOL) {
          ws.onclose = null;
          ws.close(1000, "no greendot.v1 subprotocol");
          reject(new ConnectError(`websocket ${url}: the server did not accept subprotocol ${WEBSOCKET_SUBPROTOCOL}`));
          return;
        }
        resolve(new WebSocketCarrier(ws, handlers));
      };
    });
}
