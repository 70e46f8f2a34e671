#!/usr/bin/env bash
# Installs what the whole suite needs, and starts nothing: the services'
# Debian packages and Kafka's jars (scripts/services.sh install), Chromium
# and Selenium for the console's test, schemathesis for the fuzzing, the
# wechatpay-java SDK for the payment tests' check (Maven), localstripe for
# the Stripe-style ones (PyPI). Each
# script also installs what it misses as it goes; .ci/run runs this one in
# the background while clippy compiles, so that the downloads wait on the
# network while the compiler has the CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/services.sh install
scripts/browser-test.sh --install-only
scripts/fuzz.sh --install-only
scripts/wechatpay-sdk.sh
scripts/localstripe.sh >/dev/null
