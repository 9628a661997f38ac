// The subset of postcard (https://postcard.jamesmunns.com/wire-format) that
// protocol version 1 uses: LEB128 varints, bools, UTF-8 strings, options,
// enums and sequences. Decoding is as strict as the Rust side (postcard 1):
// a varint longer than its type allows, a bool or option tag other than 0/1,
// bad UTF-8 or trailing bytes are errors, never a guess.

/** A payload that does not decode as the frame it should be. */
export class DecodeError extends Error {
  override name = "DecodeError";
}

const U64_MAX = (1n << 64n) - 1n;
const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

export class Writer {
  private buf = new Uint8Array(64);
  private len = 0;

  private reserve(n: number): void {
    if (this.len + n <= this.buf.length) return;
    let size = this.buf.length * 2;
    while (size < this.len + n) size *= 2;
    const next = new Uint8Array(size);
    next.set(this.buf.subarray(0, this.len));
    this.buf = next;
  }

  u8(value: number): this {
    if (!Number.isInteger(value) || value < 0 || value > 0xff) throw new RangeError(`not a u8: ${value}`);
    this.reserve(1);
    this.buf[this.len++] = value;
    return this;
  }

  /** An unsigned varint of at most `bits` bits (16, 32 or 64). */
  varint(value: number | bigint, bits: 16 | 32 | 64): this {
    let v = typeof value === "bigint" ? value : BigInt(value);
    if (typeof value === "number" && !Number.isSafeInteger(value)) throw new RangeError(`not an integer: ${value}`);
    const max = bits === 64 ? U64_MAX : (1n << BigInt(bits)) - 1n;
    if (v < 0n || v > max) throw new RangeError(`${value} does not fit in u${bits}`);
    this.reserve(10);
    do {
      const low = Number(v & 0x7fn);
      v >>= 7n;
      this.buf[this.len++] = v === 0n ? low : low | 0x80;
    } while (v !== 0n);
    return this;
  }

  u16(value: number): this {
    return this.varint(value, 16);
  }
  u32(value: number): this {
    return this.varint(value, 32);
  }
  u64(value: bigint): this {
    return this.varint(value, 64);
  }
  /** An enum's variant index (postcard: a u32 varint). */
  variant(index: number): this {
    return this.varint(index, 32);
  }
  bool(value: boolean): this {
    return this.u8(value ? 1 : 0);
  }
  bytes(value: Uint8Array): this {
    this.reserve(value.length);
    this.buf.set(value, this.len);
    this.len += value.length;
    return this;
  }
  string(value: string): this {
    const utf8 = encoder.encode(value);
    return this.varint(utf8.length, 64).bytes(utf8);
  }
  option<T>(value: T | null | undefined, item: (w: this, v: T) => void): this {
    if (value === null || value === undefined) return this.u8(0);
    this.u8(1);
    item(this, value);
    return this;
  }
  seq<T>(values: readonly T[], item: (w: this, v: T) => void): this {
    this.varint(values.length, 64);
    for (const v of values) item(this, v);
    return this;
  }
  finish(): Uint8Array {
    return this.buf.slice(0, this.len);
  }
}

export class Reader {
  private pos = 0;
  constructor(private readonly buf: Uint8Array) {}

  get remaining(): number {
    return this.buf.length - this.pos;
  }

  u8(): number {
    const byte = this.buf[this.pos];
    if (byte === undefined) throw new DecodeError("unexpected end of frame");
    this.pos++;
    return byte;
  }

  /**
   * An unsigned varint of at most `bits` bits: at most ceil(bits/7) bytes, and
   * the last byte may not carry bits beyond the type (postcard's check).
   */
  varint(bits: 16 | 32 | 64): bigint {
    const maxBytes = Math.ceil(bits / 7);
    const lastMax = (1 << (bits - 7 * (maxBytes - 1))) - 1;
    let out = 0n;
    for (let i = 0; i < maxBytes; i++) {
      const byte = this.u8();
      out |= BigInt(byte & 0x7f) << BigInt(7 * i);
      if ((byte & 0x80) === 0) {
        if (i === maxBytes - 1 && byte > lastMax) throw new DecodeError(`varint overflows u${bits}`);
        return out;
      }
    }
    throw new DecodeError(`varint longer than u${bits} allows`);
  }

  u16(): number {
    return Number(this.varint(16));
  }
  u32(): number {
    return Number(this.varint(32));
  }
  u64(): bigint {
    return this.varint(64);
  }
  variant(): number {
    return this.u32();
  }
  bool(): boolean {
    const byte = this.u8();
    if (byte > 1) throw new DecodeError(`bad bool ${byte}`);
    return byte === 1;
  }
  /** A length or count: never more than the bytes left (each item takes one at least). */
  private length(): number {
    const n = this.varint(64);
    if (n > BigInt(this.remaining)) throw new DecodeError(`length ${n} exceeds the ${this.remaining} bytes left`);
    return Number(n);
  }
  string(): string {
    const n = this.length();
    const bytes = this.buf.subarray(this.pos, this.pos + n);
    this.pos += n;
    try {
      return decoder.decode(bytes);
    } catch {
      throw new DecodeError("string is not UTF-8");
    }
  }
  option<T>(item: (r: this) => T): T | null {
    const tag = this.u8();
    if (tag === 0) return null;
    if (tag === 1) return item(this);
    throw new DecodeError(`bad option tag ${tag}`);
  }
  seq<T>(item: (r: this) => T): T[] {
    const n = this.length();
    const out: T[] = [];
    for (let i = 0; i < n; i++) out.push(item(this));
    return out;
  }
  /** The payload must decode exactly: trailing bytes are a bad frame. */
  end(): void {
    if (this.remaining !== 0) throw new DecodeError(`${this.remaining} trailing bytes after the frame`);
  }
}
