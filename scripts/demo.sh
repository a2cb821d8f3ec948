#!/usr/bin/env bash
# Quick start: outboxd end to end on throwaway local services.
#
# Starts a PostgreSQL 15 with wal_level=logical and an Apache Kafka broker
# (KRaft, one node, scripts/kafka.sh) on free ports, applies the outbox migration, starts
# outboxd, writes sample events in transactions, prints them as consumed
# from Kafka, shows the slot's confirmed LSN, and stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
scripts/setup.sh quick-start
setup_s=$((SECONDS - started))

log() { printf '\n== %s\n' "$*"; }
# shellcheck source=lib/services.sh
source scripts/lib/services.sh

step=$SECONDS
cargo build --quiet --bin outboxd --bin outboxd-consume
build_s=$((SECONDS - step))
target="${CARGO_TARGET_DIR:-target}/debug"

outboxd_pid=
cleanup() {
  [ -n "$outboxd_pid" ] && kill "$outboxd_pid" 2>/dev/null || true
  stop_services
}
trap cleanup EXIT

log "PostgreSQL (wal_level=logical) and Apache Kafka $(scripts/kafka.sh version) (KRaft)"
step=$SECONDS
start_services
services_s=$((SECONDS - step))
step=$SECONDS
echo "PostgreSQL on 127.0.0.1:$PG_PORT, broker on 127.0.0.1:$KAFKA_PORT"
"${PSQL[@]}" -f migrations/0001_outbox.sql

services_config

log "outboxd check"
"$target/outboxd" check --config "$WORK/outboxd.toml"

log "outboxd run"
"$target/outboxd" run --config "$WORK/outboxd.toml" &
outboxd_pid=$!
for _ in $(seq 100); do
  [ "$("${PSQL[@]}" -At -c "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = 1 ] && break
  sleep 0.1
done

log "writing 3 orders, one transaction each (an order row would commit in the same transaction)"
for order in 1001 1002 1003; do
  "${PSQL[@]}" <<SQL
BEGIN;
INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers) VALUES
  (gen_random_uuid(), 'Order', '$order', 'ordering.order-placed.v1',
   '{"orderId": "$order", "lines": [{"sku": "A-1", "qty": 2}]}', '{"correlationId": "demo-$order"}'),
  (gen_random_uuid(), 'Order', '$order', 'ordering.order-paid.v1',
   '{"orderId": "$order", "amount": 25.0}', '{"correlationId": "demo-$order"}');
COMMIT;
SQL
done

log "consumed from order.events"
"$target/outboxd-consume" --brokers "127.0.0.1:$KAFKA_PORT" --count 6 --idle-secs 15 order.events

log "replication slot: confirmed only after Kafka acknowledged"
end_lsn=$("${PSQL[@]}" -At -c "SELECT pg_current_wal_lsn()")
for _ in $(seq 100); do
  [ "$("${PSQL[@]}" -At -c "SELECT confirmed_flush_lsn >= '$end_lsn' FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = t ] && break
  sleep 0.1
done
"${PSQL[@]}" -c "SELECT slot_name, active, confirmed_flush_lsn, pg_current_wal_lsn() FROM pg_replication_slots"

log "stopping outboxd (SIGTERM: drain, confirm, exit 0)"
kill -TERM "$outboxd_pid"
wait "$outboxd_pid"
outboxd_pid=
echo "outboxd exited 0"
log "where the time went"
echo "setup (scripts/setup.sh quick-start): ${setup_s} s; build: ${build_s} s; services: ${services_s} s; outboxd, the events and the checks: $((SECONDS - step)) s; in all $((SECONDS - started)) s"
