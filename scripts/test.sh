#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs and starts Redis (one
# server and a 3-master cluster), PostgreSQL and Kafka (scripts/services.sh
# up --redis-cluster), builds everything once, then runs two lanes at once:
#
#   1  on those services: the criterion benches once in test mode, the unit
#      and integration tests, the Redis-Cluster pass, the contract fuzzing,
#      the console in headless Chromium and the waiting-room demo
#      (scripts/room-demo.sh); then the Redis faults and the randomized
#      fault test on a Redis Cluster;
#   2  every fault test on one Redis server.
#
# Each lane's fault tests run on a set of services of their own
# (scripts/chaos.sh). Every step runs even when an earlier one failed; the
# run ends with each step's time and result, and fails when any step did.
# SECKILL_TEST_LANES=1 runs the lanes one after the other (for a host too
# slow to share).
#
# Lane 1 ends with two fault tests on the engines of a real deployment
# (scripts/chaos.sh --replicated: three Kafka brokers at replication 3,
# and a PostgreSQL primary with a synchronous standby that fails over):
# the partition leader killed mid-sale, and two brokers of three down
# (writes refused, 503 with Retry-After, no restart loop, selling again
# once one is back: the promise a replicated deployment buys). `scripts/test.sh --full` runs
# every replicated fault test and the randomized one there instead (about
# 20 minutes more on the 2-core machine, past CI's budget of 35).
#
# Extra arguments go to `cargo test` (e.g. a test name filter) and run the
# integration tests of lane 1 only.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

scripts/services.sh up --redis-cluster --pg-replica
# Each test creates its own database and drops it when done; a test that
# crashed leaves one behind. Clear those before a run.
scripts/drop-databases.sh 'seckill\_test\_%'
# The OIDC issuer the identity tests run (tests/oidc, Node.js packages).
scripts/oidc-deps.sh

