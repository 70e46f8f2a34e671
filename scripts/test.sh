#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs and starts Redis (one
# server and a 3-master cluster), PostgreSQL and Kafka (scripts/services.sh
# up --redis-cluster), builds everything once, then runs three lanes at once:
#
#   1  on those services: the criterion benches once in test mode, the unit
#      and integration tests, the Redis-Cluster pass, the contract fuzzing,
#      the console in headless Chromium and the waiting-room demo
#      (scripts/room-demo.sh); then fault tests of group C;
#   2  the fault tests of group A (with the randomized one);
#   3  the fault tests of group B, then the Redis faults and the randomized
#      test on a Redis Cluster.
#
# Each group of fault tests runs on a set of services of its own
# (scripts/chaos.sh). They spend most of their time waiting on a fault (a
# paused broker, a server coming back), so on two cores the lanes side by
# side take little more than the longest. Every step runs even when an
# earlier one failed; the run ends with each step's time and result, and
# fails when any step did. SECKILL_TEST_LANES=1 runs the lanes one after
# the other (for a host too slow to share).
#
# Extra arguments go to `cargo test` (e.g. a test name filter) and run the
# integration tests of lane 1 only.
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

# The fault tests, one at a time per set of services, in three groups that
# take about as long as each other, each group on a set of its own (other
# ports, another folder), so that they run side by side. The randomized one
# (nemesis) takes a new seed each run and prints it; a failure names the
# command that replays it.
GROUP_A=(nemesis the_broker_paused_round redis_killed_mid_sale redis_paused a_coupon_claim a_wedged room::)
GROUP_B=(the_broker_killed redis_flushed the_broker_paused_for postgres_restarted)
GROUP_C=(two_api_instances the_server_killed)
# Each fault test in exactly one group: a new one must be placed.
while IFS= read -r name; do
  n=0
  for f in "${GROUP_A[@]}" "${GROUP_B[@]}" "${GROUP_C[@]}"; do [[ $name == *"$f"* ]] && n=$((n + 1)); done
  [ "$n" = 1 ] || { echo "fault test $name is in $n groups of scripts/test.sh, not 1" >&2; exit 1; }
done < <(target/chaos/chaos-tests --list --ignored | sed -n 's/: test$//p')

# faults SET STEP [chaos.sh arguments...]: scripts/chaos.sh on set SET (a:
# its defaults, b and c: ports 100 and 200 above them).
faults() {
  local set=$1 name=$2 up=0; shift 2
  case $set in b) up=100 ;; c) up=200 ;; esac
  if [ $up = 0 ]; then
    step "$name" scripts/chaos.sh "$@"
  else
    step "$name" env SECKILL_CHAOS_SERVICES_DIR="$ROOT/.services-chaos-$set" \
      SECKILL_CHAOS_REDIS_URL="redis://127.0.0.1:$((6390 + up))" \
      SECKILL_CHAOS_POSTGRES_URL="postgres://seckill:seckill@127.0.0.1:$((5434 + up / 100))/seckill" \
      SECKILL_CHAOS_KAFKA="127.0.0.1:$((9192 + up))" SECKILL_CHAOS_LOGS="$ROOT/target/chaos/$set" \
      scripts/chaos.sh "$@"
  fi
}

# Three lanes: the tests, then group C; group A; group B, then on a 3-master
# Redis Cluster the Redis faults (a flush, a pause of every master) and the
# randomized test, whose Redis faults hit one master.
lane_1() { tests_lane; faults c faults-c "${GROUP_C[@]}"; }
lane_2() { faults a faults-a "${GROUP_A[@]}"; }
lane_3() {
  faults b faults-b "${GROUP_B[@]}"
  faults b faults-cluster --redis-cluster redis_flushed redis_paused nemesis
}

if [ "${SECKILL_TEST_LANES:-3}" = 1 ]; then
  lane_1
  lane_2
  lane_3
else
  # A lane's lines carry its name; its whole output is also in $LOGS/.
  (lane_2 2>&1 | tee "$LOGS/faults-a.log" | sed -u 's/^/[faults-a] /') &
  pid_2=$!
  (lane_3 2>&1 | tee "$LOGS/faults-b.log" | sed -u 's/^/[faults-b] /') &
  pid_3=$!
  trap 'kill "$pid_2" "$pid_3" 2>/dev/null || true' INT TERM
  lane_1
  wait "$pid_2" "$pid_3" || true
fi

printf '\n%-20s %8s  %s\n' step seconds result
awk -F'\t' '{ printf "%-20s %8d  %s\n", $1, $2, $3 }' "$LOGS/steps"
printf 'whole suite: %d s (services and build included)\n' $SECONDS
! grep -q FAILED "$LOGS/steps"
