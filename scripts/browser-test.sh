#!/usr/bin/env bash
# The web console in a real browser: installs Debian's Chromium and
# chromedriver (when missing) and Selenium from PyPI (into a venv under
# ~/.cache/seckill/), starts a development server on its own database and
# prefixes, and runs tests/browser/console_test.py against it. Screenshots
# go to target/console-screenshots/.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

SELENIUM_VERSION=4.50.0
VENV=${SECKILL_BROWSER_VENV:-$HOME/.cache/seckill/selenium-$SELENIUM_VERSION}
SHOTS=$ROOT/target/console-screenshots

say() { printf '\n== %s\n' "$*" >&2; }

scripts/services.sh up >/dev/null
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  say "installing chromium and chromium-driver (Debian)"
  [ "$(id -u)" = 0 ] || { echo "install the Debian packages chromium and chromium-driver" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver >/dev/null
fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import selenium' 2>/dev/null; then
  say "installing selenium $SELENIUM_VERSION into $VENV"
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "python3 cannot make a venv: install python3-venv" >&2; exit 1; }
    apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "selenium==$SELENIUM_VERSION"
fi
cargo build --quiet --bin seckill
BIN=target/debug/seckill

eval "$(python3 scripts/settings.py)"
RUN=browser$(date +%s)$$
OUT=$(mktemp -d /tmp/seckill-browser.XXXXXX)
DB=seckill_browser_$RUN
export PGPASSWORD=$PG_PASSWORD
psql_admin() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -qtA "$@"; }
scripts/drop-databases.sh 'seckill\_browser\_%'
psql_admin -c "create database $DB"

# A development server: the console signs in with development tokens and
# pays through the mock provider. Each activity takes at most 3 purchases
# a second, so the test's crowd is turned away (RATE_LIMITED).
export SECKILL_ENV=development SECKILL__LOG__LEVEL=warn
export SECKILL__POSTGRES__URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$DB"
export SECKILL__REDIS__KEY_PREFIX="$RUN:" SECKILL__KAFKA__TOPIC_PREFIX="$RUN."
export SECKILL__ADMISSION__ACTIVITY_RATE_PER_SEC=3 SECKILL__ADMISSION__ACTIVITY_BURST=3
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export SECKILL__APP__PORT=$PORT
URL=http://127.0.0.1:$PORT

SERVER=
cleanup() {
  [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null
  psql_admin -c "drop database if exists $DB with (force)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

$BIN migrate >/dev/null
$BIN serve >"$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 600); do
  curl -fs "$URL/health/ready" >/dev/null 2>&1 && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
  sleep 0.1
done
curl -fs "$URL/health/ready" >/dev/null || { echo "the server never became ready" >&2; exit 1; }

rm -rf "$SHOTS"
say "the console in headless Chromium"
if ! "$VENV/bin/python" tests/browser/console_test.py "$URL" "$SHOTS"; then
  echo "browser: FAILED (server log: $OUT/server.log; screenshots: $SHOTS)" >&2
  exit 1
fi
if grep -q panicked "$OUT/server.log"; then
  echo "browser: the server panicked ($OUT/server.log)" >&2
  exit 1
fi
