#!/usr/bin/env bash
# The waiting room's benchmark (BENCHMARKS.md, "Finished investigations"), in ONE run,
# each figure beside the ceiling it is measured against:
#
#   scripts/bench-room.sh [--users N] [--concurrency C] [--tickets T]
#                         [--sale-buyers B] [--sale-only | --slowed-only]
#
#   1 ceiling: redis-benchmark running room_join.lua and room_status.lua
#     (EVALSHA) on a room of their own
#   2 ours over HTTP: joins (challenge, solve at difficulty 1, join) and
#     status reads (GET …/queue/me), examples/room_load.rs
#   3 T tickets (1,000,000 by default) in one room, filled by
#     redis-benchmark through room_join.lua: Redis memory per ticket
#     (MEMORY USAGE of its hashes), and the p99 of a status read from
#     redis-benchmark and over HTTP
#   4 a whole sale (`seckill loadgen --bots`): B buyers (100,000), 1,000 of
#     them bots, for 1,000 units: first as a race without a room (the
#     baseline), then through a room admitting 2,000/s, then the same with
#     max_active 1,000. The bots' share of the units, the admitted rate
#     against the configured one, the p99 of the purchases. Then the room
#     sale twice more with the order consumers in a process of their own,
#     slowed by SIGSTOP for 900 ms of every second, and purchases refused
#     at a lag of LAG_BOUND (300): adaptive admission off (the baseline),
#     then on. The highest lag sampled, the time spent above the bound and
#     the purchases refused 503 BUSY. --sale-only runs this step alone,
#     --slowed-only its slowed sales alone.
#
# On the services of scripts/services.sh (SECKILL__* moves them), in a
# database, key prefix and topic prefix of its own.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

USERS=20000 CONC=64 TICKETS=1000000 SALE_BUYERS=100000 SALE_ONLY= SLOWED_ONLY=
while [ $# -gt 0 ]; do
  case "$1" in
    --sale-buyers) SALE_BUYERS=$2; shift 2 ;;
    --sale-only) SALE_ONLY=1; shift ;;
    --slowed-only) SLOWED_ONLY=1; shift ;;
    --users) USERS=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --tickets) TICKETS=$2; shift 2 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
bench_setup room --bin seckill --example room_load
trap 'cleanup; scripts/services.sh forget "$RUN:" >/dev/null 2>&1 || true' EXIT
LOAD=target/release/examples/room_load
R="redis-cli -h $REDIS_HOST -p $REDIS_PORT"
URL=http://127.0.0.1:18090

# rps OUTPUT: the requests per second redis-benchmark printed.
rps() { tr '\r' '\n' <<<"$1" | grep -o '[0-9.]* requests per second' | tail -n 1 | cut -d' ' -f1; }
# p99 OUTPUT: its p99 latency in ms (the latency summary's p99 column).
p99() { tr '\r' '\n' <<<"$1" | awk '/latency summary/ {getline; getline; print $5; exit}'; }

