#!/usr/bin/env bash
# The web console in a real browser: installs Debian's Chromium and
# chromedriver (when missing) and Selenium from PyPI (into a venv under
# ~/.cache/seckill/), starts a development server on its own database and
# prefixes, and runs tests/browser/console_test.py against it. Screenshots
# go to target/console-screenshots/. With --install-only it installs and
# stops there (scripts/install.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/own-server.sh
. scripts/own-server.sh

SELENIUM_VERSION=4.50.0
VENV=${SECKILL_BROWSER_VENV:-$HOME/.cache/seckill/selenium-$SELENIUM_VERSION}
SHOTS=$ROOT/target/console-screenshots

say() { printf '\n== %s\n' "$*" >&2; }

if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  say "installing chromium and chromium-driver (Debian)"
  [ "$(id -u)" = 0 ] || { echo "install the Debian packages chromium and chromium-driver" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver >/dev/null
fi
python_venv "$VENV" selenium "selenium==$SELENIUM_VERSION"
[ "${1:-}" = --install-only ] && exit 0
scripts/services.sh up >/dev/null

# A development server: the console signs in with development tokens and
# pays through the mock provider. Each activity takes at most 3 purchases
# a second, so the test's crowd is turned away (RATE_LIMITED).
export SECKILL_ENV=development
export SECKILL__ADMISSION__ACTIVITY_RATE_PER_SEC=3 SECKILL__ADMISSION__ACTIVITY_BURST=3
start_own_server browser

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
