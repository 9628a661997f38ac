import assert from "node:assert/strict";
import { test } from "node:test";
import { type Presence, View } from "../src/index.js";

const at = (version: bigint, online: boolean): Presence => ({
  version,
  online,
  status: "available",
  message: null,
  kinds: 0,
  lastSeen: null,
  invisible: false,
});

test("newer replaces older, duplicates and older ones drop (core's View test)", () => {
  const view = new View();
  assert.equal(view.apply("bob", at(3n, true)), "new");
  assert.equal(view.apply("bob", at(3n, false)), "dropped");
  assert.equal(view.apply("bob", at(2n, false)), "dropped");
  assert.equal(view.get("bob")?.online, true);
  assert.equal(view.apply("bob", at(4n, false)), "updated");
  assert.deepEqual(view.get("bob"), at(4n, false));
  assert.deepEqual(view.forget("bob"), at(4n, false));
  assert.equal(view.size, 0);
});

test("versions never go backwards, whatever order snapshots and pushes arrive in", () => {
  // A deterministic shuffle of versions 1..200 for three targets, with duplicates.
  let seed = 12345;
  const rand = () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31);
  const view = new View();
  const highest = new Map<string, bigint>();
  for (let i = 0; i < 2000; i++) {
    const target = ["a", "b", "c"][Math.floor(rand() * 3)]!;
    const version = BigInt(1 + Math.floor(rand() * 200));
    const before = view.get(target)?.version;
    const applied = view.apply(target, at(version, version % 2n === 0n));
    const after = view.get(target)!.version;
    assert.ok(before === undefined || after >= before, `${target} went from ${before} to ${after}`);
    assert.equal(applied, before === undefined ? "new" : version > before ? "updated" : "dropped");
    highest.set(target, (highest.get(target) ?? 0n) > version ? highest.get(target)! : version);
  }
  for (const [target, version] of highest) assert.equal(view.get(target)!.version, version);
  // Versions past 2^53 compare exactly (bigint, never rounded).
  const big = 2n ** 60n;
  assert.equal(view.apply("a", at(big, true)), "updated");
  assert.equal(view.apply("a", at(big - 1n, false)), "dropped");
  assert.equal(view.apply("a", at(big + 1n, false)), "updated");
  view.clear();
  assert.equal(view.apply("a", at(1n, true)), "new", "after clear() a restarted server's low versions are taken");
});
