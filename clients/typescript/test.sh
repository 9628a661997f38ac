#!/usr/bin/env bash
# Installs the pinned dependencies (package-lock.json), builds with tsc and
# runs the tests with Node's built-in runner. Needs Node >= 20 and the npm
# registry; nothing else.
set -euo pipefail
cd "$(dirname "$0")"
npm ci --no-audit --no-fund
rm -rf dist
npx tsc -p .
node --test dist/test/*.test.js
