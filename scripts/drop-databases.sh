#!/usr/bin/env bash
# Drops the databases whose names match a LIKE pattern on the PostgreSQL the
# configuration points at: what tests that crashed left behind.
#
#   scripts/drop-databases.sh 'seckill\_test\_%'
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
eval "$(python3 "$ROOT/scripts/settings.py")"
export PGPASSWORD=$PG_PASSWORD
pg() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres "$@"; }
for db in $(pg -tAc "select datname from pg_database where datname like '${1:?a LIKE pattern}'" || true); do
  pg -qc "drop database if exists \"$db\" with (force)" || true
done
