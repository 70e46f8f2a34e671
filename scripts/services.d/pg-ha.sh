# Sourced by scripts/services.sh: PostgreSQL as a primary and a
# synchronous standby that takes over when the primary dies, on loopback.
#
# pg_auto_failover (Debian's postgresql-15-auto-failover): a monitor (its
# own small PostgreSQL) and a keeper per node (`pg_autoctl run`), which
# runs that node's PostgreSQL, reports its health and applies the role the
# monitor assigns. Chosen over Patroni with etcd: one extra process
# instead of a three-member etcd, packaged by Debian, and the monitor's
# state machine (primary, wait_primary, secondary, demoted...) is what the
# tests read. The monitor is the one part that does not fail over: when it
# is down the nodes keep their roles, and no failover can happen.
#
# Node N listens on the Nth host of postgres.url, the monitor on the
# second node's port + 1. Replication is synchronous (the keeper sets
# synchronous_standby_names = 'ANY 1 (...)' while the standby is healthy):
# a commit acknowledged to the service is on both nodes, so a failover
# loses nothing acknowledged. The trade: when the standby is lost, the
# monitor moves the primary to wait_primary and turns synchronous
# replication off, so writes go on (the sale does not stop) while commits
# exist on one node only, until the standby is back and has caught up.
#
# The service reaches the pair through a multi-host URL with
# target_session_attrs=read-write: libpq tries each host and keeps the one
# that takes writes.
#
# Each keeper runs in a session of its own (setsid), its pid (= its
# process group) in $PGHA_DIR/nodeN/keeper.pid: killing that group is the
# node dying, keeper and PostgreSQL with it. `start pg-node N` starts it
# again, and it rejoins as the standby (pg_rewind, after crash recovery
# here: pg_ha_recover).

# Failover timings on the monitor: a node is unhealthy after 6 s without a
# report and failed health checks (1 s apart), and an unreachable primary
# is given 10 s to demote itself before its standby is promoted (its
# writes cannot commit without the standby anyway).
PG_HA_MONITOR_SETTINGS=(
  "pgautofailover.health_check_period = 1000"
  "pgautofailover.health_check_timeout = 1000"
  "pgautofailover.health_check_retry_delay = 500"
  "pgautofailover.node_considered_unhealthy_timeout = 6000"
  "pgautofailover.primary_demote_timeout = 10000"
)

pg_ha_paths() {
  pg_paths
  PGHA_DIR=$(dirname "$PG_DIR")/pg-ha
  read -ra PGHA_PORTS <<<"$PG_HA_PORTS"
  [ "${#PGHA_PORTS[@]}" = 2 ] || die "--pg-ha needs postgres.url to name two hosts (host:port,host:port); it names $PG_HA_PORTS"
  PGHA_MONITOR_PORT=$((PGHA_PORTS[1] + 1))
  PGHA_MONITOR_URI="postgres://autoctl_node@$PG_HOST:$PGHA_MONITOR_PORT/pg_auto_failover?sslmode=disable"
}

# pg_autoctl as the postgres user, its configuration and state under
# $PGHA_DIR (never the postgres user's home: two sets of services must not
# share them).
autoctl() {
  as_pg env PATH="$PGBIN:$PATH" PG_CONFIG="$PGBIN/pg_config" \
    XDG_CONFIG_HOME="$PGHA_DIR/xdg/config" XDG_DATA_HOME="$PGHA_DIR/xdg/data" \
    XDG_RUNTIME_DIR="$PGHA_DIR/xdg/run" pg_autoctl "$@"
}

pg_ha_install() {
  command -v pg_autoctl >/dev/null || apt_install pg-auto-failover-cli
  [ -n "$(ls "$PGBIN"/../lib/pgautofailover.so 2>/dev/null || ls /usr/lib/postgresql/*/lib/pgautofailover.so 2>/dev/null)" ] \
    || apt_install "postgresql-$(basename "$(dirname "$PGBIN")")-auto-failover"
}

pg_ha_sql() {  # PORT SQL...
  local port=$1; shift
  as_pg psql -h "$PG_HOST" -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 -tAq "$@"
}

