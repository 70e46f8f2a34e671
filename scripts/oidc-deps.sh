#!/usr/bin/env bash
# The identity tests' OIDC issuer (tests/oidc: oauth2-mock-server, run by
# tests/api/identity.rs as a process): installs its Node.js packages from
# the lock file when they are missing or older than it. Needs Node.js 20.19
# or newer and npm (the machine's; Debian's own nodejs package is older).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR="$ROOT/tests/oidc"

command -v node >/dev/null && command -v npm >/dev/null || {
  echo "node and npm not found: the identity tests need Node.js >= 20.19 (https://nodejs.org)" >&2
  exit 1
}
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 20 ]; then
  echo "Node.js $(node --version) is too old for oauth2-mock-server 8: 20.19 or newer" >&2
  exit 1
fi
if [ -d "$DIR/node_modules/oauth2-mock-server" ] && [ ! "$DIR/package-lock.json" -nt "$DIR/node_modules/.package-lock.json" ]; then
  exit 0
fi
echo "[oidc] npm ci in tests/oidc"
(cd "$DIR" && npm ci --no-audit --no-fund --loglevel=error)
