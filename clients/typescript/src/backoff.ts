// Reconnect waits, as the Rust client (docs/protocol.md, "retry_ms"): full
// jitter, uniform in [0, min(max, initial * 2^n)] before attempt n (from 0),
// or uniform in [0, retry_ms] when the server's close reason asked for it,
// and for every failed attempt after it until one succeeds.

/** The longest wait taken from a server's `retry_ms` (a larger one is cut to this). */
export const MAX_RETRY_HINT_MS = 300_000;

/**
 * The `retry_ms=<decimal>` word of a close reason (a word of its own:
 * `xretry_ms=5` is not one), in milliseconds, at most MAX_RETRY_HINT_MS.
 * The first one counts.
 */
export function retryHint(reason: string): number | null {
  const re = /retry_ms=(\d+)/g;
  for (let m = re.exec(reason); m !== null; m = re.exec(reason)) {
    const before = reason.slice(0, m.index);
    const prev = before.length > 0 ? Array.from(before).pop()! : "";
    if (prev !== "" && /[\p{L}\p{N}_]/u.test(prev)) continue;
    // Too many digits is simply "a very long time".
    const ms = Number(m[1]);
    return Math.min(Number.isFinite(ms) ? ms : MAX_RETRY_HINT_MS, MAX_RETRY_HINT_MS);
  }
  return null;
}

export interface BackoffPolicy {
  /** The ceiling of the first wait; it doubles with every attempt. Default 100 ms. */
  initialMs: number;
  /** The largest ceiling (a server's retry_ms may exceed it). Default 5 s. */
  maxMs: number;
}

export const DEFAULT_BACKOFF: BackoffPolicy = { initialMs: 100, maxMs: 5000 };

export class Backoff {
  private attempt = 0;
  /**
   * The server's last retry_ms, kept until a success: an attempt that fails
   * inside a restart herd must not come back sooner than the spread the
   * server asked for.
   */
  private floor = 0;

  /** `random` returns a number in [0, 1) (default Math.random); tests pass their own. */
  constructor(
    private readonly policy: BackoffPolicy = DEFAULT_BACKOFF,
    private readonly random: () => number = Math.random,
  ) {}

  /**
   * The ceiling of the next wait without a new hint: min(maxMs, initialMs * 2^n),
   * or the server's last retry_ms since the last success if that is longer.
   */
  ceiling(): number {
    // 2^n overflows nothing in floating point; min() brings it back.
    const doubling = Math.min(this.policy.maxMs, this.policy.initialMs * 2 ** Math.min(this.attempt, 1024));
    return Math.max(doubling, this.floor);
  }

  /**
   * The next wait in ms: uniform in [0, hint] if the server gave one (which then
   * stays the least ceiling until reset()), else in [0, ceiling()].
   */
  next(hintMs: number | null = null): number {
    if (hintMs !== null) this.floor = hintMs;
    const ceiling = hintMs ?? this.ceiling();
    this.attempt++;
    return Math.floor(this.random() * (ceiling + 1));
  }

  /** Starts again from initialMs, forgetting the server's hint (after a success). */
  reset(): void {
    this.attempt = 0;
    this.floor = 0;
  }
}
