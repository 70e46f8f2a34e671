# Sourced by scripts that test a running server (fuzz.sh, browser-test.sh,
# room-demo.sh):
#
#   python_venv DIR MODULE SPEC...   a venv at DIR holding SPEC (pip), made
#                                    when MODULE does not import from it
#   start_own_server NAME            builds the binary and starts `seckill
#                                    serve` on a database, Redis key prefix,
#                                    Kafka topic prefix and port of its own;
#                                    sets BIN, OUT (logs), URL; stops the
#                                    server and drops the database on exit
#
# The caller exports SECKILL_ENV and any SECKILL__* settings before
# start_own_server.

python_venv() {
  local dir=$1 module=$2
  shift 2
  if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import $module" 2>/dev/null; then
    return 0
  fi
  printf '\n== installing %s into %s\n' "$*" "$dir" >&2
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    # Debian's own python3 keeps venv in a package of its own.
    [ "$(id -u)" = 0 ] || { echo "python3 cannot make a venv: install python3-venv" >&2; exit 1; }
    apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install --quiet "$@"
}

start_own_server() {
  local name=$1
  # The test profile, in target/debug. Under scripts/test.sh (SECKILL_BUILT)
  # the binary its `cargo test` build left there: `cargo build` would make
  # another one, as `cargo test` resolves the dev-dependencies' features
  # into the build and `cargo build` does not (minutes on a slow host).
  [ -n "${SECKILL_BUILT:-}" ] || cargo build --profile test --quiet --bin seckill
  BIN=target/debug/seckill
  eval "$(python3 scripts/settings.py)"
  OWN_RUN=$name$(date +%s)$$
  OUT=$(mktemp -d "/tmp/seckill-$name.XXXXXX")
  OWN_DB=seckill_${name}_$OWN_RUN
  export PGPASSWORD=$PG_PASSWORD
  scripts/drop-databases.sh "seckill\\_${name}\\_%"
  own_psql -c "create database $OWN_DB"
  export SECKILL__LOG__LEVEL=${SECKILL__LOG__LEVEL:-warn}
  export SECKILL__POSTGRES__URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$OWN_DB"
  export SECKILL__REDIS__KEY_PREFIX="$OWN_RUN:" SECKILL__KAFKA__TOPIC_PREFIX="$OWN_RUN."
  SECKILL__APP__PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  export SECKILL__APP__PORT
  URL=http://127.0.0.1:$SECKILL__APP__PORT
  OWN_SERVER=
  trap stop_own_server EXIT
  $BIN migrate >/dev/null
  $BIN serve >"$OUT/server.log" 2>&1 &
  OWN_SERVER=$!
  # Up to 3 minutes: a broker started moments ago answers "coordinator
  # load in progress" for a while, and the server is ready only after.
  for _ in $(seq 1 1800); do
    curl -fs "$URL/health/ready" >/dev/null 2>&1 && return 0
    kill -0 "$OWN_SERVER" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
    sleep 0.1
  done
  curl -fs "$URL/health/ready" >/dev/null || { echo "the server never became ready" >&2; exit 1; }
}

own_psql() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -qtA "$@"; }

stop_own_server() {
  [ -n "${OWN_SERVER:-}" ] && kill "$OWN_SERVER" 2>/dev/null && wait "$OWN_SERVER" 2>/dev/null
  own_psql -c "drop database if exists $OWN_DB with (force)" >/dev/null 2>&1 || true
}
