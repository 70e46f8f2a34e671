#!/usr/bin/env bash
# WIP (#61): profiles the server over an every-buyer-served sale of 100,000; then
#   python3 scripts/stages.py $OUT/served.folded <server CPU µs per request>
# splits the samples by stage of an accepted order.
set -euo pipefail
cd /work/main
source scripts/bench-common.sh
bench_setup prof2 --bin seckill
trap cleanup EXIT
start serve 18080 env SECKILL__APP__PORT=18080 $BIN serve
SERVE_PID=${PIDS[-1]}
$BIN loadgen --url http://127.0.0.1:18080 --users 5000 --stock 5000 --first-user 1 >/dev/null 2>&1
U=100000
$BIN loadgen --json --url http://127.0.0.1:18080 --users $U --stock $U --first-user 300000 --cpu-pid "$SERVE_PID" >"$OUT/prof-loadgen.json" 2>"$OUT/prof-loadgen.err" &
LG=$!
until grep -q '^buying:' "$OUT/prof-loadgen.err"; do sleep 0.05; done
perf record -e cpu-clock -F 999 --call-graph dwarf,16384 -p "$SERVE_PID" -o "$OUT/served.perf" >/dev/null 2>&1 &
PERF=$!
wait "$LG"
kill -INT "$PERF"; wait "$PERF" 2>/dev/null || true
perf script -i "$OUT/served.perf" -F comm,tid,ip,sym,dso 2>/dev/null | python3 scripts/collapse-perf.py >"$OUT/served.folded"
echo "OUT=$OUT"
