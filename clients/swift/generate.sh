#!/usr/bin/env bash
# Regenerates the Swift bindings in Sources/ from the current greendot-ffi,
# with the workspace's uniffi-bindgen (tests/tests/swift_bindings.rs fails
# when they differ). Output is unformatted, so that it does not depend on
# whether swiftformat is installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${CARGO_TARGET_DIR:-target}"
cargo build --release -p greendot-ffi -p greendot-uniffi-bindgen
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$target/release/uniffi-bindgen" generate --no-format --language swift --out-dir "$out" \
  --library "$target/release/libgreendot_ffi.so"
cp "$out/greendot_ffi.swift" clients/swift/Sources/Greendot/greendot_ffi.swift
cp "$out/greendot_ffiFFI.h" clients/swift/Headers/greendot_ffiFFI.h
cp "$out/greendot_ffiFFI.modulemap" clients/swift/Headers/module.modulemap
