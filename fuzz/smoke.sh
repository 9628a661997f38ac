#!/usr/bin/env bash
# Runs every fuzz target for a bounded time and fails on any crash.
# Usage: fuzz/smoke.sh [seconds per target, default 30]
# FUZZ_SEED (default 1) fixes libFuzzer's seed, so that a run explores the
# same inputs in the same order (the count depends on the machine's speed)
# and a CI failure replays here; FUZZ_SEED=0 draws a new seed each run, for
# longer searches.
# Works on stable Rust: cargo-fuzz needs nightly flags, which RUSTC_BOOTSTRAP=1
# allows. Installs cargo-fuzz when it is missing.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-${FUZZ_SECONDS:-30}}"
seed="${FUZZ_SEED:-1}"

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

targets=$(cargo fuzz list)
# No sanitizer: the targets are safe Rust, what they look for is a panic
# or a limit not held, and without ASan the build and every run are faster
# (CI's time is bounded). -O builds fuzz/Cargo.toml's release profile, which
# keeps debug assertions and overflow checks on (see there).
cargo fuzz build -O --sanitizer none
for target in $targets; do
  work=$(mktemp -d)
  echo "== fuzz $target for ${secs}s"
  # New inputs go to a scratch corpus; the checked-in seeds are only read.
  if ! cargo fuzz run -O --sanitizer none "$target" "$work" "corpus/$target" -- \
      -max_total_time="$secs" -seed="$seed" -print_final_stats=1 2>"$work.log"; then
    # The panic's message comes before its backtrace and the stats.
    grep -A 3 -m 1 'panicked at' "$work.log" || true
    tail -n 40 "$work.log"
    echo "fuzz target $target failed: see fuzz/artifacts/$target" >&2
    exit 1
  fi
  grep -E '^stat::number_of_executed_units|^Done' "$work.log" || true
  rm -rf "$work" "$work.log"
done
echo "fuzz smoke: every target ran ${secs}s without a crash"
