#!/usr/bin/env bash
# The README's waiting-room quick start, as scripts/test.sh runs it:
# scripts/waiting_room_demo.py against a development server of its own
# (database, key prefix, topic prefix and port). The demo exits 1 unless
# every ticket sat at its drawn place and the units went to as many buyers
# as there were units.
#
#   scripts/room-demo.sh [--buyers N]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/own-server.sh
. scripts/own-server.sh

scripts/services.sh up >/dev/null
# The demo signs in with development tokens.
export SECKILL_ENV=development
start_own_server roomdemo
if ! python3 scripts/waiting_room_demo.py --url "$URL" "$@"; then
  echo "room-demo: FAILED (server log: $OUT/server.log)" >&2
  exit 1
fi
if grep -q panicked "$OUT/server.log"; then
  echo "room-demo: the server panicked ($OUT/server.log)" >&2
  exit 1
fi
