#!/usr/bin/env bash
# The fault tests (tests/chaos): each stops, kills or flushes a real
# process mid-sale and then checks the invariants. They run on a second set
# of services — other ports, another state folder — so the faults never
# touch the services the other tests use, and one at a time. The broker's
# data starts empty on every run.
#
#   scripts/chaos.sh [--redis-cluster | --replicated] [--seed N] [cargo test filter...]
#   scripts/chaos.sh --build-only
#
# --redis-cluster  Redis is a 3-master cluster (ports 7390..7392) instead of
#                  one server; the Redis faults hit its masters.
# --replicated     the engines of a real deployment, on a set of their own
#                  (.services-chaos-r): Kafka as three brokers and three
#                  controllers (9392, 9402, 9412; replication 3,
#                  min.insync.replicas 2) and PostgreSQL as a primary and a
#                  synchronous standby under pg_auto_failover (5436, 5437;
#                  monitor 5438), reached by a multi-host URL. The broker
#                  and PostgreSQL faults hit one broker (a partition's
#                  leader) or one node.
# --seed N         the seed of the randomized fault test (nemesis); without
#                  it, a new seed per run, printed first. Replay a failure:
#                  scripts/chaos.sh nemesis --seed N
# --build-only     builds what the tests run, and runs nothing
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

export SECKILL_ENV=test
export SECKILL_SERVICES_DIR=${SECKILL_CHAOS_SERVICES_DIR:-$ROOT/.services-chaos}
export SECKILL__REDIS__URL=${SECKILL_CHAOS_REDIS_URL:-redis://127.0.0.1:6390}
export SECKILL__POSTGRES__URL=${SECKILL_CHAOS_POSTGRES_URL:-postgres://seckill:seckill@127.0.0.1:5434/seckill}
export SECKILL__KAFKA__BROKERS=${SECKILL_CHAOS_KAFKA:-127.0.0.1:9192}
export SECKILL_CHAOS=1

filters=() build_only= skips=(--skip replicated::)
while [ $# -gt 0 ]; do
  case "$1" in
    --seed) export SECKILL_NEMESIS_SEED=${2:?--seed N}; shift 2 ;;
    --seed=*) export SECKILL_NEMESIS_SEED=${1#--seed=}; shift ;;
    --redis-cluster) export SECKILL__REDIS__MODE=cluster; shift ;;
    --replicated)
      export SECKILL_SERVICES_DIR=${SECKILL_CHAOS_SERVICES_DIR:-$ROOT/.services-chaos-r}
      export SECKILL__REDIS__URL=${SECKILL_CHAOS_REDIS_URL:-redis://127.0.0.1:6590}
      export SECKILL__POSTGRES__URL=${SECKILL_CHAOS_POSTGRES_URL:-postgres://seckill:seckill@127.0.0.1:5436,127.0.0.1:5437/seckill?target_session_attrs=read-write&connect_timeout=3}
      export SECKILL__KAFKA__BROKERS=${SECKILL_CHAOS_KAFKA:-127.0.0.1:9392,127.0.0.1:9402,127.0.0.1:9412}
      export SECKILL__KAFKA__REPLICATION_FACTOR=3 SECKILL__KAFKA__MIN_INSYNC_REPLICAS=2
      # The brokers' replica.lag.time.max.ms (scripts/services.d/kafka-cluster.sh).
      export SECKILL__KAFKA__REPLICA_LAG_MAX_MS=10000
      export SECKILL_CHAOS_LOGS=${SECKILL_CHAOS_LOGS:-$ROOT/target/chaos/replicated}
      skips=()
      shift ;;
    --build-only) build_only=1; shift ;;
    *) filters+=("$1"); shift ;;
  esac
done
if [ "${SECKILL__REDIS__MODE:-}" = cluster ]; then
  # The cluster's masters sit 1000 above the single server's port.
  single=${SECKILL__REDIS__URL##*:}
  single=${single%%/*}
  SECKILL__REDIS__URL=$(for i in 0 1 2; do printf 'redis://127.0.0.1:%d\n' $((single + 1000 + i)); done | paste -sd, -)
  export SECKILL__REDIS__URL
fi

# The tests start a copy of the binary: a build during a run (they take
# minutes) does not change what a restarted server runs. The test
# executable is copied too and runs without cargo, which holds the build
# directory's lock while its tests run: scripts/test.sh runs other tests
# beside these (it builds first, with --build-only, then sets
# SECKILL_CHAOS_BUILT).
# The nemesis pays through the WeChat Pay platform simulator (copied the
# same way) and localstripe.
if [ -z "${SECKILL_CHAOS_BUILT:-}" ]; then
  exe=$(cargo test --test chaos --no-run --message-format=json | scripts/test-exe.py chaos)
  cargo build --example wechatpay_sim
  mkdir -p target/chaos
  cp target/debug/seckill target/chaos/seckill-under-test
  cp target/debug/examples/wechatpay_sim target/chaos/wechatpay-sim
  cp "$exe" target/chaos/chaos-tests
fi
[ -z "$build_only" ] || exit 0
export SECKILL_CHAOS_BIN=$ROOT/target/chaos/seckill-under-test
export SECKILL_CHAOS_SIM=$ROOT/target/chaos/wechatpay-sim
scripts/localstripe.sh >/dev/null

scripts/services.sh stop kafka
rm -rf "$SECKILL_SERVICES_DIR/kafka/data" "$SECKILL_SERVICES_DIR"/kafka-cluster/*/data
scripts/services.sh up

# Databases of fault tests that crashed.
scripts/drop-databases.sh 'seckill\_chaos\_%'

# The replicated tests need the replicated services (--replicated): on one
# of everything they are left out, not failed.
status=0
target/chaos/chaos-tests --ignored --test-threads=1 --nocapture "${skips[@]}" "${filters[@]}" || status=$?
# The second set of services is only for these tests: give the memory back.
scripts/services.sh down
exit $status
