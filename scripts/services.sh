#!/usr/bin/env bash
# Redis, PostgreSQL and Apache Kafka (KRaft) for seckill, on loopback.
#
#   scripts/services.sh up           install what is missing, start, wait until each answers
#   scripts/services.sh install      only install what is missing (packages, Kafka's jars)
#   scripts/services.sh up --redis-cluster
#                                    also a 3-master Redis Cluster (Redis port + 1000..1002);
#                                    `scripts/services.sh cluster-url` prints its redis.url
#   scripts/services.sh up --kafka-cluster
#                                    Kafka as three brokers and three KRaft controllers
#                                    (replication 3, min.insync.replicas 2) instead of one
#                                    broker; kafka.brokers lists the three addresses
#                                    (scripts/services.d/kafka-cluster.sh)
#   scripts/services.sh up --pg-replica
#                                    also a streaming replica of PostgreSQL (pg_basebackup) on
#                                    the primary's port + 100 (or postgres.replica_url's),
#                                    replaying SECKILL_PG_REPLICA_DELAY (3s) behind
#   scripts/services.sh up --pg-ha   PostgreSQL as a primary and a synchronous standby under
#                                    pg_auto_failover instead of one server; postgres.url
#                                    names both (scripts/services.d/pg-ha.sh)
#   scripts/services.sh forget PREFIX  unlink the Redis keys under PREFIX (SCAN, not KEYS)
#   scripts/services.sh down         stop what this script started (nothing else)
#   scripts/services.sh stop NAME    stop one of them: redis, postgres, postgres-replica or kafka
#   scripts/services.sh start NAME   start one of them (redis, redis-cluster, postgres,
#                                    postgres-replica, kafka)
#                                    without touching, or waiting on, the others;
#                                    `start|stop kafka-broker N` one broker of the cluster,
#                                    `start|stop pg-node N` one node of the HA pair
#   scripts/services.sh status       where each listens, where its log is
#   scripts/services.sh pid kafka-broker N | pg-node N
#                                    the pid (group, for a node) a fault test signals
#
# SECKILL_KAFKA_JVM_OPTS adds flags to every Kafka JVM this script starts
# (for experiments: -XX:TieredStopAtLevel=1 for C1 only, say).
# SECKILL_SERVICES_DIR puts the data elsewhere and the SECKILL__* address
# overrides move the ports: scripts/chaos.sh runs a second set this way.
#
# Addresses come from the server's own configuration (scripts/settings.py reads
# config/default.toml, config/$SECKILL_ENV.toml and SECKILL__* overrides), so
# the services start exactly where `seckill serve` looks for them.
# Data lives under .services/ (git-ignored); Kafka's jars are cached under
# ${SECKILL_CACHE_DIR:-~/.cache/seckill} so a fresh clone does not refetch them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${SECKILL_SERVICES_DIR:-$ROOT/.services}
CACHE=${SECKILL_CACHE_DIR:-${HOME:-/root}/.cache/seckill}
KAFKA_VERSION=4.1.1
KAFKA_HEAP=${SECKILL_KAFKA_HEAP:-1g}
KAFKA_CONTROLLER_HEAP=${SECKILL_KAFKA_CONTROLLER_HEAP:-256m}

