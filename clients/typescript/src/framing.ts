// The stream form of frames (raw QUIC and WebTransport): a 4-byte big-endian
// length, then that many bytes of payload. WebSocket messages carry no prefix.

/** Why a byte stream could not be cut into frames; the stream is then out of step. */
export class FrameError extends Error {
  override name = "FrameError";
  constructor(
    readonly kind: "tooLarge" | "empty" | "truncated",
    message: string,
  ) {
    super(message);
  }
}

/** One frame in the stream form: the length prefix, then the payload. */
export function prefixFrame(payload: Uint8Array): Uint8Array {
  if (payload.length > 0xffff_ffff) throw new RangeError("frame longer than a u32 length");
  const out = new Uint8Array(4 + payload.length);
  new DataView(out.buffer).setUint32(0, payload.length, false);
  out.set(payload, 4);
  return out;
}

/**
 * Cuts a byte stream into frame payloads. A length over `max` is refused from
 * the prefix alone, before its payload is buffered; a length of 0 is an error.
 */
export class FrameReader {
  private buf = new Uint8Array(0);
  private start = 0;
  private end = 0;

  constructor(readonly max: number) {}

  /** Bytes received but not yet part of a complete frame. */
  get pending(): number {
    return this.end - this.start;
  }

  push(bytes: Uint8Array): void {
    if (this.end + bytes.length > this.buf.length) {
      // Move what is left to the front (grow if needed): amortised linear.
      const need = this.pending + bytes.length;
      const next = need > this.buf.length ? new Uint8Array(Math.max(need, this.buf.length * 2)) : this.buf;
      const pending = this.pending;
      if (next === this.buf) next.copyWithin(0, this.start, this.end);
      else next.set(this.buf.subarray(this.start, this.end), 0);
      this.buf = next;
      this.start = 0;
      this.end = pending;
    }
    this.buf.set(bytes, this.end);
    this.end += bytes.length;
  }

  /** The next complete frame's payload, or null if none is buffered yet. */
  next(): Uint8Array | null {
    if (this.pending < 4) return null;
    const len = new DataView(this.buf.buffer, this.buf.byteOffset + this.start, 4).getUint32(0, false);
    if (len > this.max) throw new FrameError("tooLarge", `frame of ${len} bytes exceeds the cap of ${this.max}`);
    if (len === 0) throw new FrameError("empty", "empty frame");
    if (this.pending < 4 + len) return null;
    const payload = this.buf.slice(this.start + 4, this.start + 4 + len);
    this.start += 4 + len;
    if (this.start === this.end) {
      // Nothing left: give a large buffer back.
      this.start = this.end = 0;
      if (this.buf.length > 4096) this.buf = new Uint8Array(0);
    }
    return payload;
  }

  /** At the end of the stream: an error if part of a frame is left over. */
  finish(): void {
    if (this.pending !== 0) throw new FrameError("truncated", "stream ended inside a frame");
  }
}
