// The WebTransport binding (docs/protocol.md, "WebTransport over HTTP/3"):
// the client opens one bidirectional stream for control frames, the server
// opens two unidirectional push streams; frames as on raw QUIC (4-byte
// big-endian length + postcard). Session close code = greendot close code.

import type { Carrier, CarrierHandlers, Dial } from "./carrier.js";
import { cutReason } from "./carrier.js";
import { ConnectError } from "./errors.js";
import { FrameReader, prefixFrame } from "./framing.js";
import { CloseCode, MAX_SERVER_FRAME } from "./types.js";

/** A WebTransport session close reason holds at most 1024 bytes. */
export const WEBTRANSPORT_REASON_MAX = 1024;

export interface CertificateHash {
  algorithm: "sha-256";
  value: BufferSource;
}

/** The part of the WebTransport API used here (kept minimal so any DOM typing fits). */
export interface WebTransportLike {
  readonly ready: Promise<unknown>;
  readonly closed: Promise<{ closeCode?: number; reason?: string }>;
  readonly incomingUnidirectionalStreams: ReadableStream<ReadableStream<Uint8Array>>;
  createBidirectionalStream(): Promise<{ readable: ReadableStream<Uint8Array>; writable: WritableStream<Uint8Array> }>;
  close(info?: { closeCode?: number; reason?: string }): void;
}

export type WebTransportConstructor = new (
  url: string,
  options?: { serverCertificateHashes?: CertificateHash[] },
) => WebTransportLike;

/** Reads frames off a stream until it ends; false if it broke the framing. */
async function readFrames(
  stream: ReadableStream<Uint8Array>,
  each: (payload: Uint8Array) => void,
  isEnded: () => boolean,
): Promise<string | null> {
  const reader = stream.getReader();
  const frames = new FrameReader(MAX_SERVER_FRAME);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (isEnded()) return null;
      if (done) {
        frames.finish();
        return null;
      }
      frames.push(value);
      for (let payload = frames.next(); payload !== null; payload = frames.next()) {
        each(payload);
        if (isEnded()) return null;
      }
    }
  } catch (e) {
    // A reset stream or a lost session is reported by `closed`; bad framing is ours to report.
    return e instanceof Error && e.name === "FrameError" ? e.message : null;
  } finally {
    reader.releaseLock();
  }
}

class WebTransportCarrier implements Carrier {
  readonly binding = "webtransport";
  readonly needsHeartbeat = false;
  private ended = false;
  private pushStreams = 0;

  constructor(
    private readonly wt: WebTransportLike,
    private readonly writer: WritableStreamDefaultWriter<Uint8Array>,
    readable: ReadableStream<Uint8Array>,
    private readonly handlers: CarrierHandlers,
  ) {
    void readFrames(readable, (p) => handlers.control(p), () => this.ended).then((bad) => bad && this.protocolError(bad));
    void this.acceptPushes();
    wt.closed.then(
      (info) => this.end(info.closeCode ?? null, info.reason ?? ""),
      (e) => this.end(null, `webtransport session lost: ${String(e)}`),
    );
  }

  private async acceptPushes(): Promise<void> {
    const streams = this.wt.incomingUnidirectionalStreams.getReader();
    try {
      for (;;) {
        const { value, done } = await streams.read();
        if (done || this.ended) return;
        const stream = ++this.pushStreams;
        void readFrames(value, (p) => this.handlers.push(stream, p), () => this.ended).then(
          (bad) => bad && this.protocolError(bad),
        );
      }
    } catch {
      // The session ended: `closed` tells how.
    }
  }

  private protocolError(what: string): void {
    const reason = `protocol error: ${what}`;
    this.close(CloseCode.ProtocolError, reason);
    this.handlers.closed(null, reason);
  }

  private end(code: number | null, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    this.handlers.closed(code, reason);
  }

  send(payload: Uint8Array): void {
    if (this.ended) return;
    // Failures surface through `closed`.
    this.writer.write(prefixFrame(payload)).catch(() => {});
  }

  close(code: number, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    try {
      this.wt.close({ closeCode: code, reason: cutReason(reason, WEBTRANSPORT_REASON_MAX) });
    } catch {
      // Already closed.
    }
  }
}

/** Dials `url` (https://HOST:PORT/greendot) over HTTP/3. */
export function dialWebTransport(
  url: string,
  ctor: WebTransportConstructor,
  serverCertificateHashes?: CertificateHash[],
): Dial {
  return async (handlers: CarrierHandlers, signal: AbortSignal) => {
    let wt: WebTransportLike;
    try {
      wt = new ctor(url, serverCertificateHashes ? { serverCertificateHashes } : {});
    } catch (e) {
      throw new ConnectError(`webtransport ${url}: ${String(e)}`);
    }
    // An unhandled rejection of `closed` must not surface while dialing.
    wt.closed.catch(() => {});
    const aborted = new Promise<never>((_, reject) => {
      const abort = () => reject(new ConnectError(`webtransport ${url}: ${String(signal.reason ?? "aborted")}`));
      if (signal.aborted) abort();
      else signal.addEventListener("abort", abort, { once: true });
    });
    aborted.catch(() => {});
    try {
      await Promise.race([wt.ready, aborted]);
      const bidi = await Promise.race([wt.createBidirectionalStream(), aborted]);
      return new WebTransportCarrier(wt, bidi.writable.getWriter(), bidi.readable, handlers);
    } catch (e) {
      try {
        wt.close({ closeCode: CloseCode.Normal, reason: "handshake abandoned" });
      } catch {
        // Never opened.
      }
      throw e instanceof ConnectError ? e : new ConnectError(`webtransport ${url}: handshake failed: ${String(e)}`);
    }
  };
}