log() { printf '[services] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }

apt_install() {
  [ $# -gt 0 ] || return 0
  is_root || die "missing packages ($*) and not root: install them with apt-get"
  log "installing: $*"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# The newest installed server (the client package alone also has a bin/).
pg_bindir() {
  local initdb
  initdb=$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1)
  [ -n "$initdb" ] && dirname "$initdb"
  return 0
}

install_missing() {
  local pkgs=()
  command -v python3 >/dev/null || pkgs+=(python3)
  command -v redis-server >/dev/null || pkgs+=(redis-server)
  command -v redis-cli >/dev/null || pkgs+=(redis-tools)
  [ -n "$(pg_bindir)" ] || pkgs+=(postgresql)
  command -v psql >/dev/null || pkgs+=(postgresql-client)
  # Needed to build the server: diesel links libpq; librdkafka builds from source.
  [ -f /usr/include/postgresql/libpq-fe.h ] || pkgs+=(libpq-dev)
  command -v cc >/dev/null || pkgs+=(build-essential)
  command -v make >/dev/null || pkgs+=(make)
  command -v pkg-config >/dev/null || pkgs+=(pkg-config)
  [ -f /usr/include/zlib.h ] || pkgs+=(zlib1g-dev)
  command -v java >/dev/null || pkgs+=(default-jre-headless)
  command -v mvn >/dev/null || pkgs+=(maven)
  command -v curl >/dev/null || pkgs+=(curl)
  apt_install "${pkgs[@]}"
}

load_settings() { eval "$(python3 "$ROOT/scripts/settings.py")"; }

# Wait until "$@" succeeds, at most $1 seconds (the first argument).
wait_for() {
  local secs=$1; shift
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.3
  done
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# ---------------------------------------------------------------- Redis ----
REDIS_DIR=$STATE/redis
redis_ping() { [ "$(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]; }

redis_up() {
  mkdir -p "$REDIS_DIR"
  if redis_ping; then
    log "redis already answers on $REDIS_HOST:$REDIS_PORT"
    # Its pid file may be gone (a stop that timed out): the fault tests
    # signal it by that file, so it is written again from the server's word.
    [ -f "$REDIS_DIR/redis.pid" ] || redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" info server 2>/dev/null \
      | sed -n 's/^process_id:\([0-9]*\).*/\1/p' >"$REDIS_DIR/redis.pid"
    return
  fi
  # No RDB/AOF: Redis holds a cache of the database's stock figures that
  # warm-up and reconciliation rebuild, and tests want it fast.
  redis-server --bind "$REDIS_HOST" --port "$REDIS_PORT" --daemonize yes \
    --dir "$REDIS_DIR" --pidfile "$REDIS_DIR/redis.pid" \
    --logfile "$REDIS_DIR/redis.log" --save "" --appendonly no \
    --maxclients 10000 >/dev/null
  wait_for 20 redis_ping || die "redis did not answer; see $REDIS_DIR/redis.log"
}

redis_down() {
  pid_alive "$REDIS_DIR/redis.pid" || return 0
  local pid; pid=$(cat "$REDIS_DIR/redis.pid")
  redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  wait_for 10 bash -c "! kill -0 $pid 2>/dev/null" || true
  rm -f "$REDIS_DIR/redis.pid"
}

# -------------------------------------------------------- Redis Cluster ----
# Three masters, no replicas, on loopback: enough to spread the slots (and so
# the activities) over three processes, and to prove every script keeps its
# keys in one slot. Same persistence choice as the single server.
REDIS_CLUSTER_DIR=$STATE/redis-cluster
cluster_ports() { echo "$REDIS_CLUSTER_PORT" $((REDIS_CLUSTER_PORT + 1)) $((REDIS_CLUSTER_PORT + 2)); }
cluster_url() {
  local urls=() port
  for port in $(cluster_ports); do urls+=("redis://$REDIS_HOST:$port"); done
  (IFS=,; echo "${urls[*]}")
}
node_ping() { [ "$(redis-cli -h "$REDIS_HOST" -p "$1" ping 2>/dev/null)" = PONG ]; }
cluster_ok() { redis-cli -h "$REDIS_HOST" -p "$REDIS_CLUSTER_PORT" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }
# Every node knows the other two: a layout exists (a fresh node knows itself only).
cluster_known() {
  local port
  for port in $(cluster_ports); do
    redis-cli -h "$REDIS_HOST" -p "$port" cluster info 2>/dev/null | grep -q '^cluster_known_nodes:3' || return 1
  done
}

redis_cluster_up() {
  local port nodes=()
  for port in $(cluster_ports); do
    nodes+=("$REDIS_HOST:$port")
    node_ping "$port" && continue
    mkdir -p "$REDIS_CLUSTER_DIR/$port"
    redis-server --bind "$REDIS_HOST" --port "$port" --daemonize yes \
      --cluster-enabled yes --cluster-config-file "$REDIS_CLUSTER_DIR/$port/nodes.conf" \
      --cluster-node-timeout 5000 \
      --dir "$REDIS_CLUSTER_DIR/$port" --pidfile "$REDIS_CLUSTER_DIR/$port/redis.pid" \
      --logfile "$REDIS_CLUSTER_DIR/$port/redis.log" --save "" --appendonly no \
      --maxclients 10000 >/dev/null
  done
  for port in $(cluster_ports); do
    wait_for 20 node_ping "$port" || die "cluster node $port did not answer; see $REDIS_CLUSTER_DIR/$port/redis.log"
  done
  # A node restarted alone keeps its slots (nodes.conf) and rejoins within
  # a few gossip rounds: wait for that before deciding the layout is gone.
  if ! cluster_ok && ! { cluster_known && wait_for 20 cluster_ok; }; then
    # Nodes without persistence come back empty: forget any earlier layout.
    for port in $(cluster_ports); do
      redis-cli -h "$REDIS_HOST" -p "$port" cluster reset hard >/dev/null 2>&1 || true
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$REDIS_CLUSTER_DIR/create.log" 2>&1 \
      || die "creating the Redis Cluster failed; see $REDIS_CLUSTER_DIR/create.log"
    wait_for 30 cluster_ok || die "the Redis Cluster did not reach state ok"
  fi
}

redis_cluster_down() {
  local port pid
  for port in $(cluster_ports); do
    pid_alive "$REDIS_CLUSTER_DIR/$port/redis.pid" || continue
    pid=$(cat "$REDIS_CLUSTER_DIR/$port/redis.pid")
    redis-cli -h "$REDIS_HOST" -p "$port" shutdown nosave >/dev/null 2>&1 || true
    wait_for 10 bash -c "! kill -0 $pid 2>/dev/null" || true
    rm -f "$REDIS_CLUSTER_DIR/$port/redis.pid"
  done
}

# ----------------------------------------------------------- PostgreSQL ----
# PostgreSQL refuses to run as root: when we are root it runs as the
# `postgres` user, which must be able to reach its data folder. A project
# cloned under /root is not reachable, so its data then goes to /var/tmp.
pg_paths() {
  PG_DIR=$STATE/postgres
  if is_root; then
    id postgres >/dev/null 2>&1 || useradd --system --home /var/lib/postgresql --shell /bin/bash postgres
    mkdir -p "$STATE"
    if ! runuser -u postgres -- test -x "$STATE"; then
      PG_DIR=/var/tmp/seckill-$(printf '%s' "$ROOT" | md5sum | cut -c1-12)/postgres
    fi
  fi
  PGDATA=$PG_DIR/data
  PGRUN=$PG_DIR/run
  PGLOG=$PG_DIR/postgres.log
  PGBIN=$(pg_bindir)
}

as_pg() { if is_root; then runuser -u postgres -- "$@"; else "$@"; fi; }
pg_ready() { "$PGBIN/pg_isready" -h "$PG_HOST" -p "$PG_PORT" -q; }
pg_sql() { as_pg psql -h "$PGRUN" -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -tAq "$@"; }

pg_up() {
  pg_paths
  mkdir -p "$PG_DIR"
  if is_root; then chown postgres: "$PG_DIR"; fi
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    log "initialising PostgreSQL cluster in $PGDATA"
    as_pg mkdir -p "$PGDATA" "$PGRUN"
    as_pg "$PGBIN/initdb" -D "$PGDATA" -U postgres -E UTF8 --locale=C.UTF-8 \
      --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  fi
  as_pg mkdir -p "$PGRUN"
  if ! as_pg "$PGBIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
    if pg_ready; then die "something else answers on $PG_HOST:$PG_PORT; change postgres.url"; fi
    # max_slot_wal_keep_size: a replica (--pg-replica) stopped for good
    # must not fill the disk with the WAL its slot keeps.
    as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -l "$PGLOG" -w -t 60 start \
      -o "-p $PG_PORT -k $PGRUN -c listen_addresses=$PG_HOST -c max_connections=300 -c shared_buffers=256MB -c max_slot_wal_keep_size=4GB" >/dev/null \
      || die "postgres did not start; see $PGLOG"
  fi
  wait_for 30 pg_ready || die "postgres does not answer; see $PGLOG"
  # The application role may create databases: the test harness gives each
  # test its own.
  if [ -z "$(pg_sql -c "select 1 from pg_roles where rolname = '$PG_USER'")" ]; then
    pg_sql -c "create role \"$PG_USER\" login createdb password '$PG_PASSWORD'"
  fi
  if [ -z "$(pg_sql -c "select 1 from pg_database where datname = '$PG_DB'")" ]; then
    pg_sql -c "create database \"$PG_DB\" owner \"$PG_USER\""
  fi
}

pg_down() {
  pg_paths
  [ -n "$PGBIN" ] && [ -f "$PGDATA/postmaster.pid" ] || return 0
  as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null 2>&1 || true
}

# A streaming replica of that primary (pg_basebackup), on its own port,
# replaying SECKILL_PG_REPLICA_DELAY behind it (3s by default, as
# `recovery_min_apply_delay`: the lag the suite's replica-read tests need,
# and about what seed 001 saw at peak). The server reads from it only
# when postgres.replica_url names it.
REPLICA_DELAY=${SECKILL_PG_REPLICA_DELAY:-3s}
pg_replica_paths() {
  pg_paths
  REPLICA_DATA=$PG_DIR/replica
  REPLICA_RUN=$PG_DIR/replica-run
  REPLICA_LOG=$PG_DIR/replica.log
}
pg_replica_ready() { "$PGBIN/pg_isready" -h "$PG_HOST" -p "$PG_REPLICA_PORT" -q; }
pg_replica_sql() { as_pg psql -h "$REPLICA_RUN" -p "$PG_REPLICA_PORT" -U postgres -d postgres -tAq -c "$1"; }
pg_replica_streams() { [ "$(pg_replica_sql "select status from pg_stat_wal_receiver" 2>/dev/null)" = streaming ]; }
# The replica keeps its place in the primary's WAL with a slot: stopped a
# while (a fault test), it finds the WAL it missed still there.
REPLICA_SLOT=seckill_replica
pg_replica_make() {
  pg_replica_down
  rm -rf "$REPLICA_DATA"
  log "making a streaming replica of $PG_HOST:$PG_PORT in $REPLICA_DATA"
  pg_sql -c "select pg_drop_replication_slot('$REPLICA_SLOT') from pg_replication_slots where slot_name = '$REPLICA_SLOT'" >/dev/null
  as_pg "$PGBIN/pg_basebackup" -D "$REPLICA_DATA" -h "$PGRUN" -p "$PG_PORT" -U postgres \
    -R -C -S "$REPLICA_SLOT" -X stream -c fast >/dev/null || die "pg_basebackup failed"
}
pg_replica_start() {
  if ! as_pg "$PGBIN/pg_ctl" -D "$REPLICA_DATA" status >/dev/null 2>&1; then
    if pg_replica_ready; then die "something else answers on $PG_HOST:$PG_REPLICA_PORT; change postgres.replica_url"; fi
    as_pg "$PGBIN/pg_ctl" -D "$REPLICA_DATA" -l "$REPLICA_LOG" -w -t 60 start \
      -o "-p $PG_REPLICA_PORT -k $REPLICA_RUN -c listen_addresses=$PG_HOST -c max_connections=300 -c shared_buffers=128MB -c hot_standby=on -c recovery_min_apply_delay=$REPLICA_DELAY" >/dev/null \
      || die "the replica did not start; see $REPLICA_LOG"
  fi
  wait_for 30 pg_replica_ready || die "the replica does not answer; see $REPLICA_LOG"
}
pg_system_id() { as_pg "$PGBIN/pg_controldata" -D "$1" 2>/dev/null | sed -n 's/^Database system identifier: *//p'; }

pg_replica_up() {
  pg_replica_paths
  as_pg mkdir -p "$REPLICA_RUN"
  # None yet, one of an older primary (its data folder made again), or one
  # without its slot on the primary: made anew.
  if [ ! -f "$REPLICA_DATA/PG_VERSION" ] || [ -z "$(pg_sql -c "select 1 from pg_replication_slots where slot_name = '$REPLICA_SLOT'")" ] \
      || [ "$(pg_system_id "$REPLICA_DATA")" != "$(pg_system_id "$PGDATA")" ]; then
    pg_replica_make
  fi
  pg_replica_start
  # One that cannot stream (the WAL it needs is gone) is made anew, once.
  if ! wait_for 30 pg_replica_streams; then
    log "the replica does not stream from the primary; making it again"
    pg_replica_make
    pg_replica_start
    wait_for 60 pg_replica_streams || die "the replica does not stream; see $REPLICA_LOG"
  fi
}

pg_replica_down() {
  pg_replica_paths
  [ -n "$PGBIN" ] && [ -f "$REPLICA_DATA/postmaster.pid" ] || return 0
  as_pg "$PGBIN/pg_ctl" -D "$REPLICA_DATA" -m fast -w stop >/dev/null 2>&1 || true
}

# ---------------------------------------------------------------- Kafka ----
# Two processes, as KRaft runs in production: a controller (node 2, its own
# JVM and data) and the broker (node 1) that clients talk to. Stopping the
# broker (SIGSTOP) then does what a stalled broker does to a real cluster:
# the controller, still running, fences it, and when it continues it serves
# requests while its partitions have no leader, until it is unfenced. In one
# combined process that window lasted a few milliseconds, so the clients'
# handling of it (librdkafka #5430) was almost never exercised here.
KAFKA_DIR=$STATE/kafka
KAFKA_CONTROLLER_DIR=$STATE/kafka-controller
KAFKA_LIBS=$CACHE/kafka-$KAFKA_VERSION/libs
kafka_java() { java -cp "$KAFKA_LIBS/*" "$@"; }
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
kafka_port_open() { port_open "$KAFKA_HOST" "$KAFKA_PORT"; }
kafka_started() { grep -q "Kafka Server started" "$KAFKA_DIR/kafka.log" 2>/dev/null && kafka_port_open; }
controller_started() {
  grep -q "Kafka Server started" "$KAFKA_CONTROLLER_DIR/kafka.log" 2>/dev/null \
    && port_open "$KAFKA_HOST" "$KAFKA_CONTROLLER_PORT"
}
kafka_configs() { cat "$KAFKA_CONTROLLER_DIR/server.properties" "$KAFKA_DIR/server.properties"; }

kafka_fetch() {
  [ -f "$KAFKA_LIBS/.complete" ] && return
  log "fetching Apache Kafka $KAFKA_VERSION from Maven Central into $KAFKA_LIBS"
  rm -rf "$KAFKA_LIBS"
  mvn -B -q -Dstyle.color=never -f "$ROOT/scripts/kafka/pom.xml" -Dkafka.version="$KAFKA_VERSION" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$KAFKA_LIBS" \
    || die "could not fetch Kafka with mvn"
  touch "$KAFKA_LIBS/.complete"
}

kafka_config() {
  mkdir -p "$KAFKA_DIR" "$KAFKA_CONTROLLER_DIR"
  cat >"$KAFKA_CONTROLLER_DIR/server.properties" <<EOF
# Generated by scripts/services.sh; edits are overwritten.
process.roles=controller
node.id=2
controller.quorum.voters=2@$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
listeners=CONTROLLER://$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$KAFKA_CONTROLLER_DIR/data
EOF
  cat >"$KAFKA_DIR/server.properties" <<EOF
# Generated by scripts/services.sh; edits are overwritten.
process.roles=broker
node.id=1
controller.quorum.voters=2@$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
# FAULT is for the wire-fault tests only: a client that bootstraps through it
# is told the broker is at the FAULT proxy port, so all its traffic goes
# through the test's proxy (tests/common/wire.rs), which forwards to FAULT.
listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,FAULT://$KAFKA_HOST:$KAFKA_FAULT_PORT
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,FAULT://$KAFKA_HOST:$KAFKA_FAULT_PROXY_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,FAULT:PLAINTEXT
log.dirs=$KAFKA_DIR/data
num.partitions=4
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# As in production: every topic is created by the service (bus::ensure_topics),
# so a topic it forgets to create fails the tests instead of being made here.
auto.create.topics.enable=false
log.retention.hours=24
# Test runs create and delete many short-lived groups and topics.
offsets.retention.minutes=1440
delete.topic.enable=true
EOF
  kafka_log_config
}

# The brokers' log configuration (every node, single or cluster, reads it).
kafka_log_config() {
  mkdir -p "$KAFKA_DIR"
  cat >"$KAFKA_DIR/log4j2.properties" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
# Test runs create and delete thousands of partitions and groups: their
# per-partition INFO lines would grow this log by hundreds of MB a day.
logger.log.name = kafka.log
logger.log.level = WARN
logger.storage.name = org.apache.kafka.storage
logger.storage.level = WARN
logger.partition.name = kafka.cluster
logger.partition.level = WARN
logger.replication.name = org.apache.kafka.controller.ReplicationControlManager
logger.replication.level = WARN
logger.group.name = org.apache.kafka.coordinator.group
logger.group.level = WARN
logger.fetcher.name = kafka.server.ReplicaFetcherManager
logger.fetcher.level = WARN
logger.alterdirs.name = kafka.server.ReplicaAlterLogDirsManager
logger.alterdirs.level = WARN
EOF
}

# The two nodes' storage belongs to one cluster: formatted together, or kept
# together. A broker whose data was removed (scripts/chaos.sh starts each
# run empty), or data of the older single-process layout, starts over.
kafka_format() {
  if [ -f "$KAFKA_DIR/data/meta.properties" ] && [ -f "$KAFKA_CONTROLLER_DIR/data/meta.properties" ]; then
    return
  fi
  rm -rf "$KAFKA_DIR/data" "$KAFKA_CONTROLLER_DIR/data"
  mkdir -p "$KAFKA_DIR/data" "$KAFKA_CONTROLLER_DIR/data"
  local cluster dir
  cluster=$(kafka_java kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)
  for dir in "$KAFKA_CONTROLLER_DIR" "$KAFKA_DIR"; do
    kafka_java kafka.tools.StorageTool format -t "$cluster" -c "$dir/server.properties" \
      >"$dir/format.log" 2>&1 || die "kafka storage format failed; see $dir/format.log"
  done
}

# kafka_start DIR HEAP: one node; its output in DIR/kafka.log, its pid in
# DIR/kafka.pid.
kafka_start() {
  : >"$1/kafka.log"
  # shellcheck disable=SC2086
  nohup java -Xms"$2" -Xmx"$2" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 ${SECKILL_KAFKA_JVM_OPTS:-} \
    -Djava.awt.headless=true -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.properties" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$1/server.properties" \
    >>"$1/kafka.log" 2>&1 </dev/null &
  echo $! >"$1/kafka.pid"
}

kafka_up() {
  kafka_fetch
  # Nodes started with an older configuration of this script (or in the
  # older single-process layout) restart with the current one.
  local before; before=$(kafka_configs 2>/dev/null || true)
  kafka_config
  if [ "$before" != "$(kafka_configs)" ] \
    && { pid_alive "$KAFKA_DIR/kafka.pid" || pid_alive "$KAFKA_CONTROLLER_DIR/kafka.pid"; }; then
    log "kafka's configuration changed; restarting it"
    kafka_down
  fi
  if pid_alive "$KAFKA_DIR/kafka.pid" && kafka_started \
    && pid_alive "$KAFKA_CONTROLLER_DIR/kafka.pid" && controller_started; then
    log "kafka already runs"
    return
  fi
  # A node whose process is there but does not serve is on its way out (a
  # SIGKILL a moment ago: kill -0 still finds it until it is reaped) or
  # stuck: it is stopped for good before a new one starts.
  if pid_alive "$KAFKA_DIR/kafka.pid" && ! kafka_started; then kafka_stop "$KAFKA_DIR"; fi
  if pid_alive "$KAFKA_CONTROLLER_DIR/kafka.pid" && ! controller_started; then
    kafka_stop "$KAFKA_CONTROLLER_DIR"
  fi
  if ! pid_alive "$KAFKA_DIR/kafka.pid" && kafka_port_open; then
    die "something else listens on $KAFKA_HOST:$KAFKA_PORT; change kafka.brokers"
  fi
  kafka_format
  if ! pid_alive "$KAFKA_CONTROLLER_DIR/kafka.pid"; then
    if port_open "$KAFKA_HOST" "$KAFKA_CONTROLLER_PORT"; then
      die "something else listens on $KAFKA_HOST:$KAFKA_CONTROLLER_PORT (the kafka controller's port)"
    fi
    kafka_start "$KAFKA_CONTROLLER_DIR" "$KAFKA_CONTROLLER_HEAP"
  fi
  # On the 2-core host, with the suite's other lanes running, a broker's
  # plain start took 38 s and its restart after a SIGKILL (the nemesis's)
  # over 90 s: a host three times slower must still get its broker back.
  wait_for 300 controller_started \
    || die "the kafka controller did not start; see $KAFKA_CONTROLLER_DIR/kafka.log"
  pid_alive "$KAFKA_DIR/kafka.pid" || kafka_start "$KAFKA_DIR" "$KAFKA_HEAP"
  wait_for 300 kafka_started || die "kafka did not start; see $KAFKA_DIR/kafka.log"
}

# Stops one node (DIR) by its pid file.
kafka_stop() {
  pid_alive "$1/kafka.pid" || return 0
  local pid; pid=$(cat "$1/kafka.pid")
  kill "$pid" 2>/dev/null || true
  wait_for 30 bash -c "! kill -0 $pid 2>/dev/null" || kill -9 "$pid" 2>/dev/null || true
  rm -f "$1/kafka.pid"
}

# The broker first: its controlled shutdown asks the controller.
kafka_down() {
  kafka_stop "$KAFKA_DIR"
  kafka_stop "$KAFKA_CONTROLLER_DIR"
}

# The replicated variants, chosen by `up --kafka-cluster` / `--pg-ha` or by
# addresses that name three brokers / two PostgreSQL hosts.
# shellcheck source=services.d/kafka-cluster.sh
. "$ROOT/scripts/services.d/kafka-cluster.sh"
# shellcheck source=services.d/pg-ha.sh
. "$ROOT/scripts/services.d/pg-ha.sh"

# --------------------------------------------------------------- report ----
status() {
  pg_paths
  local r p k
  redis_ping && r=up || r=down
  pg_ready 2>/dev/null && p=up || p=down
  kafka_port_open && k=up || k=down
  if [ "$KAFKA_MODE" = cluster ]; then kafka_cluster_status; fi
  if [ "$PG_MODE" = ha ]; then pg_ha_status; fi
  printf '%-10s %-5s %-22s %s\n' service state listens log
  printf '%-10s %-5s %-22s %s\n' redis "$r" "$REDIS_HOST:$REDIS_PORT" "$REDIS_DIR/redis.log"
  printf '%-10s %-5s %-22s %s\n' postgres "$p" "$PG_HOST:$PG_PORT" "$PGLOG"
  pg_replica_paths
  if [ "$PG_MODE" != ha ] && [ -d "$REPLICA_DATA" ]; then
    local rp; pg_replica_ready 2>/dev/null && rp=up || rp=down
    printf '%-10s %-5s %-22s %s\n' replica "$rp" "$PG_HOST:$PG_REPLICA_PORT" "$REPLICA_LOG"
  fi
  printf '%-10s %-5s %-22s %s\n' kafka "$k" "$KAFKA_HOST:$KAFKA_PORT" "$KAFKA_DIR/kafka.log"
  if [ -d "$REDIS_CLUSTER_DIR" ]; then
    local c; cluster_ok && c=up || c=down
    printf '%-10s %-5s %-22s %s\n' cluster "$c" "$REDIS_HOST:$REDIS_CLUSTER_PORT+2" "$REDIS_CLUSTER_DIR/*/redis.log"
  fi
  [ "$r$p$k" = upupup ]
}

case "${1:-}" in
  up)
    shift
    want_redis_cluster= want_pg_replica=
    for flag in "$@"; do
      case "$flag" in
        --redis-cluster) want_redis_cluster=1 ;;
        --kafka-cluster) KAFKA_FORCE_CLUSTER=1 ;;
        --pg-ha) PG_FORCE_HA=1 ;;
        --pg-replica) want_pg_replica=1 ;;
        *) echo "unknown flag $flag" >&2; exit 2 ;;
      esac
    done
    install_missing
    load_settings
    [ -z "${KAFKA_FORCE_CLUSTER:-}" ] || KAFKA_MODE=cluster
    [ -z "${PG_FORCE_HA:-}" ] || PG_MODE=ha
    mkdir -p "$STATE"
    redis_up
    # The cluster too when asked, or when the configuration uses one.
    if [ -n "$want_redis_cluster" ] || [ "$REDIS_MODE" = cluster ]; then redis_cluster_up; fi
    if [ "$PG_MODE" = ha ]; then pg_ha_up; else pg_up; fi
    if [ -n "$want_pg_replica" ]; then
      [ "$PG_MODE" != ha ] || die "--pg-replica replicates the single server, not the --pg-ha pair"
      pg_replica_up
    fi
    if [ "$KAFKA_MODE" = cluster ]; then kafka_cluster_up; else kafka_up; fi
    status
    ;;
  install)
    install_missing
    kafka_fetch
    # pg_auto_failover, for `up --pg-ha` (the suite's replicated lane).
    pg_paths
    pg_ha_install
    ;;
  cluster-url)
    load_settings
    cluster_url
    ;;
  forget)
    # forget PREFIX: unlink every key starting with PREFIX on the server
    # and on each running cluster master, with SCAN (never KEYS, which
    # stops the server for everyone while it walks a big keyspace).
    load_settings
    prefix=${2:?forget PREFIX}
    for port in "$REDIS_PORT" $(cluster_ports); do
      redis-cli -h "$REDIS_HOST" -p "$port" PING >/dev/null 2>&1 || continue
      # One UNLINK per key: a cluster master refuses keys of several slots
      # in one command.
      redis-cli -h "$REDIS_HOST" -p "$port" --scan --pattern "$prefix*" \
        | sed 's/^/UNLINK /' | redis-cli -h "$REDIS_HOST" -p "$port" >/dev/null
    done
    ;;
  down)
    load_settings
    kafka_down
    kafka_cluster_down
    pg_replica_down
    pg_down
    pg_ha_down
    redis_cluster_down
    redis_down
    log "stopped"
    ;;
  start)
    install_missing
    load_settings
    mkdir -p "$STATE"
    case "${2:-}" in
      redis) redis_up ;;
      redis-cluster) redis_cluster_up ;;
      postgres) if [ "$PG_MODE" = ha ]; then pg_ha_up; else pg_up; fi ;;
      postgres-replica) pg_replica_up ;;
      kafka) if [ "$KAFKA_MODE" = cluster ]; then kafka_cluster_up; else kafka_up; fi ;;
      kafka-broker) kafka_cluster_broker start "${3:-}" ;;
      pg-node) pg_ha_node start "${3:-}" ;;
      *) echo "usage: $0 start redis|redis-cluster|postgres|postgres-replica|kafka|kafka-broker N|pg-node N" >&2; exit 2 ;;
    esac
    ;;
  stop)
    load_settings
    case "${2:-}" in
      redis) redis_down ;;
      redis-cluster) redis_cluster_down ;;
      postgres) if [ "$PG_MODE" = ha ]; then pg_ha_down; else pg_down; fi ;;
      postgres-replica) pg_replica_down ;;
      kafka) if [ "$KAFKA_MODE" = cluster ]; then kafka_cluster_down; else kafka_down; fi ;;
      kafka-broker) kafka_cluster_broker stop "${3:-}" ;;
      pg-node) pg_ha_node stop "${3:-}" ;;
      *) echo "usage: $0 stop redis|postgres|postgres-replica|kafka|kafka-broker N|pg-node N" >&2; exit 2 ;;
    esac
    ;;
  status)
    load_settings
    status
    ;;
  pid)
    # pid kafka-broker N | pg-node N: the process (a broker) or process
    # group (a node's keeper and its PostgreSQL) a fault test signals.
    load_settings
    case "${2:-}" in
      kafka-broker) cat "$(cluster_node_dir "broker-${3:?N}")/kafka.pid" ;;
      pg-node) pg_ha_paths; cat "$PGHA_DIR/node${3:?N}/keeper.pid" ;;
      *) echo "usage: $0 pid kafka-broker N|pg-node N" >&2; exit 2 ;;
    esac
    ;;
  *)
    echo "usage: $0 up [--redis-cluster] [--kafka-cluster] [--pg-ha] [--pg-replica]|install|down|start NAME|stop NAME|status|cluster-url" >&2
    exit 2
    ;;
esac