start serve 18090 env SECKILL__APP__PORT=18090 $BIN serve
NOW=$(date -u +%s)
ACT=$(curl -s "$URL/api/v1/admin/activities" -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' -d "{
  \"sku_id\": 1, \"name\": \"room bench\", \"price_cents\": 100, \"stock\": 1000,
  \"start_at\": \"$(date -u -d @$((NOW - 60)) +%FT%TZ)\", \"end_at\": \"$(date -u -d @$((NOW + 7200)) +%FT%TZ)\",
  \"waiting_room\": {\"prequeue_secs\": 0, \"admit_per_sec\": 1, \"pass_ttl_secs\": 600,
                     \"offer_secs\": 60, \"pow_difficulty\": 1}}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["activity_id"])')
curl -s -o /dev/null "$URL/api/v1/admin/activities/$ACT/warmup" -H "Authorization: Bearer $ADMIN" -X POST

# The whole sale: each side on its own activity, on the same server.
sale() { $BIN loadgen --json --url "$URL" --users "$SALE_BUYERS" --stock 1000 --bots 1000 "$@" 2>>"$OUT/sale.err" | tail -n 1; }
whole_sale() {
  say "4/4 a whole sale: $SALE_BUYERS buyers (1,000 bots), 1,000 units"
  local race room capped
  race=$(sale)
  room=$(sale --room --admit-per-sec 2000 --prequeue-secs 60)
  capped=$(sale --room --admit-per-sec 2000 --max-active 1000 --prequeue-secs 60)
  python3 - "$race" "$room" "$capped" <<'PY'
import json, sys
rows = [json.loads(a) for a in sys.argv[1:]]
print("\n| sale | bots' share of the units | admitted by the sell-out | admitted rate (configured 2,000/s) | purchases p99 (max) | invariants |")
print("|---|---|---|---|---|---|")
for name, r in zip(["race, no room (baseline)", "room, 2,000/s", "room, 2,000/s, max_active 1,000"], rows):
    s = r["sale"]
    adm = f"{s['admitted_at_sell_out']:,} in {s['sell_out_secs']:.2f} s" if s["waiting_room"] else "-"
    rate = f"{s['admitted_per_sec']:,.0f}/s (fastest second {s['admitted_max_per_sec']:,.0f}/s)" if s["waiting_room"] else "-"
    ok = "OK" if r.get("invariants_ok") else "FAILED"
    print(f"| {name} | {s['bot_share']:.1%} ({s['bot_units']} of {s['bot_units'] + s['people_units']}) | {adm} | {rate} | {s['purchase_p99_ms']:.0f} ms ({s['purchase_max_ms']:.0f} ms) | {ok} |")
PY
}
# The room sale again, the consumers slowed: adaptive admission off, then on.
LAG_BOUND=${LAG_BOUND:-300}
slowed_sale() { # ADAPTIVE(true|false) PORT: one JSON line, the sale's and the lag's
  local adaptive=$1 port=$2 url=http://127.0.0.1:$2 pids=()
  start "slowed-$adaptive" "$port" env SECKILL__APP__PORT="$port" SECKILL__ORDERS__CONSUMER_ENABLED=false \
    SECKILL__ADMISSION__MAX_CONSUMER_LAG="$LAG_BOUND" SECKILL__ADMISSION__LAG_SAMPLE_MS=100 \
    SECKILL__WAITING_ROOM__ADAPTIVE="$adaptive" $BIN serve
  pids+=("${PIDS[-1]}")
  $BIN consume >"$OUT/consume-$adaptive.log" 2>&1 &
  local consumer=$!
  pids+=("$consumer")
  # Slowed: stopped 900 ms of every second.
  (while kill -0 "$consumer" 2>/dev/null; do
     kill -STOP "$consumer" 2>/dev/null; sleep 0.9; kill -CONT "$consumer" 2>/dev/null; sleep 0.1
   done) &
  pids+=($!)
  # The lag as the server samples it, every 100 ms.
  (while :; do
     curl -s "$url/metrics" | awk -v t="$(date +%s.%N)" '/^seckill_order_consumer_lag /{print t, $2}'
     sleep 0.1
   done >"$OUT/lag-$adaptive.txt") &
  pids+=($!)
  local sale_json
  sale_json=$($BIN loadgen --json --url "$url" --users "$SALE_BUYERS" --stock 1000 --bots 1000 \
    --room --admit-per-sec 2000 --prequeue-secs 60 2>>"$OUT/sale.err" | tail -n 1)
  local busy
  busy=$(curl -s "$url/metrics" | awk '/^seckill_admission_total\{outcome="busy"\}/{print $2}')
  kill -CONT "$consumer" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  python3 - "$sale_json" "$OUT/lag-$adaptive.txt" "${busy:-0}" "$adaptive" <<'PY'
import json, sys
sale = json.loads(sys.argv[1])
lag = [tuple(map(float, l.split())) for l in open(sys.argv[2]) if len(l.split()) == 2]
bound = float(__import__("os").environ.get("LAG_BOUND", "300"))
above = sum(b[0] - a[0] for a, b in zip(lag, lag[1:]) if a[1] > bound)
print(json.dumps({"adaptive": sys.argv[4] == "true", "sale": sale,
                  "lag_max": max((v for _, v in lag), default=0), "lag_samples": len(lag),
                  "above_secs": above, "busy": int(float(sys.argv[3]))}))
PY
}
slowed_sales() {
  say "4b a whole sale with the consumers slowed (stopped 900 ms a second), purchases refused at lag $LAG_BOUND"
  # The server above consumes too, in the same group: stopped first.
  stop_all
  local off on
  off=$(slowed_sale false 18091)
  on=$(slowed_sale true 18092)
  LAG_BOUND=$LAG_BOUND python3 - "$off" "$on" <<'PY'
import json, os, sys
bound = int(os.environ["LAG_BOUND"])
print(f"\n| sale, consumers slowed | highest lag (bound {bound}) | time above the bound | purchases refused 503 BUSY | bots' share | admitted rate | sold out after | purchases p99 | invariants |")
print("|---|---|---|---|---|---|---|---|---|")
for r in map(json.loads, sys.argv[1:]):
    s = r["sale"]["sale"]
    name = "room, 2,000/s, adaptive admission" if r["adaptive"] else "room, 2,000/s, adaptive off (baseline)"
    ok = "OK" if r["sale"].get("invariants_ok") else "FAILED"
    print(f"| {name} | {r['lag_max']:.0f} ({r['lag_samples']} samples) | {r['above_secs']:.1f} s | {r['busy']:,} | {s['bot_share']:.1%} | {s['admitted_per_sec']:,.0f}/s | {s['sell_out_secs']:.1f} s | {s['purchase_p99_ms']:.0f} ms | {ok} |")
PY
}
if [ -n "$SALE_ONLY" ]; then whole_sale; slowed_sales; exit 0; fi
if [ -n "$SLOWED_ONLY" ]; then slowed_sales; exit 0; fi

say "1/4 redis-benchmark: room_join.lua and room_status.lua at -c $CONC"
JOIN_SHA=$($R SCRIPT LOAD "$(cat src/admission/lua/room_close.lua src/admission/lua/room_join.lua)")
STATUS_SHA=$($R SCRIPT LOAD "$(cat src/admission/lua/room_status.lua)")
OPEN_SHA=$($R SCRIPT LOAD "$(cat src/admission/lua/room_open.lua)")
room_keys() { local k="$RUN:{a:$1}:"; echo "${k}room ${k}room:users ${k}room:entrants ${k}room:st"; }
open_room() {
  local k="$RUN:{a:$1}:"
  # shellcheck disable=SC2046
  $R EVALSHA "$OPEN_SHA" 6 $(room_keys "$1") "${k}room:active" "${k}room:offers" \
    1 0 0 99999999999999 1 0 600000 60000 00 >/dev/null
}
join_bench() { # ACTIVITY N RANGE: joins of random users in 0..RANGE
  local k="$RUN:{a:$1}:"
  # shellcheck disable=SC2046
  redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" -c "$CONC" -n "$2" -r "$3" --threads 1 $4 \
    EVALSHA "$JOIN_SHA" 6 "${k}room" "${k}room:users" "${k}room:st" "${k}room:pow:__rand_int__" "${k}room:joins:1" "${k}room:entrants" \
    __rand_int__ 1700000000000 1000
}
status_bench() { # ACTIVITY N RANGE
  local k="$RUN:{a:$1}:"
  redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" -c "$CONC" -n "$2" -r "$3" --threads 1 \
    EVALSHA "$STATUS_SHA" 3 "${k}room" "${k}room:users" "${k}room:st" __rand_int__
}
open_room 900000001
JOIN_CEIL=$(rps "$(join_bench 900000001 300000 1000000000 -q)")
STATUS_CEIL=$(rps "$(status_bench 900000001 300000 300000)")

say "2/4 ours over HTTP: $USERS joins, then status reads for 15 s, at $CONC"
JOIN=$($LOAD join "$URL" "$ACT" 1 "$USERS" "$CONC")
STATUS=$($LOAD status "$URL" "$ACT" 1 "$USERS" "$CONC" 15)

say "3/4 $TICKETS tickets in one room: memory and status p99"
open_room 900000002
join_bench 900000002 $((TICKETS * 3)) "$TICKETS" -q >/dev/null
K="$RUN:{a:900000002}:"
HELD=$($R HLEN "${K}room:users")
MEM=$($R MEMORY USAGE "${K}room:users" SAMPLES 0)
BIG_STATUS=$(status_bench 900000002 200000 "$TICKETS")
BIG_P99=$(p99 "$BIG_STATUS")
BIG_RPS=$(rps "$BIG_STATUS")
# The server's own room filled the same way, then read over HTTP.
join_bench "$ACT" $((TICKETS * 3)) "$TICKETS" -q >/dev/null
BIG_HTTP=$($LOAD status "$URL" "$ACT" 1 "$((TICKETS - 1))" "$CONC" 15)

python3 - "$JOIN_CEIL" "$STATUS_CEIL" "$JOIN" "$STATUS" "$HELD" "$MEM" "$BIG_P99" "$BIG_RPS" "$BIG_HTTP" "$CONC" <<'EOF'
import json, sys
jc, sc = float(sys.argv[1]), float(sys.argv[2])
join, status = json.loads(sys.argv[3]), json.loads(sys.argv[4])
held, mem = int(sys.argv[5]), int(sys.argv[6])
big_p99, big_rps = sys.argv[7], float(sys.argv[8])
big = json.loads(sys.argv[9])
conc = sys.argv[10]
# A join over HTTP is two requests (the challenge, then the join).
joins = join["per_sec"] / 2
print(f"\n| row | measured | ceiling (same run) | share |")
print(f"|---|---|---|---|")
print(f"| joins over HTTP (challenge + join, c={conc}) | {joins:,.0f} joins/s (p99 {join['p99_ms']:.1f} ms, {join['failed']} failed) | redis-benchmark room_join.lua {jc:,.0f}/s | {joins/jc:.0%} |")
print(f"| status reads over HTTP | {status['per_sec']:,.0f}/s (p99 {status['p99_ms']:.1f} ms) | redis-benchmark room_status.lua {sc:,.0f}/s | {status['per_sec']/sc:.0%} |")
print(f"| {held:,} tickets in one room: memory | {mem/held:.0f} bytes per ticket (the users hash, {mem/2**20:.0f} MiB) | - | - |")
print(f"| {held:,} tickets: status read p99 | redis-benchmark {big_p99} ms at {big_rps:,.0f}/s; over HTTP {big['p99_ms']:.1f} ms at {big['per_sec']:,.0f}/s | the same script on an empty room: {sc:,.0f}/s | - |")
EOF
whole_sale
slowed_sales
