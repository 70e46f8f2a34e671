#!/usr/bin/env bash
# Redis memory per waiting-room ticket, this tree's room_join.lua beside
# the one at BASE (default e7a8906: users and tickets hashes), in one run
# on the same Redis (scripts/services.sh's, SECKILL__REDIS__URL moves it):
#
#   scripts/bench-room-memory.sh [TICKETS] [BASE]
#
# redis-benchmark joins random users of 0..TICKETS (3 × TICKETS calls,
# each with its own proof-of-work answer marker), all in the pre-queue
# (the costlier case: this tree keeps each pre-queue ticket's user on the
# entrants list the draw's Merkle tree is built from), then reads MEMORY
# USAGE of what a ticket keeps and Redis's growth (markers included: they
# expire with their challenge, 120 s by default).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
T=${1:-200000}
BASE=${2:-e7a8906}
eval "$(scripts/settings.py)"
R="redis-cli -h $REDIS_HOST -p $REDIS_PORT"
OLD_JOIN=$($R SCRIPT LOAD "$(cat src/admission/lua/room_close.lua; git show "$BASE:src/admission/lua/room_join.lua")")
NEW_JOIN=$($R SCRIPT LOAD "$(cat src/admission/lua/room_close.lua src/admission/lua/room_join.lua)")
OPEN=$($R SCRIPT LOAD "$(cat src/admission/lua/room_open.lua)")
used() { $R INFO memory | grep '^used_memory:' | cut -d: -f2 | tr -d '\r'; }
for v in base this; do
  k="bench-memory-$$:{a:1}:"
  $R EVALSHA "$OPEN" 6 "${k}room" "${k}room:users" "${k}room:tickets" "${k}room:st" \
    "${k}room:active" "${k}room:offers" 1 0 99999999999998 99999999999999 1 0 600000 60000 00 >/dev/null
  before=$(used)
  if [ $v = base ]; then
    redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" -c 32 -n $((T * 3)) -r "$T" --threads 1 -q \
      EVALSHA "$OLD_JOIN" 6 "${k}room" "${k}room:users" "${k}room:tickets" "${k}room:st" \
      "${k}room:pow:__rand_int__" "${k}room:joins:1" __rand_int__ 1700000000000 600000 >/dev/null
    hashes=$(( $($R MEMORY USAGE "${k}room:users" SAMPLES 0) + $($R MEMORY USAGE "${k}room:tickets" SAMPLES 0) ))
  else
    redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" -c 32 -n $((T * 3)) -r "$T" --threads 1 -q \
      EVALSHA "$NEW_JOIN" 6 "${k}room" "${k}room:users" "${k}room:st" \
      "${k}room:pow:__rand_int__" "${k}room:joins:1" "${k}room:entrants" __rand_int__ 1700000000000 600000 >/dev/null
    hashes=$(( $($R MEMORY USAGE "${k}room:users" SAMPLES 0) + $($R MEMORY USAGE "${k}room:entrants" SAMPLES 0) ))
  fi
  after=$(used)
  held=$($R HLEN "${k}room:users")
  markers=$($R --scan --pattern "${k}room:pow:*" | wc -l)
  one=$($R MEMORY USAGE "$($R --scan --pattern "${k}room:pow:*" | head -1)" SAMPLES 0)
  label=$([ $v = base ] && echo "at $BASE (users + tickets hashes)" || echo "this tree (users hash + entrants list)")
  echo "| $label | $held | $((hashes / held)) B | $(((after - before) / held)) B, with $markers answer markers of $one B each |"
  if [ $v = this ]; then
    # Every ticket admitted, as room_admit.lua writes it: its state
    # (kept for good, as A:/U:/B:… then E) and its pass in the active set
    # (until used or expired).
    before=$(used)
    $R EVAL "for t = 1, tonumber(ARGV[1]) do
        redis.call('HSET', KEYS[1], t, 'A:1700000600000')
        redis.call('ZADD', KEYS[2], 1700000600000, t) end return 1" \
      2 "${k}room:st" "${k}room:active" "$held" >/dev/null
    after=$(used)
    st=$($R MEMORY USAGE "${k}room:st" SAMPLES 0)
    active=$($R MEMORY USAGE "${k}room:active" SAMPLES 0)
    echo "| the same tickets, every one admitted | $held | +$((st / held)) B state, +$((active / held)) B active pass | +$(((after - before) / held)) B |"
  fi
  $R --scan --pattern "bench-memory-$$:*" | xargs -r -n 500 $R UNLINK >/dev/null
done
