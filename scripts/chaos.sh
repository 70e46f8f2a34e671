#!/usr/bin/env bash
# The fault tests (tests/chaos): each stops, kills or flushes a real
# process mid-sale and then checks the invariants. They run on a second set
# of services — other ports, another state folder — so the faults never
# touch the services the other tests use, and one at a time. The broker's
# data starts empty on every run.
#
#   scripts/chaos.sh [cargo test filter]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

export SECKILL_ENV=test
export SECKILL_SERVICES_DIR=${SECKILL_CHAOS_SERVICES_DIR:-$ROOT/.services-chaos}
export SECKILL__REDIS__URL=${SECKILL_CHAOS_REDIS_URL:-redis://127.0.0.1:6390}
export SECKILL__POSTGRES__URL=${SECKILL_CHAOS_POSTGRES_URL:-postgres://seckill:seckill@127.0.0.1:5434/seckill}
export SECKILL__KAFKA__BROKERS=${SECKILL_CHAOS_KAFKA:-127.0.0.1:9192}
export SECKILL_CHAOS=1

scripts/services.sh stop kafka
rm -rf "$SECKILL_SERVICES_DIR/kafka/data"
scripts/services.sh up

# Databases of fault tests that crashed.
scripts/drop-databases.sh 'seckill\_chaos\_%'

status=0
cargo test --test chaos -- --ignored --test-threads=1 --nocapture "$@" || status=$?
# The second set of services is only for these tests: give the memory back.
scripts/services.sh down
exit $status