pg_ha_answers() { "$PGBIN/pg_isready" -h "$PG_HOST" -p "$1" -q; }
pg_ha_is_primary() { [ "$(pg_ha_sql "$1" -c 'select pg_is_in_recovery()' 2>/dev/null)" = f ]; }
pg_ha_is_standby() { [ "$(pg_ha_sql "$1" -c 'select pg_is_in_recovery()' 2>/dev/null)" = t ]; }
# The monitor's view: every node in a steady role (one primary, the other
# secondary), nothing in between.
pg_ha_settled() {
  local states
  states=$(as_pg psql -h "$PG_HOST" -p "$PGHA_MONITOR_PORT" -U postgres -d pg_auto_failover -tAq \
    -c "select string_agg(reportedstate::text || '/' || goalstate::text, ' ' order by nodeid) from pgautofailover.node" 2>/dev/null)
  [[ "$states" =~ ^(primary/primary\ secondary/secondary|secondary/secondary\ primary/primary)$ ]]
}

keeper_alive() { pid_alive "$1/keeper.pid"; }

# pg_ha_keeper DIR: runs `pg_autoctl run` for DIR's data in a session of
# its own; its pid (= process group) in DIR/keeper.pid.
pg_ha_keeper() {
  local dir=$1
  keeper_alive "$dir" && return 0
  local cmd=(env PATH="$PGBIN:$PATH" PG_CONFIG="$PGBIN/pg_config"
    XDG_CONFIG_HOME="$PGHA_DIR/xdg/config" XDG_DATA_HOME="$PGHA_DIR/xdg/data"
    XDG_RUNTIME_DIR="$PGHA_DIR/xdg/run" pg_autoctl run --pgdata "$dir/data")
  if is_root; then cmd=(runuser -u postgres -- "${cmd[@]}"); fi
  # pg_autoctl expects a supervisor that starts it again whenever it
  # exits (the systemd unit `pg_autoctl show systemd` writes says
  # Restart=always): it gives up at once on some errors, such as one
  # failed connection to its own PostgreSQL ("pg_autoctl stops retrying
  # now"), and a node without its keeper never reports or changes role
  # again, so the pair never settles. This loop is that supervisor. It is
  # in the node's process group: killing the group still kills the node,
  # and a SIGTERM to the group ends the loop (no trap) while pg_autoctl
  # stops PostgreSQL gracefully.
  # A background job is no group leader: setsid makes it one in place,
  # so its pid is the new session's and process group's.
  setsid bash -c 'while :; do
      "$@"; rc=$?
      echo "[services] pg_autoctl run exited ($rc); starting it again in 1 s"
      sleep 1
    done' keeper "${cmd[@]}" >>"$dir/keeper.log" 2>&1 </dev/null &
  echo $! >"$dir/keeper.pid"
}

# pg_ha_explain: what the monitor and the keepers say, on stderr, when the
# pair does not come up as asked.
pg_ha_explain() {
  {
    echo "[services] the monitor's nodes (health: 1 good, 0 bad, -1 not checked yet):"
    as_pg psql -h "$PG_HOST" -p "$PGHA_MONITOR_PORT" -U postgres -d pg_auto_failover -P pager=off \
      -c "select nodeid, nodename, nodeport, reportedstate, goalstate, reportedpgisrunning as pg_running,
                 reportedtli, reportedlsn, health, now() - reporttime as since_report,
                 now() - healthchecktime as since_health_check
            from pgautofailover.node order by nodeid" 2>&1
    echo "[services] the monitor's last events:"
    as_pg psql -h "$PG_HOST" -p "$PGHA_MONITOR_PORT" -U postgres -d pg_auto_failover -P pager=off \
      -c "select eventtime::time(0), nodename, reportedstate, goalstate, description
            from (select * from pgautofailover.event order by eventid desc limit 12) e
           order by eventid" 2>&1
    local dir
    for dir in "$PGHA_DIR/monitor" "$PGHA_DIR/node1" "$PGHA_DIR/node2"; do
      if keeper_alive "$dir"; then echo "[services] $dir: keeper running"
      else echo "[services] $dir: keeper NOT running"; fi
      tail -n 25 "$dir/keeper.log" 2>/dev/null | cut -c1-240 | sed 's/^/    /'
    done
  } >&2
}

