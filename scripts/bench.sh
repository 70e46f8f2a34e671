#!/usr/bin/env bash
# The side-by-side benchmark: our admission path against the local limits of
# this machine and against the naive synchronous design, in ONE run.
#
#   scripts/bench.sh [--users N] [--stock S] [--concurrency C] [--drain N]
#                    [--pg-seconds S]
#   scripts/bench.sh --profile      # perf profiles and flame graphs of admission and drain, no table
#   scripts/bench.sh --hot-only N   # rows 7a-7d only, N times, alternating
#   scripts/bench.sh --open-only N  # rows 2, 5 and 5c only, N times: the open loop's
#                                   # latency and the CPU per request, each run's
#                                   # timeline drawn (scripts/timeline.py); rows 2
#                                   # and 5 again at 5x the requests (the refusal
#                                   # path, past the sale's first 0.2 s); the last
#                                   # column says whether 5c met issue #44's targets
#                                   # and, if not, what its timeline shows was
#                                   # saturated (scripts/timeline.py verdict)
#   scripts/bench.sh --timeline     # as --open-only 1, and the chart goes to
#                                   # docs/open-loop-timeline.svg
#   scripts/bench.sh --open-only N --open-rate R
#                                   # row 5c at R purchases/s, not half of row 5's
#                                   # peak: an A/B at one rate (a setting switched
#                                   # by its SECKILL__ variable between two runs)
#
# Rows (see BENCHMARKS.md):
#   1 ceiling: redis-benchmark running our reserve script (EVALSHA)
#   2 ceiling: a trivial actix-web handler (examples/plain.rs) under the load generator
#   3 ceiling: pgbench inserting order-shaped rows, one per transaction and 100 per transaction;
#     3c: the three rows one order of the drain writes, 100 orders per transaction
#   4 the naive baseline (examples/naive.rs) under the load generator
#   5 our admission path under the load generator
#   5s the same with a unit for every buyer: every purchase accepted (the
#      publish, the acknowledgement and the order consumer's share)
#   5c an open loop (fixed arrival rate, latency from the intended send
#      time, HDR histogram) at half of row 5's peak, 4x the buyers
#   5b the same over 2 instances: two `serve --no-consumer` and one `consume`
#   6 consumer drain rate, Kafka → PostgreSQL, batched
#   7 one hot activity on the 3-master Redis Cluster: its keys in one slot
#     (1 shard, one master) against 3 shards (one per master); the same
#     sale, and a sale where every buyer gets a unit
# Before the rows, one unmeasured sale warms the Kafka broker's JIT
# (WARM_UNITS units, every buyer served; WARM_UNITS=0 skips it).
# Everything runs on this machine (loopback), in a database, Redis key prefix
# and Kafka topic prefix of its own; the services come from scripts/services.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

USERS=20000 STOCK=1000 CONC=256 DRAIN=50000 PG_SECONDS=10 PROFILE=0 HOT_ONLY=0 OPEN_ONLY=0 OPEN_RATE="" CHART=""
while [ $# -gt 0 ]; do
  case "$1" in
    --users) USERS=$2; shift 2 ;;
    --stock) STOCK=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --drain) DRAIN=$2; shift 2 ;;
    --pg-seconds) PG_SECONDS=$2; shift 2 ;;
    --profile) PROFILE=1; shift ;;
    --hot-only) HOT_ONLY=$2; shift 2 ;;
    --open-only) OPEN_ONLY=$2; shift 2 ;;
    --open-rate) OPEN_RATE=$2; shift 2 ;;
    --timeline) OPEN_ONLY=1; CHART=docs/open-loop-timeline.svg; shift ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