command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup)" >&2; exit 1; }
THREADS=${SECKILL_TEST_THREADS:-8}
FULL=
if [ "${1:-}" = --full ]; then FULL=1; shift; fi
# The WeChat Pay platform simulator the payment tests run as a process,
# and the official SDK's check of it (tests/wechatpay-sdk, Java).
cargo build --example wechatpay_sim
scripts/wechatpay-sdk.sh
# localstripe, the Stripe-style tests' server (PyPI, its own venv).
scripts/localstripe.sh >/dev/null
if [ $# -gt 0 ]; then
  exec cargo test --lib --bins --tests "$@" -- --test-threads="$THREADS"
fi

# Everything is built before the lanes start, so that neither waits on the
# other's build and a build never changes what a running test starts. The
# fault tests run from copies, without cargo (scripts/chaos.sh).
LOGS=target/test-logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
cargo test --no-run --lib --bins --tests --benches
scripts/chaos.sh --build-only
export SECKILL_CHAOS_BUILT=1 SECKILL_BUILT=1
export SECKILL_ALONE_LOCK="$ROOT/$LOGS/alone.lock"

# step NAME CMD...: runs CMD, records its seconds and result in $LOGS/steps.
# A step still running after SECKILL_STEP_SECS (2400 s: several times the
# slowest step on a slow host) is ended with everything it started and
# fails, and the run goes on: a hang costs one step's limit, never CI's.
STEP_SECS=${SECKILL_STEP_SECS:-2400}
step() {
  local name=$1 began=$SECONDS status=0 result; shift
  printf '\n==> %s (at %d s)\n' "$name" $SECONDS
  timeout --kill-after=30 "$STEP_SECS" "$@" || status=$?
  if [ $status = 0 ]; then
    result=passed
  elif [ $((SECONDS - began)) -ge "$STEP_SECS" ]; then
    result="FAILED (still running after $STEP_SECS s: ended)"
  else
    result="FAILED ($status)"
  fi
  printf '%s\t%d\t%s\n' "$name" $((SECONDS - began)) "$result" >>"$LOGS/steps"
  printf '<== %s: %s in %d s\n' "$name" "$result" $((SECONDS - began))
  return 0
}

tests_lane() {
  # The bench's verdict on a run of issue #44's open loop (saturated or
  # not), on made-up timelines: a check that can say "not saturated".
  step bench-verdict python3 scripts/timeline.py selftest
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
  # Alone for real: lane 2's fault tests each hold SECKILL_ALONE_LOCK
  # shared (tests/chaos/harness.rs), so this waits for the one running to
  # end, and the next waits for this one. Beside it a fault test's server,
  # broker and buyers were starved for seconds at a time.
  step cluster-instances flock -x "$SECKILL_ALONE_LOCK" \
    env SECKILL__REDIS__MODE=cluster SECKILL__REDIS__URL="$cluster_url" \
    cargo test --test api -- --ignored instances::two_api_instances
  # A short contract-fuzzing pass (scripts/fuzz.sh runs the full one).
  step fuzz env SECKILL_FUZZ_EXAMPLES="${SECKILL_FUZZ_EXAMPLES:-20}" scripts/fuzz.sh
  # The web console in headless Chromium (screenshots: target/console-screenshots/).
  step browser scripts/browser-test.sh
  # The README's waiting-room quick start, checked.
  step room-demo scripts/room-demo.sh --buyers 4 --pow-difficulty 2000000
}

# faults SET STEP [chaos.sh arguments...]: the fault tests, one at a time
# through scripts/chaos.sh on set of services SET (a: its defaults; b: ports
# 100 above them, another folder, logs under target/chaos/b). The
# randomized one (nemesis) takes a new seed each run and prints it; a
# failure names the command that replays it.
faults() {
  local set=$1 name=$2; shift 2
  if [ "$set" = a ] || [ "$set" = r ]; then
    step "$name" scripts/chaos.sh "$@"
  else
    step "$name" env SECKILL_CHAOS_SERVICES_DIR="$ROOT/.services-chaos-$set" \
      SECKILL_CHAOS_REDIS_URL=redis://127.0.0.1:6490 \
      SECKILL_CHAOS_POSTGRES_URL=postgres://seckill:seckill@127.0.0.1:5435/seckill \
      SECKILL_CHAOS_KAFKA=127.0.0.1:9292 SECKILL_CHAOS_LOGS="$ROOT/target/chaos/$set" \
      scripts/chaos.sh "$@"
  fi
}

# Lane 1: the tests, then on a 3-master Redis Cluster the Redis faults (a
# flush, a pause of every master) and the randomized test, whose Redis
# faults hit one master. Lane 2: every fault test on one Redis server.
lane_1() {
  tests_lane
  faults b faults-cluster --redis-cluster redis_flushed redis_paused nemesis
  if [ -n "$FULL" ]; then
    faults r faults-replicated --replicated replicated:: nemesis
  else
    faults r faults-replicated --replicated replicated::the_partition_leader_killed \
      replicated::two_brokers_down
  fi
}
lane_2() { faults a faults; }

if [ "${SECKILL_TEST_LANES:-2}" = 1 ]; then
  lane_1
  lane_2
else
  # Lane 2's lines carry its name and the suite's second they came at (a
  # fault test's time is the difference of its line and the next test's);
  # its whole output is also in $LOGS/.
  (lane_2 2>&1 | tee "$LOGS/faults.log" | while IFS= read -r line || [ -n "$line" ]; do
    printf '[faults %d s] %s\n' "$SECONDS" "$line"
  done) &
  pid_2=$!
  trap 'kill "$pid_2" 2>/dev/null || true' INT TERM
  lane_1
  wait "$pid_2" || true
fi

printf '\n%-20s %8s  %s\n' step seconds result
awk -F'\t' '{ printf "%-20s %8d  %s\n", $1, $2, $3 }' "$LOGS/steps"
printf 'whole suite: %d s (services and build included)\n' $SECONDS
! grep -q FAILED "$LOGS/steps"
