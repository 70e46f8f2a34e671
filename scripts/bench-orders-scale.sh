#!/usr/bin/env bash
# "My orders" and an order by number over HTTP, at scale: 10 million
# orders over 1 million buyers in the partitioned order table, against the
# same reads on 10,000 orders over 1,000 buyers (the baseline, in the same
# run, on the same server build and services).
#
#   scripts/bench-orders-scale.sh [ORDERS] [USERS]   (default 10000000 1000000)
#
# Each side: its own database, the orders written with SQL (order i is
# user (i-1) % USERS + 1's, numbered i*16 + the user's slot, as admission
# numbers them), `seckill serve`, then examples/order_reads: 20,000 reads
# of each kind for random buyers at concurrency 32. Prints one line per
# side and kind. Loading 10 million orders takes minutes: SCALE_KEEP=1
# keeps each side's database for the next run, which then loads nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ORDERS=${1:-10000000}; USERS=${2:-1000000}
REQUESTS=${SCALE_REQUESTS:-20000}; CONC=${SCALE_CONCURRENCY:-32}
scripts/services.sh up >/dev/null
eval "$(python3 scripts/settings.py)"
cargo build --release --quiet --bin seckill --example order_reads
export PGPASSWORD=$PG_PASSWORD SECKILL__LOG__LEVEL=warn
RUN=scale$(date +%s)
export SECKILL__REDIS__KEY_PREFIX="$RUN:" SECKILL__KAFKA__TOPIC_PREFIX="$RUN."
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; scripts/services.sh forget "$RUN:" >/dev/null 2>&1 || true' EXIT
q() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -v ON_ERROR_STOP=1 -qtA "$@"; }

side() { # NAME ORDERS USERS
  local name=$1 orders=$2 users=$3 db=seckill_scale_$1
  export SECKILL__POSTGRES__URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$db"
  local have=0
  if [ -n "${SCALE_KEEP:-}" ] && [ "$(q -d postgres -c "select count(*) from pg_database where datname = '$db'")" = 1 ]; then
    have=$(q -d "$db" -c "select count(*) from orders")
  fi
  local t0=$SECONDS
  if [ "$have" != "$orders" ]; then
  q -d postgres -c "drop database if exists $db with (force)" -c "create database $db"
  target/release/seckill migrate >/dev/null
  q -d "$db" <<SQL
SET synchronous_commit = off;
INSERT INTO activities (sku_id, name, price_cents, start_at, end_at, per_user_limit, pay_timeout_secs, buckets)
VALUES (1, 'scale', 100, now() - interval '1 day', now() - interval '1 hour', 100, 900, 1);
CREATE TEMP TABLE slots AS SELECT u, seckill_user_slot(u) AS s FROM generate_series(1, $users) u;
CREATE UNIQUE INDEX ON slots (u);
INSERT INTO orders (order_no, user_slot, request_id, activity_id, user_id, quantity, amount_cents, status, paid_at)
SELECT i * 16 + s.s, s.s, 'r' || i, (SELECT max(id) FROM activities), s.u, 1, 100, 'PAID', now()
FROM generate_series(1, $orders) i JOIN slots s ON s.u = (i - 1) % $users + 1;
VACUUM ANALYZE orders;
SQL
  fi
  local size
  size=$(q -d "$db" -c "select pg_size_pretty(sum(pg_total_relation_size(inhrelid))) \
    from pg_inherits where inhparent = 'orders'::regclass")
  echo "$name: $orders orders over $users buyers loaded in $((SECONDS - t0)) s ($size with indexes)"
  SECKILL__APP__PORT=18095 target/release/seckill serve --no-consumer >"/tmp/$RUN-$name.log" 2>&1 &
  PID=$!
  until curl -sf http://127.0.0.1:18095/health/ready >/dev/null; do sleep 0.2; done
  per_user=$((orders / users))
  target/release/examples/order_reads http://127.0.0.1:18095 "$users" "$per_user" "$REQUESTS" "$CONC" \
    | sed "s/^/$name: /"
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
  [ -n "${SCALE_KEEP:-}" ] || q -d postgres -c "drop database if exists $db with (force)"
}

side small 10000 1000
side big "$ORDERS" "$USERS"
