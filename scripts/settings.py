#!/usr/bin/env python3
"""Print the service addresses the server will use, as shell assignments.

Reads the same layers as the Rust `Settings`: config/default.toml, then
config/$SECKILL_ENV.toml (if present), then SECKILL__SECTION__KEY overrides,
so scripts/services.sh starts Redis, PostgreSQL and Kafka exactly where the
server will look for them. Only addresses are printed, never secrets.
"""
import os
import shlex
import sys
import tomllib
from urllib.parse import urlsplit

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    path = os.path.join(root, "config", f"{name}.toml")
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f)


def merged():
    cfg = load("default")
    env = os.environ.get("SECKILL_ENV", "development")
    for section, values in load(env).items():
        cfg.setdefault(section, {}).update(values)
    for key, value in os.environ.items():
        if key.startswith("SECKILL__"):
            parts = key[len("SECKILL__"):].lower().split("__")
            if len(parts) == 2:
                cfg.setdefault(parts[0], {})[parts[1]] = value
    return cfg


def main():
    cfg = merged()
    # In cluster mode redis.url lists the seed nodes: the first one is the
    # cluster's base port, and the single server sits 1000 below it.
    redis = urlsplit(cfg["redis"]["url"].split(",")[0].strip())
    cluster = cfg["redis"].get("mode") == "cluster"
    redis_port = (redis.port or 6379) - (1000 if cluster else 0)
    # A multi-host URL (the highly available pair, `up --pg-ha`) names the
    # primary first and its standby second.
    pg_url = cfg["postgres"]["url"]
    pg_hosts = pg_url.split("@", 1)[1].split("/", 1)[0] if "@" in pg_url else ""
    pg = urlsplit(pg_url.replace(pg_hosts, pg_hosts.split(",")[0], 1) if pg_hosts else pg_url)
    pg_ports = [h.rsplit(":", 1)[1] for h in pg_hosts.split(",") if ":" in h]
    replica = cfg["postgres"].get("replica_url", "").strip()
    brokers = [b.strip() for b in cfg["kafka"]["brokers"].split(",") if b.strip()]
    kafka_host, kafka_port = brokers[0].rsplit(":", 1)
    out = {
        "REDIS_HOST": redis.hostname or "127.0.0.1",
        "REDIS_PORT": str(redis_port),
        "REDIS_MODE": "cluster" if cluster else "standalone",
        # `up --redis-cluster`: three masters from the Redis port + 1000 on.
        "REDIS_CLUSTER_PORT": str(redis_port + 1000),
        "PG_HOST": pg.hostname or "127.0.0.1",
        "PG_PORT": str(pg.port or 5432),
        "PG_USER": pg.username or "seckill",
        "PG_PASSWORD": pg.password or "",
        "PG_DB": pg.path.lstrip("/") or "seckill",
        # The streaming replica `up` starts beside the primary: where
        # postgres.replica_url points, else 100 above the primary.
        "PG_REPLICA_PORT": str(urlsplit(replica).port or 5432) if replica else str((pg.port or 5432) + 100),
        # `up --pg-ha`: the two nodes' ports (the URL's), the monitor's next.
        "PG_HA_PORTS": " ".join(pg_ports),
        "PG_MODE": "ha" if len(pg_ports) == 2 else "single",
        "KAFKA_HOST": kafka_host,
        "KAFKA_PORT": kafka_port,
        # Three addresses: the replicated cluster (`up --kafka-cluster`).
        "KAFKA_BROKERS": ",".join(brokers),
        "KAFKA_MODE": "cluster" if len(brokers) == 3 else "single",
        "KAFKA_CONTROLLER_PORT": str(int(kafka_port) + 1),
        # A third listener for fault tests, advertised one port higher, where
        # a test's fault-injecting proxy listens (tests/common/wire.rs).
        "KAFKA_FAULT_PORT": str(int(kafka_port) + 2),
        "KAFKA_FAULT_PROXY_PORT": str(int(kafka_port) + 3),
    }
    for k, v in out.items():
        print(f"{k}={shlex.quote(v)}")


if __name__ == "__main__":
    sys.exit(main())
