#!/usr/bin/env bash
# Runs the service on a fresh machine: installs and starts Redis, PostgreSQL
# and Kafka, applies the migrations, then serves on app.host:app.port
# (127.0.0.1:8080 by default). Ctrl-C stops the server; the services keep
# running (scripts/services.sh down stops them).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

scripts/services.sh up
cargo build --release --bin seckill
target/release/seckill migrate
exec target/release/seckill serve "$@"
