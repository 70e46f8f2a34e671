#!/usr/bin/env bash
# Where the server's CPU goes in a sale where every buyer is served: perf
# (DWARF stacks) on `serve` over a sale of N units to N buyers (100,000 by
# default), its CPU per request read from /proc by the load generator, then
# the samples split by stage of an accepted order (scripts/stages.py) and
# printed as a table of shares and µs per order.
#
#   scripts/profile-served.sh [N]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
N=${1:-100000}
source scripts/bench-common.sh
bench_setup served --bin seckill
trap cleanup EXIT
start serve 18080 env SECKILL__APP__PORT=18080 $BIN serve
SERVE_PID=${PIDS[-1]}
# A first sale warms the broker's JIT (BENCHMARKS.md, "How to measure").
$BIN loadgen --url http://127.0.0.1:18080 --users 5000 --stock 5000 --first-user 1 >/dev/null 2>&1
$BIN loadgen --json --url http://127.0.0.1:18080 --users "$N" --stock "$N" --first-user 300000 \
  --cpu-pid "$SERVE_PID" >"$OUT/served-loadgen.json" 2>"$OUT/served-loadgen.err" &
LG=$!
until grep -q '^buying:' "$OUT/served-loadgen.err"; do sleep 0.05; done
perf record -e cpu-clock -F 999 --call-graph dwarf,16384 -p "$SERVE_PID" -o "$OUT/served.perf" >/dev/null 2>&1 &
PERF=$!
wait "$LG"
kill -INT "$PERF"; wait "$PERF" 2>/dev/null || true
perf script -i "$OUT/served.perf" -F comm,tid,ip,sym,dso 2>/dev/null \
  | python3 scripts/collapse-perf.py >"$OUT/served.folded"
US=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['server_cpu_us_per_request'])" "$OUT/served-loadgen.json")
python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(f\"{r['per_sec']:,.0f} purchases/s, {r['server_cpu_us_per_request']:.1f} µs server CPU per request, invariants {r['invariants_ok']}\")" "$OUT/served-loadgen.json"
echo "| stage | share of samples | µs per order |"
echo "|---|---|---|"
python3 scripts/stages.py "$OUT/served.folded" "$US" | tail -n +2
echo "raw: $OUT"
