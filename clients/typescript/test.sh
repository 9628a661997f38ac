#!/usr/bin/env bash
# Installs the pinned dependencies (package-lock.json), builds with tsc and
# runs the tests with Node's built-in runner. Needs Node >= 20 and the npm
# registry; nothing else. Also checks that the page's bundled copy of the
# client is up to date (bundle.sh).
set -euo pipefail
cd "$(dirname "$0")"
npm ci --no-audit --no-fund
rm -rf dist
npx tsc -p .
# The page's copy of the client (one ES module) must be this src/'s.
bundled="$(mktemp)"
trap 'rm -f "$bundled"' EXIT
./bundle.sh "$bundled"
if ! cmp -s "$bundled" ../../transport/src/bin/greendot/page/greendot-client.js; then
  echo "transport/src/bin/greendot/page/greendot-client.js is out of date with clients/typescript/src: run clients/typescript/bundle.sh" >&2
  exit 1
fi
node --test dist/test/*.test.js