pg_ha_monitor_up() {
  local dir=$PGHA_DIR/monitor
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    log "creating the pg_auto_failover monitor in $dir"
    rm -rf "$dir/data"
    autoctl create monitor --pgdata "$dir/data" --pgport "$PGHA_MONITOR_PORT" \
      --hostname "$PG_HOST" --listen "$PG_HOST" --auth trust --no-ssl \
      >"$dir/create.log" 2>&1 || die "creating the monitor failed; see $dir/create.log"
  fi
  pg_ha_keeper "$dir"
  wait_for 60 pg_ha_answers "$PGHA_MONITOR_PORT" || die "the monitor does not answer; see $dir/keeper.log"
  local setting
  for setting in "${PG_HA_MONITOR_SETTINGS[@]}"; do
    as_pg psql -h "$PG_HOST" -p "$PGHA_MONITOR_PORT" -U postgres -d pg_auto_failover -tAq \
      -c "alter system set $setting" >/dev/null
  done
  as_pg psql -h "$PG_HOST" -p "$PGHA_MONITOR_PORT" -U postgres -d pg_auto_failover -tAq \
    -c "select pg_reload_conf()" >/dev/null
}

# pg_ha_recover DIR: a node whose PostgreSQL died as a primary (SIGKILL,
# a lost machine) is left "in production", not shut down cleanly. The
# keeper rejoins it as the new primary's standby with pg_rewind, which
# needs a clean shutdown. pg_autoctl 2.0 first recovers the node as a
# standby itself, but it sends that server SIGTERM and starts pg_rewind
# without waiting for it to stop. On a loaded host pg_rewind then finds
# the node not shut down and runs crash recovery in single-user mode,
# which fails on the running server or on the standby.signal the keeper
# wrote ("standby mode is not supported by single-user servers").
# pg_auto_failover then falls back to a full base backup (47 s seen, and
# no standby meanwhile). So crash recovery runs here first, in
# single-user mode (it listens on no port: nothing can write to the old
# primary), with any signal file set aside; the keeper then finds a clean
# cluster and rewinds it.
pg_ha_recover() {
  local dir=$1 data=$1/data state f
  [ -f "$data/PG_VERSION" ] || return 0
  [ -f "$data/postmaster.pid" ] && kill -0 "$(head -n 1 "$data/postmaster.pid")" 2>/dev/null && return 0
  state=$(as_pg "$PGBIN/pg_controldata" -D "$data" 2>/dev/null | sed -n 's/^Database cluster state: *//p')
  [ "$state" = "in production" ] || return 0
  log "$dir: PostgreSQL died as a primary ($state): crash recovery in single-user mode before it rejoins"
  for f in standby.signal recovery.signal; do
    [ -f "$data/$f" ] && as_pg mv "$data/$f" "$data/$f.aside"
  done
  as_pg rm -f "$data/postmaster.pid"
  as_pg "$PGBIN/postgres" --single -D "$data" postgres </dev/null >>"$dir/recovery.log" 2>&1 \
    || log "$dir: single-user recovery failed (see $dir/recovery.log); the keeper takes over"
  for f in standby.signal recovery.signal; do
    [ -f "$data/$f.aside" ] && as_pg mv "$data/$f.aside" "$data/$f"
  done
  return 0
}

# pg_ha_node_up N: creates node N (the first becomes the primary, the
# second its standby, from a base backup) unless it exists, runs it, and
# waits until it answers.
pg_ha_node_up() {
  pg_ha_node_start "$1"
  local port=${PGHA_PORTS[$(($1 - 1))]}
  wait_for 120 pg_ha_answers "$port" || { pg_ha_explain; die "node $1 does not answer; see $PGHA_DIR/node$1/keeper.log"; }
}

# pg_ha_node_start N: as pg_ha_node_up, without the wait.
pg_ha_node_start() {
  local n=$1 dir=$PGHA_DIR/node$1 port=${PGHA_PORTS[$(($1 - 1))]}
  as_pg mkdir -p "$dir"
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    log "creating PostgreSQL node $n (port $port) under pg_auto_failover"
    as_pg rm -rf "$dir/data"
    autoctl create postgres --pgdata "$dir/data" --pgport "$port" --hostname "$PG_HOST" \
      --listen "$PG_HOST" --auth trust --no-ssl --monitor "$PGHA_MONITOR_URI" \
      --dbname "$PG_DB" --name "node$n" >"$dir/create.log" 2>&1 \
      || die "creating node $n failed; see $dir/create.log"
    # As the single server has it; the standby's must be no lower.
    printf '\n# scripts/services.d/pg-ha.sh\nmax_connections = 300\nshared_buffers = 128MB\n' \
      | as_pg tee -a "$dir/data/postgresql.conf" >/dev/null
  fi
  keeper_alive "$dir" || pg_ha_recover "$dir"
  pg_ha_keeper "$dir"
}

