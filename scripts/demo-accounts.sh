#!/usr/bin/env bash
# Second quick start: seed 004's accounts end to end. Starts a throwaway
# PostgreSQL and Apache Kafka (as scripts/demo.sh does), the accounts service
# (examples/accounts_service: commands through the SDK's event store, three
# projections fed from Kafka, time travel), then outboxd between them. Sends
# commands with curl, waits for the projections, and shows one curl of each
# endpoint. Exits non-zero unless every answer is the expected one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

log() { printf '\n== %s\n' "$*"; }
fail() {
  for f in service outboxd; do
    [ -f "${WORK:-}/$f.log" ] && { echo "-- $f.log" >&2; tail -n 40 "$WORK/$f.log" >&2; }
  done
  printf 'demo-accounts: FAILED: %s\n' "$*" >&2
  exit 1
}
# shellcheck source=lib/services.sh
source scripts/lib/services.sh

cargo build --quiet --bin outboxd --example accounts_service
target="${CARGO_TARGET_DIR:-target}/debug"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  stop_services
}
trap cleanup EXIT

log "PostgreSQL (wal_level=logical) and Apache Kafka $(scripts/kafka.sh version) (KRaft)"
start_services
api_port=$(free_port)
api="http://127.0.0.1:$api_port"
db="postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"

log "the accounts service on $api (it applies the SDK's migrations)"
"$target/examples/accounts_service" --database-url "$db" --brokers "127.0.0.1:$KAFKA_PORT" \
  --listen "127.0.0.1:$api_port" --dlq-replication-factor 1 >"$WORK/service.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -fsS "$api/healthz" >/dev/null 2>&1 && break; sleep 0.2; done
curl -fsS "$api/healthz" >/dev/null || { cat "$WORK/service.log"; fail "the service did not start"; }

log "outboxd run (account.events from the outbox rows the event store writes)"
services_config
"$target/outboxd" run --config "$WORK/outboxd.toml" >"$WORK/outboxd.log" 2>&1 &
pids+=($!)
# Events committed before the slot exists are not in its stream: wait for it.
for _ in $(seq 100); do
  [ "$("${PSQL[@]}" -At -c "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = 1 ] && break
  sleep 0.1
done

# Prints the command, runs it, pretty-prints the JSON answer; the status
# must be the expected one.
call() {
  local want=$1 method=$2 path=$3 body=${4:-}
  local args=(-sS -o "$WORK/answer" -w '%{http_code}' -X "$method" "$api$path")
  [ -n "$body" ] && args+=(-H 'content-type: application/json' -d "$body")
  printf '\n$ curl -X %s %s%s%s\n' "$method" "$api" "$path" "${body:+ -d '$body'}"
  local got
  got=$(curl "${args[@]}")
  python3 -m json.tool <"$WORK/answer"
  [ "$got" = "$want" ] || fail "$method $path answered $got, not $want"
}

# A top-level field of the last answer.
field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$WORK/answer" "$1"; }

log "commands: open an account, two deposits, a withdrawal, a refused withdrawal"
call 201 POST /accounts '{"accountId": "acc-123", "ownerId": "owner-1", "initialBalance": 3000}'
call 200 POST /accounts/acc-123/deposits '{"amount": 2500, "description": "salary"}'
sleep 1
before_last=$(date -u +%Y-%m-%dT%H:%M:%S.%6NZ)
sleep 1
call 200 POST /accounts/acc-123/deposits '{"amount": 500, "description": "refund"}'
call 200 POST /accounts/acc-123/withdrawals '{"amount": 1200, "description": "rent"}'
call 422 POST /accounts/acc-123/withdrawals '{"amount": 99999, "description": "too much"}'

log "waiting for the three projections (lag 0 in GET /projections)"
for _ in $(seq 150); do
  if curl -fsS "$api/projections" | python3 -c '
import json, sys
p = json.load(sys.stdin)["projections"]
sys.exit(0 if len(p) == 3 and all(x["lag"] == 0 and x["applied"] >= 4 for x in p) else 1)'; then
    break
  fi
  sleep 0.2
done
call 200 GET /projections

log "reads: the balance view, the transaction history, the audit log"
call 200 GET /accounts/acc-123
[ "$(field balance)" = 4800 ] || fail "the balance view does not show 4800"
call 200 GET "/accounts/acc-123/transactions?limit=3"
call 200 GET /accounts/acc-123/audit

log "time travel: the account as it was at $before_last (before the last two commands)"
call 200 GET "/accounts/acc-123/state?at=$before_last"
[ "$(field balance)" = 5500 ] || fail "the state at $before_last is not 5500"
call 404 GET "/accounts/acc-123/state?at=2020-01-01T00:00:00Z"
call 200 GET /healthz
echo
echo "demo-accounts: every answer as expected"
