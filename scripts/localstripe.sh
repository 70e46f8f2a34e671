#!/usr/bin/env bash
# The Stripe-style payment tests' server: localstripe (PyPI), a stateful
# fake Stripe that sends signed webhooks, run by tests/api/stripe.rs as a
# process. Installs it into its own venv when missing; prints the path of
# its command.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/own-server.sh
. "$ROOT/scripts/own-server.sh"
LOCALSTRIPE_VERSION=1.15.10
VENV=${SECKILL_LOCALSTRIPE_VENV:-$HOME/.cache/seckill/localstripe-$LOCALSTRIPE_VERSION}
python_venv "$VENV" localstripe "localstripe==$LOCALSTRIPE_VERSION"
echo "$VENV/bin/localstripe"
