#!/usr/bin/env bash
# One side of an A/B: runs a `seckill` binary (this one, or an older build
# with its own config folder) under the load generator of this checkout.
#
#   scripts/ab.sh admission BIN [CONFIG_DIR] [STOCK]  # BIN serve, then loadgen: 20 000 buyers (AB_USERS=N: N)
#   scripts/ab.sh drain BIN [CONFIG_DIR]              # 50 000 queued orders, then time BIN consume
#
# An older build: `git worktree add /tmp/old REV && (cd /tmp/old &&
# CARGO_TARGET_DIR=/tmp/old-target cargo build --release --bin seckill)`,
# then `scripts/ab.sh admission /tmp/old-target/release/seckill /tmp/old/config`.
# Alternate the two sides, several runs each: the spread of one side is
# part of the answer (see docs/BENCHMARKS-HISTORY.md).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
MODE=${1:?admission|drain}; BIN=${2:?a seckill binary}; CONF=${3:-$ROOT/config}; STOCK=${4:-20000}

scripts/services.sh up >/dev/null
eval "$(python3 scripts/settings.py)"
cargo build --release --quiet --bin seckill
NEW=target/release/seckill
RUN=ab$(date +%s%N | cut -c1-13)
export SECKILL__LOG__LEVEL=warn SECKILL__REDIS__KEY_PREFIX="$RUN:" SECKILL__KAFKA__TOPIC_PREFIX="$RUN."
export PGPASSWORD=$PG_PASSWORD
DB=seckill_ab
export SECKILL__POSTGRES__URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$DB"
psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -qtA \
  -c "drop database if exists $DB with (force)" -c "create database $DB"
# The schema of the side under test: in a drain, BIN's consumer writes the
# orders (an older build may predate a migration, e.g. the partitioned
# order table); the admission side only reads them.
if [ "$MODE" = drain ]; then "$BIN" migrate >/dev/null; else $NEW migrate >/dev/null; fi
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; scripts/services.sh forget "$RUN:" >/dev/null 2>&1 || true' EXIT
serve() { # PORT BIN CONFIG_DIR ARGS...: serve in the background until ready
  local port=$1 bin=$2 conf=$3; shift 3
  env SECKILL_CONFIG_DIR="$conf" SECKILL__APP__PORT="$port" "$@" "$bin" serve ${SERVE_ARGS:-} >"/tmp/$RUN-serve.log" 2>&1 &
  PIDS+=($!)
  until curl -sf "http://127.0.0.1:$port/health/ready" >/dev/null; do sleep 0.2; done
}

case "$MODE" in
  admission)
    serve 18091 "$BIN" "$CONF"
    $NEW loadgen --url http://127.0.0.1:18091 --users "${AB_USERS:-20000}" --stock "$STOCK" --concurrency 256 --cpu-pid "${PIDS[-1]}" --json 2>/dev/null \
      | tail -1 | python3 -c "import json,sys; r=json.load(sys.stdin); print('$BIN', round(r['per_sec']), 'purchases/s, p50', round(r['p50_ms'],1), 'ms, p99', round(r['p99_ms'],1), 'ms;', round(r['server_cpu_us_per_request'],1), 'µs server CPU per request;', round(r['tokens_per_sec']), 'tokens/s; invariants', r['invariants_ok'])"
    ;;
  drain)
    N=50000
    SERVE_ARGS=--no-consumer serve 18090 "$NEW" "$ROOT/config" SECKILL__ADMISSION__MAX_CONSUMER_LAG=0 SECKILL__KAFKA__CONSUMER_STALL_SECS=0
    OUT=$($NEW loadgen --url http://127.0.0.1:18090 --users $N --stock $N --concurrency 256 --first-user 5000000 --no-check --json 2>/dev/null | tail -1)
    ACT=$(echo "$OUT" | python3 -c "import json,sys; print(json.load(sys.stdin)['activity_id'])")
    ADMIN=$($NEW token --admin)
    T0=$(date +%s.%N)
    env SECKILL_CONFIG_DIR="$CONF" "$BIN" consume >"/tmp/$RUN-consume.log" 2>&1 &
    PIDS+=($!)
    # A string match per poll, not a python3 (which took CPU from the drain);
    # two of them, as the stats' fields may come in any order.
    drained() {
      [[ $1 == *"\"WAITING_PAY\":$N"[,\}]* && $1 == *'"reservations_open":0'[,\}]* ]]
    }
    until drained "$(curl -s "http://127.0.0.1:18090/api/v1/admin/activities/$ACT/stats" -H "Authorization: Bearer $ADMIN")"; do
      sleep 0.05
    done
    T1=$(date +%s.%N)
    python3 -c "print('$BIN', $N, 'orders in', round($T1-$T0,2), 's:', round($N/($T1-$T0)), 'orders/s')"
    ;;
  *) echo "usage: $0 admission|drain BIN [CONFIG_DIR] [STOCK]" >&2; exit 2 ;;
esac
