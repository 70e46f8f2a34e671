#!/usr/bin/env bash
# The Redis fallback's throughput against the naive baseline, in ONE run
# (docs/BENCHMARKS-HISTORY.md, "The database fallback"):
#   F1 the naive baseline (examples/naive.rs) under the load generator
#   F2 `seckill serve` whose Redis was killed (SIGKILL) after the warm-up,
#      selling through the database fallback with its rate limit lifted
#      (what the path can do; the default limit is set from F1)
#   F3 the same at the default admission.fallback_rate_per_sec
# The same buyers, stock and concurrency for each; the invariants of F2 and
# F3 are checked in SQL (Redis is down, so the stats route cannot).
#
#   scripts/bench-fallback.sh [--users N] [--stock S] [--concurrency C]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

USERS=20000 STOCK=1000 CONC=256
while [ $# -gt 0 ]; do
  case "$1" in
    --users) USERS=$2; shift 2 ;;
    --stock) STOCK=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
bench_setup bench-fallback --bin seckill --example naive
# The fallback servers get a Redis of their own, which the run kills.
REDIS_PORT=16391
trap 'cleanup; redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true' EXIT
loadgen() { $BIN loadgen --json "$@" 2>>"$OUT/loadgen.err" | tee -a "$OUT/loadgen.txt" | tail -n 1; }

say "F1 naive baseline: $USERS buyers, $STOCK units, concurrency $CONC"
start naive 18091 env SECKILL__APP__PORT=18091 target/release/examples/naive
NAIVE=$(loadgen --url http://127.0.0.1:18091 --users "$USERS" --stock "$STOCK" --concurrency "$CONC" --db-only)
stop_all

# fallback NAME PORT RATE FIRST_USER: a server on a fresh Redis, an activity
# warmed into it, the Redis killed, the fallback proven, then the sale.
fallback() {
  local name=$1 port=$2 rate=$3 first=$4 url="http://127.0.0.1:$2"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --daemonize yes --save "" --appendonly no \
    --dir "$OUT" --pidfile "$OUT/redis.pid" --logfile "$OUT/redis.log"
  until [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]; do sleep 0.1; done
  # Short Kafka timeouts (as the fault tests have them): the fallback
  # starts message_timeout + publish_budget after the outage.
  start "$name" "$port" env SECKILL__APP__PORT="$port" SECKILL__REDIS__URL="redis://127.0.0.1:$REDIS_PORT" \
    SECKILL__ADMISSION__FALLBACK_RATE_PER_SEC="$rate" SECKILL__KAFKA__MESSAGE_TIMEOUT_MS=5000 \
    SECKILL__ADMISSION__PUBLISH_BUDGET_MS=3000 SECKILL__RECONCILE__PUBLISH_WINDOW_SECS=13 $BIN serve
  until curl -sf "$url/health/ready" >/dev/null; do sleep 0.2; done
  local now start end id
  start=$(date -u -d '-60 seconds' +%FT%TZ) end=$(date -u -d '+1 hour' +%FT%TZ)
  id=$(curl -sf -H "Authorization: Bearer $ADMIN" -H 'content-type: application/json' \
    -d "{\"sku_id\":1,\"name\":\"fallback bench\",\"price_cents\":100,\"stock\":$STOCK,\"start_at\":\"$start\",\"end_at\":\"$end\",\"per_user_limit\":1}" \
    "$url/api/v1/admin/activities" | python3 -c 'import json,sys; print(json.load(sys.stdin)["activity_id"])')
  curl -sf -H "Authorization: Bearer $ADMIN" -H 'content-type: application/json' -d '{}' \
    "$url/api/v1/admin/activities/$id/warmup" >/dev/null
  kill -9 "$(cat "$OUT/redis.pid")"
  say "$name: Redis killed; waiting for the fallback"
  # Its tokens are signed ones once its purchases go to the database.
  local buyer
  buyer=$($BIN token --user 1)
  fb_token() { curl -s -H "Authorization: Bearer $buyer" "$url/api/v1/activities/$id/token" | grep -q '"token":"fb\.'; }
  for _ in $(seq 1 300); do fb_token && break; sleep 0.2; done
  fb_token || { echo "the fallback never started; see $OUT/$name.log" >&2; exit 1; }
  local result
  result=$(loadgen --url "$url" --users "$USERS" --activity "$id" --concurrency "$CONC" --first-user "$first" --no-check)
  # The invariants, from the database: I7 on the stock row, every accepted
  # purchase a WAITING_PAY order of the database's instance id, nobody over
  # the limit, nothing sold twice.
  local check
  check=$(psql_bench -F' ' -c "SELECT s.total, s.available, s.locked, s.sold, \
      (SELECT count(*) FROM orders WHERE activity_id = $id AND status = 'WAITING_PAY'), \
      (SELECT count(*) FROM orders WHERE activity_id = $id AND (order_no >> 12) & 1023 = 1023), \
      (SELECT count(*) FROM (SELECT user_id FROM orders WHERE activity_id = $id GROUP BY user_id HAVING count(*) > 1) d) \
    FROM stock s WHERE s.activity_id = $id")
  stop_all
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  echo "$result|$check"
}

say "F2 the database fallback, rate limit lifted"
F2=$(fallback fallback 18092 1000000 1000000)
say "F3 the database fallback at the default rate"
DEFAULT_RATE=$(python3 -c 'import tomllib; print(tomllib.load(open("config/default.toml","rb"))["admission"]["fallback_rate_per_sec"])')
F3=$(fallback fallback-default 18093 "$DEFAULT_RATE" 2000000)

python3 - "$NAIVE" "$F2" "$F3" "$USERS" "$STOCK" "$CONC" "$DEFAULT_RATE" <<'EOF'
import json, sys
naive = json.loads(sys.argv[1])
users, stock, conc, rate = sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
def parse(arg):
    result, check = arg.split("|")
    total, avail, locked, sold, waiting, by_db, twice = map(int, check.split())
    r = json.loads(result)
    ok = (total == avail + locked + sold and locked == waiting == by_db == r["accepted"]
          and r["accepted"] <= int(stock) and twice == 0)
    return r, ok, f"accepted {r['accepted']}, WAITING_PAY {waiting}, by the database {by_db}, I7 {total} = {avail} + {locked} + {sold}"
f2, ok2, why2 = parse(sys.argv[2])
f3, ok3, why3 = parse(sys.argv[3])
lat = lambda r: f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}"
print(f"\n{users} buyers, {stock} units, concurrency {conc}, one run:\n")
print("| row | throughput | p50 / p99 ms | invariants |")
print("|---|---|---|---|")
print(f"| F1 naive baseline (sync DB transaction per purchase) | {naive['per_sec']:,.0f} purchases/s | {lat(naive)} | {'pass' if naive.get('invariants_ok') else 'FAIL'} |")
print(f"| F2 database fallback, Redis killed, rate limit lifted | {f2['per_sec']:,.0f} purchases/s | {lat(f2)} | {'pass' if ok2 else 'FAIL'} ({why2}) |")
print(f"| F3 database fallback at the default {int(rate):,}/s per activity | {f3['per_sec']:,.0f} answers/s, {f3['limited']:,} answered 429 | {lat(f3)} | {'pass' if ok3 else 'FAIL'} ({why3}) |")
print(f"| F2 / F1 | {f2['per_sec']/naive['per_sec']:.2f}x | | |")
sys.exit(0 if ok2 and ok3 and naive.get('invariants_ok') else 1)
EOF