bench_setup bench --bin seckill --example naive --example plain
# At the end, this run's Redis keys go too (reservations live for days).
trap 'cleanup; scripts/services.sh forget "$RUN:" >/dev/null 2>&1 || true' EXIT
# The load generator's JSON report (its last line).
loadgen() { $BIN loadgen --json "$@" 2>/dev/null | tee -a "$OUT/loadgen.txt" | tail -n 1; }
# drained STATS_JSON N: every one of N orders WAITING_PAY, no reservation
# open. A string match, not a python3 per poll: polling every 50 ms with
# python (behind a pyenv shim) took a fifth of the machine from the drain
# it timed.
drained() {
  [[ $1 == *"\"WAITING_PAY\":$2"[,\}]* && $1 == *'"reservations_open":0'[,\}]* ]]
}
# queue_orders FIRST_USER: an API-only server with $DRAIN accepted orders on
# the topic and no consumer; sets ACT (their activity). The point is a
# queue: consumer backpressure (the lag limit, and the stall check that
# would answer BUSY once nothing has consumed for kafka.consumer_stall_secs)
# off.
queue_orders() {
  start serve 18080 env SECKILL__APP__PORT=18080 SECKILL__ADMISSION__MAX_CONSUMER_LAG=0 \
    SECKILL__KAFKA__CONSUMER_STALL_SECS=0 $BIN serve --no-consumer
  local queued
  queued=$(loadgen --url http://127.0.0.1:18080 --users "$DRAIN" --stock "$DRAIN" --concurrency "$CONC" \
    --first-user "$1" --no-check)
  ACT=$(field "$queued" "['activity_id']")
}
# The activity's stats, from the server queue_orders started.
stats() {
  curl -s "http://127.0.0.1:18080/api/v1/admin/activities/$ACT/stats" -H "Authorization: Bearer $ADMIN"
}
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])$2)" "$1"; }

# --profile: perf samples (cpu-clock: this kind of machine has no hardware
# counters) of one process with DWARF call stacks, a flat report and a
# flame graph (inferno, installed from crates.io when missing).
# profile_start NAME PID: one process, DWARF stacks. profile_start NAME all:
# every process of the machine (frame-pointer stacks, enough to tell the
# processes apart: the drain's time is mostly PostgreSQL's, not ours).
profile_start() {
  if [ "$2" = all ]; then
    perf record -a -e cpu-clock -F 499 -g -o "$OUT/$1.perf" >/dev/null 2>&1 &
  else
    perf record -e cpu-clock -F 499 --call-graph dwarf,16384 -p "$2" -o "$OUT/$1.perf" >/dev/null 2>&1 &
  fi
  PERF=$!
}
profile_stop() {
  kill -INT "$PERF"; wait "$PERF" 2>/dev/null || true
  perf report -i "$OUT/$1.perf" --stdio --no-children -g none --sort comm,dso,symbol 2>/dev/null \
    | grep -E '^ +[0-9]' | sed 's/ *$//' | head -n 60 >"$OUT/$1-profile.txt" || true
  command -v inferno-flamegraph >/dev/null || cargo install --quiet --locked inferno >&2
  perf script -i "$OUT/$1.perf" 2>/dev/null | inferno-collapse-perf >"$OUT/$1.folded"
  inferno-flamegraph --title "seckill $1 ($(git rev-parse --short HEAD))" <"$OUT/$1.folded" >"$OUT/$1.svg"
}

