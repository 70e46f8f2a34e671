#!/usr/bin/env bash
# Contract fuzzing: schemathesis (from PyPI) generates requests from the
# OpenAPI document the server generates from its code (GET
# /api/v1/openapi.json) and sends them to a running
# server on its own database and prefixes — anonymous, as a user, and as an
# admin. It fails on any 5xx, any answer outside the documented shape, or a
# panic in the server's log, and prints the counts.
#
#   scripts/fuzz.sh                 # the full run: 10 000+ requests
#   SECKILL_FUZZ_EXAMPLES=20 scripts/fuzz.sh   # short (scripts/test.sh)
#   scripts/fuzz.sh --install-only  # only install schemathesis (scripts/install.sh)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/own-server.sh
. scripts/own-server.sh

# Test cases per operation and per pass (28 operations, 3 passes; each case
# is one request, the coverage phase adds its own on top).
EXAMPLES=${SECKILL_FUZZ_EXAMPLES:-200}
SCHEMATHESIS_VERSION=4.32.5
VENV=${SECKILL_FUZZ_VENV:-$HOME/.cache/seckill/schemathesis-$SCHEMATHESIS_VERSION}

say() { printf '\n== %s\n' "$*" >&2; }

python_venv "$VENV" schemathesis "schemathesis==$SCHEMATHESIS_VERSION"
[ "${1:-}" = --install-only ] && exit 0
scripts/services.sh up >/dev/null
export SECKILL_ENV=test
start_own_server fuzz

# Something for the generated ids to find: a live activity and a coupon batch.
ADMIN=$($BIN token --admin)
USER_TOKEN=$($BIN token --user 7)
now() { python3 -c "import datetime as d; print((d.datetime.now(d.timezone.utc)+d.timedelta(seconds=$1)).isoformat())"; }
curl -fs -X POST "$URL/api/v1/admin/activities" -H "Authorization: Bearer $ADMIN" \
  -H 'content-type: application/json' \
  -d "{\"sku_id\":1,\"name\":\"Fuzz\",\"price_cents\":100,\"stock\":1000,\"start_at\":\"$(now -60)\",\"end_at\":\"$(now 3600)\",\"per_user_limit\":5,\"pay_timeout_secs\":600,\"buckets\":2}" >/dev/null
curl -fs -X POST "$URL/api/v1/admin/activities/1/warmup" -H "Authorization: Bearer $ADMIN" >/dev/null
curl -fs -X POST "$URL/api/v1/admin/coupons" -H "Authorization: Bearer $ADMIN" \
  -H 'content-type: application/json' \
  -d "{\"name\":\"Fuzz\",\"total\":100,\"discount_cents\":10,\"min_amount_cents\":0,\"per_user_limit\":1,\"valid_until\":\"$(now 3600)\"}" >/dev/null

CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance
status=0
for pass in anonymous user admin; do
  case $pass in
    anonymous) AUTH=() ;;
    user) AUTH=(-H "Authorization: Bearer $USER_TOKEN") ;;
    admin) AUTH=(-H "Authorization: Bearer $ADMIN") ;;
  esac
  say "schemathesis, $pass: $EXAMPLES cases per operation"
  # One worker: with two threads, Python 3.11's ast module (used while
  # schemathesis builds its coverage cases) can fail with "SystemError: AST
  # constructor recursion depth mismatch" (CPython gh-106905), a crash of
  # the tool that fails the pass with no request at fault.
  "$VENV/bin/schemathesis" run "$URL/api/v1/openapi.json" --url "$URL" "${AUTH[@]}" \
    --checks "$CHECKS" --max-examples "$EXAMPLES" --seed 20261130 \
    --phases examples,coverage,fuzzing --workers 1 --no-color \
    --suppress-health-check all --generation-database none \
    --report ndjson --report-ndjson-path "$OUT/$pass.ndjson" \
    >"$OUT/$pass.txt" 2>&1 || status=1
  tail -n 25 "$OUT/$pass.txt" >&2
done

# Counts from the event streams, 5xx answers and panics from what the
# server logged.
python3 - "$OUT" <<'EOF'
import base64, json, pathlib, sys
out = pathlib.Path(sys.argv[1])
requests = server_errors = failures = misshapen = 0
for f in sorted(out.glob("*.ndjson")):
    for line in f.read_text().splitlines():
        body = json.loads(line).get("ScenarioFinished")
        if not body:
            continue
        recorder = body.get("recorder", {})
        for case in recorder.get("interactions", {}).values():
            response = case.get("response") or {}
            status = response.get("status_code", 0)
            requests += 1
            server_errors += status >= 500
            # Every error an RFC 9457 problem with its code:
            # {"type", "title", "status", "detail", "code", "message"}.
            if status >= 400:
                raw = (response.get("content") or {}).get("$base64", "")
                try:
                    err = json.loads(base64.b64decode(raw))
                    ok = (isinstance(err.get("code"), str) and isinstance(err.get("message"), str)
                          and err.get("type") == "urn:seckill:problem:" + err["code"]
                          and isinstance(err.get("title"), str) and err.get("status") == status
                          and err.get("detail") == err.get("message"))
                except (ValueError, AttributeError):
                    ok = False
                if not ok:
                    misshapen += 1
                    print(f"misshapen {status}: {case['request']['method']} {case['request']['uri']}")
        for checks in recorder.get("checks", {}).values():
            failures += sum(1 for c in checks if c.get("status", "").lower() == "failure")
log = (out / "server.log").read_text(errors="replace")
panics = log.count("panicked")
print(f"fuzz: {requests} requests, {server_errors} 5xx, {failures} failed checks, "
      f"{misshapen} errors outside the documented shape, {panics} panics")
(out / "counts").write_text(f"{requests} {server_errors} {failures + misshapen} {panics}\n")
EOF
read -r REQUESTS FIVE_XX FAILED PANICS <"$OUT/counts"
if [ "$FIVE_XX" != 0 ] || [ "$FAILED" != 0 ] || [ "$PANICS" != 0 ] || [ "$status" != 0 ]; then
  echo "fuzz: FAILED (reports in $OUT)" >&2
  exit 1
fi
echo "fuzz: passed ($REQUESTS requests; reports in $OUT)" >&2
