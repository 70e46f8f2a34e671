#!/usr/bin/env bash
# Admission and drain on the replicated engines beside the single ones, in
# ONE run: the same Redis, the same binary, the same load, once against one
# Kafka broker and one PostgreSQL (scripts/services.sh up) and once against
# three brokers at replication 3 with min.insync.replicas 2 and a
# PostgreSQL primary with a synchronous standby (up --kafka-cluster
# --pg-ha, on ports of their own: brokers 9492/9502/9512, PostgreSQL
# 5446/5447, monitor 5448, state in .services-bench-r/).
#
#   scripts/bench-replicated.sh [--users N] [--stock S] [--concurrency C] [--drain N]
#
# Rows, for each topology:
#   admission  purchases per second through `serve` (one Lua call in Redis,
#              the event acknowledged by the broker: acks=all waits for two
#              replicas on the cluster)
#   drain      orders per second written by a worker-only consumer from a
#              queue of N accepted orders (each batch's transaction commits
#              on the primary and, synchronous, on the standby)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

USERS=20000 STOCK=1000 CONC=256 DRAIN=20000
while [ $# -gt 0 ]; do
  case "$1" in
    --users) USERS=$2; shift 2 ;;
    --stock) STOCK=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --drain) DRAIN=$2; shift 2 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
bench_setup bench-replicated --bin seckill
trap 'cleanup; scripts/services.sh forget "$RUN:" >/dev/null 2>&1 || true' EXIT
# Each topology has a database of its own (activity ids start at 1 in
# both): their Redis keys and topics are kept apart by prefix too.

SINGLE_KAFKA=$KAFKA_HOST:$KAFKA_PORT
SINGLE_PG=$SECKILL__POSTGRES__URL
R_KAFKA=127.0.0.1:9492,127.0.0.1:9502,127.0.0.1:9512
R_PG_BASE="postgres://$PG_USER:$PG_PASSWORD@127.0.0.1:5446,127.0.0.1:5447"
R_PARAMS="target_session_attrs=read-write&connect_timeout=3"

say "starting the replicated engines"
SECKILL_SERVICES_DIR="$ROOT/.services-bench-r" SECKILL__KAFKA__BROKERS=$R_KAFKA \
  SECKILL__POSTGRES__URL="$R_PG_BASE/seckill?$R_PARAMS" \
  scripts/services.sh up --kafka-cluster --pg-ha >/dev/null
psql_r() { psql "postgres://postgres@127.0.0.1:5446,127.0.0.1:5447/postgres?$R_PARAMS" -qtA "$@"; }
psql_r -c "drop database if exists $DB with (force)"
psql_r -c "create database $DB owner $PG_USER"
R_PG="$R_PG_BASE/$DB?$R_PARAMS"
SECKILL__POSTGRES__URL=$R_PG $BIN migrate >/dev/null

loadgen() { $BIN loadgen --json "$@" 2>/dev/null | tee -a "$OUT/loadgen.txt" | tail -n 1; }
drained() {
  [[ $1 == *"\"WAITING_PAY\":$2"[,\}]* && $1 == *'"reservations_open":0'[,\}]* ]]
}
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])$2)" "$1"; }

# topology NAME BROKERS PG_URL RF ISR FIRST_USER: sets ADMISSION_<NAME> and
# DRAIN_<NAME> (per second).
topology() {
  local name=$1 first=$6
  local env=(env SECKILL__KAFKA__BROKERS="$2" SECKILL__POSTGRES__URL="$3"
    SECKILL__KAFKA__REPLICATION_FACTOR="$4" SECKILL__KAFKA__MIN_INSYNC_REPLICAS="$5"
    SECKILL__KAFKA__TOPIC_PREFIX="$RUN.$name." SECKILL__REDIS__KEY_PREFIX="$RUN:$name:")
  say "$name: admission, $USERS buyers, $STOCK units, concurrency $CONC"
  start "serve-$name" 18080 "${env[@]}" SECKILL__APP__PORT=18080 $BIN serve
  local ours
  ours=$(loadgen --url http://127.0.0.1:18080 --users "$USERS" --stock "$STOCK" --concurrency "$CONC" \
    --first-user "$first")
  stop_all
  printf -v "ADMISSION_$name" '%s' "$ours"

  say "$name: drain of $DRAIN queued orders"
  start "queue-$name" 18080 "${env[@]}" SECKILL__APP__PORT=18080 SECKILL__ADMISSION__MAX_CONSUMER_LAG=0 \
    SECKILL__KAFKA__CONSUMER_STALL_SECS=0 $BIN serve --no-consumer
  local queued act t0 t1
  queued=$(loadgen --url http://127.0.0.1:18080 --users "$DRAIN" --stock "$DRAIN" --concurrency "$CONC" \
    --first-user "$((first + 1000000))" --no-check)
  act=$(field "$queued" "['activity_id']")
  t0=$(date +%s.%N)
  "${env[@]}" $BIN consume >"$OUT/consume-$name.log" 2>&1 &
  PIDS+=($!)
  until drained "$(curl -s "http://127.0.0.1:18080/api/v1/admin/activities/$act/stats" \
    -H "Authorization: Bearer $ADMIN")" "$DRAIN"; do sleep 0.05; done
  t1=$(date +%s.%N)
  stop_all
  printf -v "DRAIN_$name" '%s' "$(python3 -c "print(round($DRAIN / ($t1 - $t0)))")"
}

topology single "$SINGLE_KAFKA" "$SINGLE_PG" 1 1 20000000
topology replicated "$R_KAFKA" "$R_PG" 3 2 40000000

python3 - "$ADMISSION_single" "$ADMISSION_replicated" "$DRAIN_single" "$DRAIN_replicated" \
  "$USERS" "$STOCK" "$CONC" "$DRAIN" <<'EOF'
import json, sys
a1, a3 = json.loads(sys.argv[1]), json.loads(sys.argv[2])
d1, d3 = float(sys.argv[3]), float(sys.argv[4])
users, stock, conc, drain = sys.argv[5:9]
print(f"\n{users} buyers for {stock} units at concurrency {conc}; a drain of {drain} queued orders\n")
print("| row | one broker, one PostgreSQL | three brokers (RF 3, min ISR 2), primary + synchronous standby | replicated / single |")
print("|---|---|---|---|")
print(f"| admission (purchases/s) | {a1['per_sec']:,.0f} | {a3['per_sec']:,.0f} | {a3['per_sec']/a1['per_sec']:.2f} |")
print(f"| admission p50 / p99 ms, all purchases | {a1['p50_ms']:.1f} / {a1['p99_ms']:.1f} | {a3['p50_ms']:.1f} / {a3['p99_ms']:.1f} | {a3['p99_ms']/a1['p99_ms']:.2f} (p99) |")
print(f"| admission p99 ms, accepted (202) only | {a1['p99_accepted_ms']:.1f} | {a3['p99_accepted_ms']:.1f} | {a3['p99_accepted_ms']/a1['p99_accepted_ms']:.2f} |")
print(f"| accepted | {a1['accepted']:,} | {a3['accepted']:,} | - |")
print(f"| drain (orders/s) | {d1:,.0f} | {d3:,.0f} | {d3/d1:.2f} |")
EOF
echo "logs: $OUT"
