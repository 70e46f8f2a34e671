#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs and starts Redis (one
# server and a 3-master cluster), PostgreSQL and Kafka (scripts/services.sh
# up --redis-cluster), then runs every test against them. Extra arguments go
# to `cargo test` (e.g. a test name filter).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

scripts/services.sh up --redis-cluster
# Each test creates its own database and drops it when done; a test that
# crashed leaves one behind. Clear those before a run.
scripts/drop-databases.sh 'seckill\_test\_%'

command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup)" >&2; exit 1; }
# The criterion benches, once each in test mode (they must still run).
if [ $# -eq 0 ]; then cargo test --benches; fi
# Integration tests mostly wait on I/O: run more of them than there are cores.
cargo test --lib --bins --tests "$@" -- --test-threads="${SECKILL_TEST_THREADS:-8}"
# The order path, payments, coupons, reconciliation, sharded activities,
# many instances, the sold-out fast path and the waiting room once more, on
# the Redis Cluster:
# every script and pipeline must keep its keys in one slot, a sharded
# activity's shards sit on different masters, and a release's message
# reaches every instance. Then, alone (20,000 buyers), two API instances and a
# worker selling 1,000 units on it.
if [ $# -eq 0 ]; then
  cluster_url=$(scripts/services.sh cluster-url)
  SECKILL__REDIS__MODE=cluster SECKILL__REDIS__URL=$cluster_url \
    cargo test --test api -- --test-threads="${SECKILL_TEST_THREADS:-8}" \
    orders:: payments:: coupons:: reconcile:: shards:: instances:: sold_out:: waiting_room::
  SECKILL__REDIS__MODE=cluster SECKILL__REDIS__URL=$cluster_url \
    cargo test --test api -- --ignored instances::two_api_instances
fi
# A short contract-fuzzing pass (scripts/fuzz.sh runs the full one).
if [ $# -eq 0 ]; then SECKILL_FUZZ_EXAMPLES=${SECKILL_FUZZ_EXAMPLES:-20} scripts/fuzz.sh; fi
# The web console in headless Chromium (screenshots: target/console-screenshots/).
if [ $# -eq 0 ]; then scripts/browser-test.sh; fi
# The fault tests, one at a time on services of their own (a filter given
# to this script selects among the tests above only). The randomized one
# (nemesis) takes a new seed each run and prints it; a failure names the
# command that replays it.
if [ $# -eq 0 ]; then scripts/chaos.sh; fi
# Again on a 3-master Redis Cluster: the Redis faults (a flush, a pause of
# every master) and the randomized test, whose Redis faults hit one master.
if [ $# -eq 0 ]; then scripts/chaos.sh --redis-cluster redis_flushed redis_paused nemesis; fi
