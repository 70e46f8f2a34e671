#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs and starts Redis (one
# server and a 3-master cluster), PostgreSQL and Kafka (scripts/services.sh
# up --redis-cluster), builds everything once, then runs two lanes at once:
#
#   tests   on those services: the criterion benches once in test mode, the
#           unit and integration tests, the Redis-Cluster pass, the
#           contract fuzzing, the console in headless Chromium and the
#           waiting-room demo (scripts/room-demo.sh);
#   faults  on a second set of services of their own (scripts/chaos.sh):
#           the fault tests and the randomized one, on one Redis server,
#           then the Redis faults and the randomized one on a cluster.
#
# The fault tests spend most of their time waiting on a fault (a paused
# broker, a server coming back), so on two cores the lanes side by side
# take little more than the longer one. Every step runs even when an
# earlier one failed; the run ends with each step's time and result, and
# fails when any step did. SECKILL_TEST_LANES=1 runs the faults after the
# tests instead (for a host too slow to share).
#
# Extra arguments go to `cargo test` (e.g. a test name filter) and run the
# tests lane's integration tests only.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

scripts/services.sh up --redis-cluster
# Each test creates its own database and drops it when done; a test that
# crashed leaves one behind. Clear those before a run.
scripts/drop-databases.sh 'seckill\_test\_%'

command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup)" >&2; exit 1; }
THREADS=${SECKILL_TEST_THREADS:-8}
if [ $# -gt 0 ]; then
  exec cargo test --lib --bins --tests "$@" -- --test-threads="$THREADS"
fi

# Everything is built before the lanes start, so that neither waits on the
# other's build and a build never changes what a running test starts. The
# fault tests run from copies, without cargo (scripts/chaos.sh).
LOGS=target/test-logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
cargo build --bins
cargo test --no-run --lib --bins --tests --benches
scripts/chaos.sh --build-only
export SECKILL_CHAOS_BUILT=1

# step NAME CMD...: runs CMD, records its seconds and result in $LOGS/steps.
step() {
  local name=$1 began=$SECONDS status=0; shift
  printf '\n==> %s (at %d s)\n' "$name" $SECONDS
  "$@" || status=$?
  printf '%s\t%d\t%s\n' "$name" $((SECONDS - began)) \
    "$([ $status = 0 ] && echo passed || echo "FAILED ($status)")" >>"$LOGS/steps"
  printf '<== %s: %s in %d s\n' "$name" "$([ $status = 0 ] && echo passed || echo FAILED)" $((SECONDS - began))
  return 0
}

tests_lane() {
  step benches cargo test --benches
  # Integration tests mostly wait on I/O: more of them than there are cores.
  step tests cargo test --lib --bins --tests -- --test-threads="$THREADS"
  # The order path, payments, coupons, reconciliation, sharded activities,
  # many instances, the sold-out fast path and the waiting room once more,
  # on the Redis Cluster: every script and pipeline must keep its keys in
  # one slot, a sharded activity's shards sit on different masters, and a
  # release's message reaches every instance. Then, alone (20,000 buyers),
  # two API instances and a worker selling 1,000 units on it.
  local cluster_url
  cluster_url=$(scripts/services.sh cluster-url)
  step cluster env SECKILL__REDIS__MODE=cluster SECKILL__REDIS__URL="$cluster_url" \
    cargo test --test api -- --test-threads="$THREADS" \
    orders:: payments:: coupons:: reconcile:: shards:: instances:: sold_out:: waiting_room::
  step cluster-instances env SECKILL__REDIS__MODE=cluster SECKILL__REDIS__URL="$cluster_url" \
    cargo test --test api -- --ignored instances::two_api_instances
  # A short contract-fuzzing pass (scripts/fuzz.sh runs the full one).
  step fuzz env SECKILL_FUZZ_EXAMPLES="${SECKILL_FUZZ_EXAMPLES:-20}" scripts/fuzz.sh
  # The web console in headless Chromium (screenshots: target/console-screenshots/).
  step browser scripts/browser-test.sh
  # The README's waiting-room quick start, checked.
  step room-demo scripts/room-demo.sh --buyers 8
}

# The fault tests, one at a time on services of their own. The randomized
# one (nemesis) takes a new seed each run and prints it; a failure names the
# command that replays it. Then on a 3-master Redis Cluster: the Redis
# faults (a flush, a pause of every master) and the randomized test, whose
# Redis faults hit one master.
faults_lane() {
  step faults scripts/chaos.sh
  step faults-cluster scripts/chaos.sh --redis-cluster redis_flushed redis_paused nemesis
}

if [ "${SECKILL_TEST_LANES:-2}" = 1 ]; then
  tests_lane
  faults_lane
else
  # The faults lane's lines carry its name; its whole output is also in
  # $LOGS/faults.log.
  (faults_lane 2>&1 | tee "$LOGS/faults.log" | sed -u 's/^/[faults] /') &
  faults_pid=$!
  trap 'kill "$faults_pid" 2>/dev/null || true' INT TERM
  tests_lane
  wait "$faults_pid" || true
fi

printf '\n%-20s %8s  %s\n' step seconds result
awk -F'\t' '{ printf "%-20s %8d  %s\n", $1, $2, $3 }' "$LOGS/steps"
printf 'whole suite: %d s (services and build included)\n' $SECONDS
! grep -q FAILED "$LOGS/steps"
