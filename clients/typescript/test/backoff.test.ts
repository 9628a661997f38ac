import assert from "node:assert/strict";
import { test } from "node:test";
import { Backoff, MAX_RETRY_HINT_MS, RejectedError, retryHint } from "../src/index.js";

test("ceilings double from 100 ms up to 5 s", () => {
  const b = new Backoff({ initialMs: 100, maxMs: 5000 });
  const ceilings: number[] = [];
  for (let i = 0; i < 10; i++) {
    ceilings.push(b.ceiling());
    b.next();
  }
  assert.deepEqual(ceilings, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]);
  for (let i = 0; i < 2000; i++) b.next();
  assert.equal(b.ceiling(), 5000, "no overflow however many attempts");
  b.reset();
  assert.equal(b.ceiling(), 100);
});

test("full jitter: every wait in [0, ceiling], both ends reached, mean in the middle", () => {
  const ratios: number[] = [];
  for (let run = 0; run < 2000; run++) {
    const b = new Backoff({ initialMs: 100, maxMs: 400 });
    for (let n = 0; n < 4; n++) {
      const ceiling = b.ceiling();
      const wait = b.next();
      assert.ok(Number.isInteger(wait) && wait >= 0 && wait <= ceiling, `wait ${wait} outside [0, ${ceiling}]`);
      if (n === 3) ratios.push(wait / ceiling);
    }
  }
  const low = ratios.filter((x) => x < 0.1).length;
  const high = ratios.filter((x) => x > 0.9).length;
  const mean = ratios.reduce((a, b) => a + b, 0) / ratios.length;
  assert.ok(low > 100 && high > 100, `${low} low, ${high} high`);
  assert.ok(Math.abs(mean - 0.5) < 0.05, `mean ${mean}`);
  // The extremes of the random source map to the ends of the range.
  assert.equal(new Backoff({ initialMs: 100, maxMs: 5000 }, () => 0).next(), 0);
  assert.equal(new Backoff({ initialMs: 100, maxMs: 5000 }, () => 0.9999999).next(), 100);
});

test("a server's retry_ms spreads every attempt until a success", () => {
  let longest = 0;
  let longestAfterFailure = 0;
  for (let i = 0; i < 500; i++) {
    const b = new Backoff({ initialMs: 100, maxMs: 5000 });
    const wait = b.next(12_000);
    assert.ok(wait >= 0 && wait <= 12_000);
    longest = Math.max(longest, wait);
    // The attempt failed without a new hint: the server's spread still holds.
    for (let k = 0; k < 3; k++) {
      assert.equal(b.ceiling(), 12_000);
      const again = b.next();
      assert.ok(again <= 12_000);
      longestAfterFailure = Math.max(longestAfterFailure, again);
    }
    b.reset();
    assert.equal(b.ceiling(), 100, "a success forgets the hint");
  }
  assert.ok(longest > 5000, `a hint above maxMs is honoured (${longest})`);
  assert.ok(longestAfterFailure > 5000, `and kept after a failure (${longestAfterFailure})`);
  assert.equal(new Backoff({ initialMs: 100, maxMs: 5000 }).next(0), 0, "a zero hint: at once");
});

test("retry_ms is read from a close reason (the Rust client's cases)", () => {
  assert.equal(retryHint("server draining: reconnect and resume retry_ms=12000"), 12_000);
  assert.equal(retryHint("retry_ms=0"), 0);
  assert.equal(retryHint("TooManyConnections: full (retry_ms=250)"), 250);
  assert.equal(retryHint("retry_ms=250, then retry_ms=9"), 250);
  assert.equal(retryHint("busy retry_ms=1500; more text"), 1500);
  assert.equal(retryHint("xretry_ms=5"), null);
  assert.equal(retryHint("éretry_ms=5"), null, "a letter of any script joins the word");
  assert.equal(retryHint("retry_ms="), null);
  assert.equal(retryHint("retry_ms=-5"), null);
  assert.equal(retryHint("retry_ms = 5"), null);
  assert.equal(retryHint("retry_ms=1.5"), 1);
  assert.equal(retryHint("server draining"), null);
  assert.equal(retryHint(""), null);
  assert.equal(retryHint("xretry_ms=5 retry_ms=7"), 7);
  assert.equal(retryHint("retry_ms=99999999999999999999999"), MAX_RETRY_HINT_MS);
  assert.equal(retryHint("retry_ms=86400000"), MAX_RETRY_HINT_MS);
  assert.equal(new RejectedError(14, { code: 16, message: "draining retry_ms=40" }).retryAfterMs, 40);
});