pg_ha_primary_port() {
  local port
  for port in "${PGHA_PORTS[@]}"; do
    pg_ha_is_primary "$port" && { echo "$port"; return 0; }
  done
  return 1
}

pg_ha_up() {
  pg_ha_paths
  pg_ha_install
  mkdir -p "$PGHA_DIR"
  if is_root; then chown postgres: "$PGHA_DIR"; fi
  as_pg mkdir -p "$PGHA_DIR/monitor" "$PGHA_DIR/xdg/config" "$PGHA_DIR/xdg/data" "$PGHA_DIR/xdg/run"
  pg_ha_monitor_up
  # A pair that exists already may have failed over: node 1, demoted,
  # answers only once it has rejoined node 2 as its standby. Both run
  # before anything waits.
  if [ -f "$PGHA_DIR/node2/data/PG_VERSION" ]; then
    pg_ha_node_start 1
    pg_ha_node_start 2
  else
    pg_ha_node_up 1
  fi
  wait_for 120 pg_ha_primary_port >/dev/null || { pg_ha_explain; die "no primary; see $PGHA_DIR/node1/keeper.log"; }
  pg_ha_node_up 2
  wait_for 180 pg_ha_settled || {
    pg_ha_explain
    die "the pair did not settle as primary and standby; see $PGHA_DIR/node*/keeper.log"
  }
  local primary
  primary=$(pg_ha_primary_port)
  if [ -z "$(pg_ha_sql "$primary" -c "select 1 from pg_roles where rolname = '$PG_USER'")" ]; then
    pg_ha_sql "$primary" -c "create role \"$PG_USER\" login createdb password '$PG_PASSWORD'"
  fi
  pg_ha_sql "$primary" -c "alter database \"$PG_DB\" owner to \"$PG_USER\""
}

# pg_ha_node start|stop N: one node alone (stop: the keeper and its
# PostgreSQL, gracefully).
pg_ha_node() {
  local n=${2:?node number (1 or 2)}
  pg_ha_paths
  case "$1" in
    start)
      pg_ha_node_up "$n"
      ;;
    stop) pg_ha_stop_dir "$PGHA_DIR/node$n" ;;
  esac
}

pg_ha_stop_dir() {
  local dir=$1 pid
  keeper_alive "$dir" || return 0
  pid=$(cat "$dir/keeper.pid")
  kill -TERM -- "-$pid" 2>/dev/null || true
  wait_for 60 bash -c "! kill -0 -- -$pid 2>/dev/null" || kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$dir/keeper.pid"
}

pg_ha_down() {
  [ "$PG_MODE" = ha ] || [ -n "${PG_FORCE_HA:-}" ] || return 0
  pg_ha_paths
  pg_ha_stop_dir "$PGHA_DIR/node2"
  pg_ha_stop_dir "$PGHA_DIR/node1"
  pg_ha_stop_dir "$PGHA_DIR/monitor"
}

pg_ha_status() {
  pg_ha_paths
  local n state role
  for n in 1 2; do
    if pg_ha_is_primary "${PGHA_PORTS[$((n - 1))]}"; then role=primary; state=up
    elif pg_ha_is_standby "${PGHA_PORTS[$((n - 1))]}"; then role=standby; state=up
    else role=; state=down; fi
    printf '%-10s %-5s %-22s %s\n' "pg:node$n" "$state" "$PG_HOST:${PGHA_PORTS[$((n - 1))]} $role" "$PGHA_DIR/node$n/keeper.log"
  done
  pg_ha_answers "$PGHA_MONITOR_PORT" && state=up || state=down
  printf '%-10s %-5s %-22s %s\n' "pg:monitor" "$state" "$PG_HOST:$PGHA_MONITOR_PORT" "$PGHA_DIR/monitor/keeper.log"
}
