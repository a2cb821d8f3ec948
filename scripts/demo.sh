#!/usr/bin/env bash
# Quick start: outboxd end to end on throwaway local services.
#
# Starts a PostgreSQL 15 with wal_level=logical and a local Kafka-protocol
# broker (tansu) on free ports, applies the outbox migration, starts
# outboxd, writes sample events in transactions, prints them as consumed
# from Kafka, shows the slot's confirmed LSN, and stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

log() { printf '\n== %s\n' "$*"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cargo build --quiet --bin outboxd --example consume
target="${CARGO_TARGET_DIR:-target}/debug"

work=$(mktemp -d /tmp/outboxd-demo-XXXXXX)
pg_bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | head -n1)
as_pg=()
if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$work"; as_pg=(runuser -u postgres --); fi
pg_port=$(free_port)
kafka_port=$(free_port)
outboxd_pid= tansu_pid=

cleanup() {
  [ -n "$outboxd_pid" ] && kill "$outboxd_pid" 2>/dev/null || true
  [ -n "$tansu_pid" ] && kill "$tansu_pid" 2>/dev/null || true
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$work/data" stop -m immediate >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

log "PostgreSQL on 127.0.0.1:$pg_port (wal_level=logical)"
"${as_pg[@]}" "$pg_bin/initdb" -D "$work/data" -U postgres --auth=trust -E UTF8 --no-sync >/dev/null
"${as_pg[@]}" "$pg_bin/pg_ctl" -D "$work/data" -w -l "$work/pg.log" start \
  -o "-c port=$pg_port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$work -c wal_level=logical" >/dev/null
psql=(psql -X -q -h 127.0.0.1 -p "$pg_port" -U postgres -d postgres -v ON_ERROR_STOP=1)
"${psql[@]}" -f migrations/0001_outbox.sql

log "Kafka-protocol broker (tansu) on 127.0.0.1:$kafka_port"
"${OUTBOXD_TANSU:-$HOME/.cargo/bin/tansu}" broker --listener-url "tcp://127.0.0.1:$kafka_port" \
  --advertised-listener-url "tcp://127.0.0.1:$kafka_port" --storage-engine memory://tansu/ >"$work/tansu.log" 2>&1 &
tansu_pid=$!
for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$kafka_port") 2>/dev/null && break; sleep 0.1; done

cat >"$work/outboxd.toml" <<TOML
[postgres]
url = "postgres://postgres@127.0.0.1:$pg_port/postgres?sslmode=disable"

[kafka]
brokers = "127.0.0.1:$kafka_port"
topic_replication_factor = 1

[http]
listen = "127.0.0.1:0"
TOML

log "outboxd check"
"$target/outboxd" check --config "$work/outboxd.toml"

log "outboxd run"
"$target/outboxd" run --config "$work/outboxd.toml" &
outboxd_pid=$!
for _ in $(seq 100); do
  [ "$("${psql[@]}" -At -c "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = 1 ] && break
  sleep 0.1
done

log "writing 3 orders, one transaction each (an order row would commit in the same transaction)"
for order in 1001 1002 1003; do
  "${psql[@]}" <<SQL
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
"$target/examples/consume" --brokers "127.0.0.1:$kafka_port" --count 6 --idle-secs 15 order.events

log "replication slot: confirmed only after Kafka acknowledged (status updates go out every second)"
end_lsn=$("${psql[@]}" -At -c "SELECT pg_current_wal_lsn()")
for _ in $(seq 100); do
  [ "$("${psql[@]}" -At -c "SELECT confirmed_flush_lsn >= '$end_lsn' FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = t ] && break
  sleep 0.1
done
"${psql[@]}" -c "SELECT slot_name, active, confirmed_flush_lsn, pg_current_wal_lsn() FROM pg_replication_slots"

log "stopping outboxd (SIGTERM: drain, confirm, exit 0)"
kill -TERM "$outboxd_pid"
wait "$outboxd_pid"
outboxd_pid=
echo "outboxd exited 0"