# Row 7: one hot activity on the 3-master cluster, SHARDS STOCK FIRST_USER.
# Its report gets `master_cpu`: each master's CPU seconds over the run's wall
# seconds (sale and drain), busiest first: how close a Redis thread came to
# being the limit.
hot() {
  scripts/services.sh up --redis-cluster >/dev/null
  local cluster; cluster=$(scripts/services.sh cluster-url)
  start hot 18085 env SECKILL__APP__PORT=18085 SECKILL__REDIS__MODE=cluster SECKILL__REDIS__URL="$cluster" $BIN serve
  local c0 c1 t0 t1 out
  c0=$(masters_cpu "$cluster"); t0=$(date +%s.%N)
  out=$(loadgen --url http://127.0.0.1:18085 --users "$USERS" --stock "$2" --concurrency "$CONC" --shards "$1" --first-user "$3")
  t1=$(date +%s.%N); c1=$(masters_cpu "$cluster")
  stop_all
  python3 -c '
import json, sys
r = json.loads(sys.argv[1]); c0, c1 = sys.argv[2].split(), sys.argv[3].split()
wall = float(sys.argv[5]) - float(sys.argv[4])
r["master_cpu"] = sorted((round((float(b) - float(a)) / wall, 2) for a, b in zip(c0, c1)), reverse=True)
print(json.dumps(r))' "$out" "$c0" "$c1" "$t0" "$t1"
}
# CPU seconds (user + sys) each master of the cluster URL has used so far.
masters_cpu() {
  for port in $(echo "$1" | grep -o ':[0-9]*' | tr -d ':'); do
    redis-cli -h 127.0.0.1 -p "$port" INFO cpu | awk -F: '/^used_cpu_(sys|user):/ {s += $2} END {printf "%.3f ", s}'
  done
}
# Row 2 [REQUESTS]: the trivial handler; its CPU per request is read from /proc.
row2() {
  start plain 18082 target/release/examples/plain 127.0.0.1:18082
  loadgen --ceiling-url http://127.0.0.1:18082/api/v1/activities/1/orders --users "${1:-$USERS}" --concurrency "$CONC" \
    --cpu-pid "${PIDS[-1]}"
  stop_all
}
# Row 5, FIRST_USER [BUYERS [UNITS]]: our admission path, closed loop;
# row 5s is it with a unit for every buyer (every purchase accepted).
row5() {
  start serve 18080 env SECKILL__APP__PORT=18080 $BIN serve
  loadgen --url http://127.0.0.1:18080 --users "${2:-$USERS}" --stock "${3:-$STOCK}" --concurrency "$CONC" --first-user "$1" \
    --cpu-pid "${PIDS[-1]}"
  stop_all
}
# Row 5c, RATE FIRST_USER TAG: the open loop, four times the buyers (at
# half the peak, $USERS would last about two seconds, and the start would
# be all of its tail). The buyers hold OPEN_CONNS connections when it
# starts (loadgen --connections) and no more: a purchase due while all are
# out waits for one, its wait counted (--max-in-flight). Both sides write a timeline, a sampler
# reads every process's CPU, and scripts/timeline.py draws
# $OUT/TAG-timeline.svg. The load generator runs one worker thread
# (OPEN_LG_THREADS): a fixed rate needs no more, and with one per core it
# took both cores from the server as the units sold (docs/BENCHMARKS-HISTORY.md).
OPEN_CONNS=2048
# The first FIRST_MS of 5c's burst, when its units sell: every process's
# CPU run and run-queue wait (scripts/first-moment.py).
FIRST_MS=250
row5c() {
  local tag=$3 out
  start serve 18080 env SECKILL__APP__PORT=18080 $BIN serve --timeline "$OUT/$tag-server.csv"
  local serve_pid=${PIDS[-1]}
  $BIN loadgen --json --url http://127.0.0.1:18080 --users $((USERS * 4)) --stock "$STOCK" --rate "$1" \
    --first-user "$2" --connections "$OPEN_CONNS" --max-in-flight "$OPEN_CONNS" --threads "${OPEN_LG_THREADS:-1}" \
    --cpu-pid "$serve_pid" --timeline "$OUT/$tag-client.csv" 2>"$OUT/$tag-loadgen.err" >"$OUT/$tag-loadgen.txt" &
  local lg=$!
  python3 scripts/timeline.py sample "$OUT/$tag-procs.csv" "serve=$serve_pid" "loadgen=$lg" &
  local sampler=$!
  python3 scripts/first-moment.py "$OUT/$tag-loadgen.err" "$FIRST_MS" "serve=$serve_pid" "loadgen=$lg" \
    >"$OUT/$tag-first.json" 2>/dev/null &
  local first=$!
  wait "$lg" || true
  wait "$first" || true
  kill "$sampler"; wait "$sampler" 2>/dev/null || true
  stop_all
  local verdict
  verdict=$(python3 scripts/timeline.py verdict "$OUT/$tag-loadgen.txt" "$OUT/$tag-client.csv" \
    "$OUT/$tag-server.csv" "$OUT/$tag-first.json" 2>"$OUT/$tag-verdict.err") ||
    verdict="no verdict: the timelines could not be read ($OUT/$tag-verdict.err)"
  out=$(python3 -c '
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
try:
    r["first_moment"] = json.loads(open(sys.argv[2]).read())
except (OSError, ValueError):
    r["first_moment"] = None
r["verdict"] = sys.argv[3]
print(json.dumps(r))' "$OUT/$tag-loadgen.txt" "$OUT/$tag-first.json" "$verdict")
  python3 scripts/timeline.py draw "$OUT/$tag-timeline.svg" "$OUT/$tag-client.csv" "$OUT/$tag-server.csv" \
    "$OUT/$tag-procs.csv" --title "seckill open loop at $1/s, $STOCK units ($(git rev-parse --short HEAD))" >&2
  echo "$out"
}

# The broker's JIT compiler: a young Kafka JVM still compiles its produce
# and fetch paths during the first sales it serves, and at a sale's first
# moment that took up to 195 ms of CPU in 270 ms (docs/BENCHMARKS-HISTORY.md,
# "How to measure on this machine"). A shop's broker has served millions of
# messages before its sale; this run's gets one sale in which every buyer
# is served before anything is measured.
WARM_UNITS=${WARM_UNITS:-100000}
warm_up() {
  say "warming the broker: a sale of $WARM_UNITS units, every buyer served (not measured)"
  start serve 18080 env SECKILL__APP__PORT=18080 $BIN serve
  loadgen --url http://127.0.0.1:18080 --users "$WARM_UNITS" --stock "$WARM_UNITS" --concurrency "$CONC" \
    --first-user 90000000 >/dev/null
  stop_all
}
[ "$PROFILE" = 1 ] || [ "$WARM_UNITS" = 0 ] || warm_up

if [ "$OPEN_ONLY" != 0 ]; then
  say "rows 2, 5 and 5c, $OPEN_ONLY times; rows 2 and 5 again at $((USERS * 5)) requests"
  echo "| run | 2 trivial handler | 5 ours | 5 / 2 | CPU µs per request, server / loadgen: 2; 5 | 2 and 5 at 5x the requests | 5 / 2 there | 5c offered | 5c done | p50 / p90 / p99 / p99.9 ms | p99 of the 202s | p99 of refusals | 5c CPU µs per request | host busy | 5c's first $FIRST_MS ms: CPU run (waiting) ms, serve / loadgen / kafka / redis / postgres; of the CPU there was | 5c's targets (p90 ≤ 10, p99 ≤ 50, 202s ≤ 100 ms) |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  for i in $(seq 1 "$OPEN_ONLY"); do
    base=$((40000000 + i * 1000000))
    two=$(row2); five=$(row5 $base)
    # At five times the requests the same 1,000 units sell in the same
    # fraction of a second: the rest is the refusal path, measured over
    # seconds instead of a burst of 0.4-0.8 s.
    two_long=$(row2 $((USERS * 5))); five_long=$(row5 $((base + 500000)) $((USERS * 5)))
    half=${OPEN_RATE:-$(python3 -c "import json,sys; print(round(json.loads(sys.argv[1])['per_sec'] / 2))" "$five")}
    open=$(row5c "$half" $((base + 100000)) "open-$i")
    python3 - "$i" "$two" "$five" "$two_long" "$five_long" "$open" <<'EOF'
import json, sys
i, two, five, two_l, five_l, o = sys.argv[1], *(json.loads(a) for a in sys.argv[2:])
c = lambda r: f"{r['server_cpu_us_per_request']:.1f} / {r['loadgen_cpu_us_per_request']:.1f}"
def first(m):
    if not m:
        return "-"
    names = ("serve", "loadgen", "kafka", "redis", "postgres")
    each = " / ".join(f"{m['run_ms'].get(n, 0):.0f} ({m['wait_ms'].get(n, 0):.0f})" for n in names)
    return f"{each}; {sum(m['run_ms'].values()) / (m['cpus'] * m['ms']):.0%} of {m['cpus'] * m['ms']:.0f}"
bad = [r for r in (five, five_l, o) if r.get('invariants_ok') is not True]
print(f"| {i} | {two['per_sec']:,.0f}/s | {five['per_sec']:,.0f}/s | {five['per_sec']/two['per_sec']:.0%} | {c(two)}; {c(five)} "
      f"| {two_l['per_sec']:,.0f}/s; {five_l['per_sec']:,.0f}/s | {five_l['per_sec']/two_l['per_sec']:.0%} "
      f"| {o['rate']:,.0f}/s | {o['per_sec']:,.0f}/s | {o['p50_ms']:.1f} / {o['p90_ms']:.1f} / {o['p99_ms']:.1f} / {o['p999_ms']:.1f} "
      f"| {o['p99_accepted_ms']:.1f} | {o['p99_refused_ms']:.1f} | {c(o)} | {o['host_busy']:.0%} | {first(o.get('first_moment'))} | {o.get('verdict', '-')} |"
      + (" INVARIANTS FAILED" if bad else ""))
EOF
  done
  if [ -n "$CHART" ]; then
    cp "$OUT/open-$OPEN_ONLY-timeline.svg" "$CHART"
    echo "chart: $CHART"
  fi
  echo "timelines: $OUT/open-*-timeline.svg"
  exit 0
fi

if [ "$PROFILE" = 1 ]; then
  # Profiles only (perf slows what it watches: no table from this run).
  # Admission: ten times the buyers of row 5, so the sold-out steady state
  # gets thousands of samples. Drain: row 6's queue.
  P_USERS=$((USERS * 10))
  say "profile: admission, $P_USERS buyers, $STOCK units, concurrency $CONC"
  start serve 18080 env SECKILL__APP__PORT=18080 $BIN serve
  # Sampled from the purchases on: the token phase before them is not
  # the admission path.
  SERVE_PID=${PIDS[-1]}
  $BIN loadgen --json --url http://127.0.0.1:18080 --users "$P_USERS" --stock "$STOCK" --concurrency "$CONC" \
    --first-user 20000000 >"$OUT/profile-loadgen.json" 2>"$OUT/profile-loadgen.err" &
  LG=$!
  until grep -q '^buying:' "$OUT/profile-loadgen.err"; do sleep 0.05; done
  profile_start admission "$SERVE_PID"
  wait "$LG"
  profile_stop admission
  tail -n 1 "$OUT/profile-loadgen.json" >&2
  stop_all
  say "profile: drain of $DRAIN queued orders"
  queue_orders 30000000
  $BIN consume >"$OUT/consume.log" 2>&1 &
  PIDS+=($!)
  profile_start drain all
  until drained "$(stats)" "$DRAIN"; do sleep 0.05; done
  profile_stop drain
  stop_all
  echo "profiles: $OUT/{admission,drain}-profile.txt; flame graphs: $OUT/{admission,drain}.svg"
  exit 0
fi

if [ "$HOT_ONLY" != 0 ]; then
  say "rows 7a-7d, $HOT_ONLY times, alternating 1 and 3 shards"
  echo "| run | 7a 1 shard | 7b 3 shards | 7b/7a | 7c 1 shard, all served | 7d 3 shards, all served | 7d/7c |"
  echo "|---|---|---|---|---|---|---|"
  for i in $(seq 1 "$HOT_ONLY"); do
    base=$((8000000 + i * 400000))
    a=$(hot 1 "$STOCK" $base); b=$(hot 3 "$STOCK" $((base + 100000)))
    c=$(hot 1 "$USERS" $((base + 200000))); d=$(hot 3 "$USERS" $((base + 300000)))
    python3 - "$i" "$a" "$b" "$c" "$d" <<'EOF'
import json, sys
i, *r = sys.argv[1:]
a, b, c, d = (json.loads(x) for x in r)
bad = [x for x in (a, b, c, d) if x.get('invariants_ok') is not True]
f = lambda x: f"{x['per_sec']:,.0f}/s (masters {'/'.join(str(c) for c in x['master_cpu'])})"
print(f"| {i} | {f(a)} | {f(b)} | {b['per_sec']/a['per_sec']:.2f}x | {f(c)} | {f(d)} | {d['per_sec']/c['per_sec']:.2f}x |" + (" INVARIANTS FAILED" if bad else ""))
EOF
  done
  exit 0
fi

say "1/7 redis-benchmark: reserve.lua (sold-out path) at -c $CONC"
R="redis-cli -h $REDIS_HOST -p $REDIS_PORT"
SHA=$($R SCRIPT LOAD "$(cat src/admission/lua/reserve.lua)")
K="$RUN:{a:0}:"
$R HSET "${K}meta" start_ms 0 end_ms 99999999999999 limit 1 buckets 1 >/dev/null
$R SET "${K}stock:0" 0 >/dev/null
$R SET "${K}token:t" 42 >/dev/null
REDIS_RPS=$(redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" -c "$CONC" -n 300000 -r 1000000000 --threads 1 -q \
  EVALSHA "$SHA" 8 "${K}meta" "${K}reqs" "${K}users" "${K}token:t" "${K}res:1" "${K}open" "${K}dry" "${K}stock:0" \
  42 req__rand_int__ 1 1 1700000000000 0 600 | tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -n 1 | cut -d' ' -f1)

say "2/7 trivial actix-web handler under the load generator"
PLAIN=$(row2)

say "3/7 pgbench: order-shaped inserts for ${PG_SECONDS}s each"
psql_bench -c "insert into activities (sku_id, name, price_cents, start_at, end_at, per_user_limit, pay_timeout_secs, buckets)
  values (1, 'pgbench', 100, now(), now() + interval '1 day', 1, 900, 1)"
AID=$(psql_bench -c "select max(id) from activities")
psql_bench -c "create sequence if not exists bench_seq"
cat >"$OUT/single.sql" <<EOF
INSERT INTO orders (order_no, user_slot, request_id, activity_id, user_id, quantity, amount_cents, status, pay_deadline)
SELECT n, (n & 15)::smallint, 'r' || n, $AID, n, 1, 100, 'WAITING_PAY', now() + interval '15 minutes' FROM (SELECT nextval('bench_seq') AS n) s;
EOF
cat >"$OUT/batch.sql" <<EOF
INSERT INTO orders (order_no, user_slot, request_id, activity_id, user_id, quantity, amount_cents, status, pay_deadline)
SELECT n, (n & 15)::smallint, 'r' || n, $AID, n, 1, 100, 'WAITING_PAY', now() + interval '15 minutes'
FROM (SELECT nextval('bench_seq') AS n FROM generate_series(1, 100)) s;
EOF
# What one order of the drain writes, 100 orders per transaction: its row,
# its consume_log row and its stock_flow LOCK row (the stock row update is
# per batch, left out).
cat >"$OUT/batch3.sql" <<EOF
WITH s AS (SELECT nextval('bench_seq') AS n FROM generate_series(1, 100)),
o AS (INSERT INTO orders (order_no, user_slot, request_id, activity_id, user_id, quantity, amount_cents, status, pay_deadline)
  SELECT n, (n & 15)::smallint, 'r' || n, $AID, n, 1, 100, 'WAITING_PAY', now() + interval '15 minutes' FROM s RETURNING order_no),
c AS (INSERT INTO consume_log (event_id, consumer) SELECT 'e' || order_no, 'pgbench' FROM o)
INSERT INTO stock_flow (activity_id, biz_type, biz_no, quantity) SELECT $AID, 'LOCK', order_no, 1 FROM o;
EOF
pgb() { pgbench -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -n -c 16 -j 2 -T "$PG_SECONDS" -f "$1" "$DB" 2>&1 \
  | grep -E '^tps' | head -n 1 | grep -oE '[0-9]+\.[0-9]+' | head -n 1; }
PG_SINGLE_TPS=$(pgb "$OUT/single.sql")
PG_BATCH_TPS=$(pgb "$OUT/batch.sql")
PG_ORDER_TPS=$(pgb "$OUT/batch3.sql")
PG_ORDERS=$(python3 -c "print(round($PG_ORDER_TPS * 100))")
PG_SINGLE=$(python3 -c "print(round($PG_SINGLE_TPS))")
PG_BATCH=$(python3 -c "print(round($PG_BATCH_TPS * 100))")

say "4/7 naive baseline: $USERS buyers, $STOCK units, concurrency $CONC"
start naive 18081 env SECKILL__APP__PORT=18081 target/release/examples/naive
NAIVE=$(loadgen --url http://127.0.0.1:18081 --users "$USERS" --stock "$STOCK" --concurrency "$CONC" --db-only)
stop_all

say "5/7 seckill admission: $USERS buyers, $STOCK units, concurrency $CONC"
OURS=$(row5 1000000)
say "5s/7 our admission path, a unit for every buyer (every purchase accepted)"
SERVED=$(row5 1100000 "$USERS" "$USERS")

HALF=$(python3 -c "import json,sys; print(round(json.loads(sys.argv[1])['per_sec'] / 2))" "$OURS")
say "5c/7 open loop at half of row 5's peak: $HALF purchases/s, $((USERS * 4)) buyers, $STOCK units"
OPEN=$(row5c "$HALF" 10000000 open)

say "5b/7 two API instances and a worker: $USERS buyers spread over both"
start api1 18083 env SECKILL__APP__PORT=18083 $BIN serve --no-consumer
start api2 18084 env SECKILL__APP__PORT=18084 $BIN serve --no-consumer
$BIN consume >"$OUT/consume2.log" 2>&1 &
PIDS+=($!)
TWO=$(loadgen --url http://127.0.0.1:18083 --url http://127.0.0.1:18084 --users "$USERS" --stock "$STOCK" \
  --concurrency "$CONC" --first-user 3000000)
stop_all

say "6/7 consumer drain: $DRAIN accepted orders queued, then a worker-only consumer"
queue_orders 5000000
T0=$(date +%s.%N)
$BIN consume >"$OUT/consume.log" 2>&1 &
PIDS+=($!)
until drained "$(stats)" "$DRAIN"; do sleep 0.05; done
T1=$(date +%s.%N)
DRAIN_RATE=$(python3 -c "print(round($DRAIN / ($T1 - $T0)))")
DRAIN_SECS=$(python3 -c "print(round($T1 - $T0, 2))")
stop_all

say "7/7 one hot activity on the 3-master Redis Cluster: 1 shard against 3"
HOT1=$(hot 1 "$STOCK" 7000000)
HOT3=$(hot 3 "$STOCK" 7100000)
HOT1F=$(hot 1 "$USERS" 7200000)
HOT3F=$(hot 3 "$USERS" 7300000)

python3 - "$REDIS_RPS" "$PLAIN" "$PG_SINGLE" "$PG_BATCH" "$NAIVE" "$OURS" "$DRAIN_RATE" "$DRAIN_SECS" "$DRAIN" "$USERS" "$STOCK" "$CONC" "$TWO" \
  "$HOT1" "$HOT3" "$HOT1F" "$HOT3F" "$OPEN" "$PG_ORDERS" "$SERVED" <<'EOF'
import json, sys
redis, plain, pg1, pgb, naive, ours, drain, drain_s, drain_n, users, stock, conc, two = sys.argv[1:14]
plain, naive, ours, two = json.loads(plain), json.loads(naive), json.loads(ours), json.loads(two)
hot1, hot3, hot1f, hot3f, opn = (json.loads(a) for a in sys.argv[14:19])
pgo = int(sys.argv[19])
served = json.loads(sys.argv[20])
redis, pg1, pgb, drain = float(redis), int(pg1), int(pgb), int(drain)
def lat(r): return f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}"
def hotput(r): return f"{r['per_sec']:,.0f} purchases/s; masters' CPU {'/'.join(str(c) for c in r['master_cpu'])} of a core"
ok = lambda r: {True: "pass", False: "FAIL", None: "-"}[r.get('invariants_ok')]
rows = [
  ("1 ceiling: redis-benchmark, reserve.lua EVALSHA (sold-out path)", f"{redis:,.0f} calls/s", "-", "-"),
  ("2 ceiling: trivial actix-web handler, same load generator", f"{plain['per_sec']:,.0f} req/s", lat(plain), "-"),
  ("3 ceiling: pgbench order inserts, 1 row/txn", f"{pg1:,} rows/s", "-", "-"),
  ("3 ceiling: pgbench order inserts, 100 rows/txn", f"{pgb:,} rows/s", "-", "-"),
  ("3c ceiling: pgbench, an order's three rows (orders, consume_log, stock_flow), 100 orders/txn", f"{pgo:,} orders/s", "-", "-"),
  ("4 naive baseline (sync DB transaction per purchase)", f"{naive['per_sec']:,.0f} purchases/s", lat(naive), ok(naive)),
  ("5 seckill admission (Redis Lua + Kafka)", f"{ours['per_sec']:,.0f} purchases/s", lat(ours), ok(ours)),
  (f"5s as 5, {users} units (every buyer served)", f"{served['per_sec']:,.0f} purchases/s", lat(served), ok(served)),
  (f"5c open loop at {opn['rate']:,.0f}/s (half of 5), {opn['requests']:,} buyers; p50 / p90 / p99 / p99.9 ms from the intended send time; p99 of the 202s {opn['p99_accepted_ms']:.1f} ms", f"{opn['per_sec']:,.0f} purchases/s", f"{opn['p50_ms']:.1f} / {opn['p90_ms']:.1f} / {opn['p99_ms']:.1f} / {opn['p999_ms']:.1f}", ok(opn)),
  ("5b seckill admission, 2 instances (2 x serve --no-consumer + consume)", f"{two['per_sec']:,.0f} purchases/s", lat(two), ok(two)),
  (f"6 consumer drain, Kafka -> PostgreSQL ({drain_n} orders in {drain_s}s)", f"{drain:,} orders/s", "-", "-"),
  ("7a one hot activity, Redis Cluster, 1 shard (one master)", hotput(hot1), lat(hot1), ok(hot1)),
  ("7b one hot activity, Redis Cluster, 3 shards (one per master)", hotput(hot3), lat(hot3), ok(hot3)),
  (f"7c as 7a, {users} units (every buyer served)", hotput(hot1f), lat(hot1f), ok(hot1f)),
  (f"7d as 7b, {users} units (every buyer served)", hotput(hot3f), lat(hot3f), ok(hot3f)),
]
print(f"\nscenario: {users} buyers, {stock} units, concurrency {conc}\n")
print("| row | throughput | p50 / p99 ms | invariants |")
print("|---|---|---|---|")
for r in rows: print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |")
print()
print("| ratio | value |")
print("|---|---|")
print(f"| ours / redis-benchmark ceiling | {ours['per_sec']/redis:.0%} |")
print(f"| ours / trivial HTTP handler ceiling | {ours['per_sec']/plain['per_sec']:.0%} |")
cpu = lambda r: r['server_cpu_us_per_request']
print(f"| server CPU per request, ours (5) / trivial handler (2) | {cpu(ours):.1f} / {cpu(plain):.1f} µs = {cpu(ours)/cpu(plain):.1f}x |")
print(f"| server CPU per request, every buyer served (5s) / trivial handler (2) | {cpu(served):.1f} / {cpu(plain):.1f} µs = {cpu(served)/cpu(plain):.1f}x |")
print(f"| load generator CPU per request, 5 / 2 | {ours['loadgen_cpu_us_per_request']:.1f} / {plain['loadgen_cpu_us_per_request']:.1f} µs |")
print(f"| 5c's targets (p90 ≤ 10, p99 ≤ 50, 202s ≤ 100 ms) | {opn.get('verdict', '-')} |")
print(f"| ours / naive baseline | {ours['per_sec']/naive['per_sec']:.1f}x |")
print(f"| 2 instances / 1 instance | {two['per_sec']/ours['per_sec']:.2f}x |")
print(f"| hot activity, 3 shards / 1 shard | {hot3['per_sec']/hot1['per_sec']:.2f}x |")
print(f"| hot activity, every buyer served, 3 shards / 1 shard | {hot3f['per_sec']/hot1f['per_sec']:.2f}x |")
print(f"| drain / pgbench batched insert ceiling | {drain/pgb:.0%} |")
print(f"| drain / pgbench three-row order ceiling (3c) | {drain/pgo:.0%} |")
print(f"| drain / pgbench single-row insert ceiling | {drain/pg1:.1f}x |")
EOF
echo
echo "logs and raw output: $OUT"
exit 0
