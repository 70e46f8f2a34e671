# Sourced by scripts/bench.sh and scripts/bench-fallback.sh.
#
#   bench_setup NAME CARGO_BUILD_ARGS...
# starts the services, builds the release binaries named, and gives the run
# a database (seckill_NAME, made afresh and migrated), a Redis key prefix
# and a Kafka topic prefix of its own ($RUN), an output folder ($OUT) and
# an admin token ($ADMIN). Then start / stop_all run the processes under
# test, and cleanup stops them.

say() { printf '\n== %s\n' "$*" >&2; }

bench_setup() {
  local name=$1; shift
  scripts/services.sh up >/dev/null
  eval "$(python3 scripts/settings.py)"
  say "building (release)"
  cargo build --release --quiet "$@"
  BIN=target/release/seckill
  OUT=$(mktemp -d "/tmp/seckill-$name.XXXXXX")
  RUN=${name//-/}$(date +%s)
  export SECKILL__LOG__LEVEL=warn
  export SECKILL__REDIS__KEY_PREFIX="$RUN:" SECKILL__KAFKA__TOPIC_PREFIX="$RUN."
  export PGPASSWORD=$PG_PASSWORD
  DB=seckill_${name//-/_}
  export SECKILL__POSTGRES__URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$DB"
  psql_admin -c "drop database if exists $DB with (force)"
  psql_admin -c "create database $DB"
  $BIN migrate >/dev/null
  ADMIN=$($BIN token --admin)
  PIDS=()
}

psql_admin() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -qtA "$@"; }
psql_bench() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d "$DB" -qtA "$@"; }

cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }

# start NAME PORT CMD...: runs CMD in the background, waits for the port.
start() {
  local name=$1 port=$2; shift 2
  "$@" >"$OUT/$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "$name did not start; see $OUT/$name.log" >&2; exit 1
}

stop_all() { cleanup; PIDS=(); }
