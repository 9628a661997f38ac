#!/bin/sh
# An idle connected client's memory, wake-ups and bytes (issue 27): builds
# the server, the Python binding and the bench, generates the Python module,
# then measures the Rust client and the Python binding, each in the
# foreground and in the background, in one window (bench/src/bin/idle_client.rs).
#
#   bench/idle_client.sh [--minutes 10]
#
# Honours CARGO_TARGET_DIR; other arguments go to the bench. Prints the
# date, then the bench's tables (markdown).
set -eu
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
# As tests/src/ffi.rs builds them, so the Python tests' build is reused.
cargo build --release -p greendot-ffi -p greendot-uniffi-bindgen
cargo build --release -p greendot-transport --bin greendot
cargo build --release -p greendot-bench --bin idle_client
release="$target/release"
bindings="$release/python-bindings"
mkdir -p "$bindings"
"$release/uniffi-bindgen" generate --no-format --language python \
    --out-dir "$bindings" --library "$release/libgreendot_ffi.so"
cp "$release/libgreendot_ffi.so" "$bindings/"
date -u '+%Y-%m-%d %H:%M UTC'
git log -1 --format='commit %h' 2>/dev/null || true
exec "$release/idle_client" --greendot "$release/greendot" --python-bindings "$bindings" "$@"
