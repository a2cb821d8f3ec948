#!/usr/bin/env bash
# Profiles outboxd draining a backlog under valgrind's callgrind (instruction
# counts: repeatable on a busy machine). Usage: scripts/profile.sh [ROWS]
# (default 20000). Prints the functions with the most instructions and
# leaves the full profile in target/profile/ (callgrind.out, annotate.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-20000}
command -v valgrind >/dev/null || { sudo apt-get install -y valgrind || apt-get install -y valgrind; }
cargo build --quiet --release --bin outboxd
# shellcheck source=lib/services.sh
source scripts/lib/services.sh
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; stop_services; }
trap cleanup EXIT
start_services
"${PSQL[@]}" -f migrations/0001_outbox.sql
"${PSQL[@]}" -c "CREATE PUBLICATION outboxd FOR TABLE outbox WITH (publish = 'insert')" \
  -c "SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')" >/dev/null
for ((t = 0; t < rows / 100; t++)); do
  echo "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers)
        SELECT gen_random_uuid(), 'Order', 'order-' || ($t * 100 + g) % 5000, 'ordering.order-placed.v1',
               jsonb_build_object('orderId', $t * 100 + g, 'note', repeat('n', 200)),
               jsonb_build_object('correlationId', md5(g::text))
          FROM generate_series(1, 100) g;"
done | "${PSQL[@]}" >/dev/null
end=$("${PSQL[@]}" -At -c "SELECT pg_current_wal_lsn()")
services_config $'[log]\nlevel = "warn"'
mkdir -p target/profile
valgrind --tool=callgrind --callgrind-out-file=target/profile/callgrind.out \
  target/release/outboxd run --config "$WORK/outboxd.toml" 2>"$WORK/valgrind.log" &
pid=$!
until [ "$("${PSQL[@]}" -At -c "SELECT confirmed_flush_lsn >= '$end' FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = t ]; do
  sleep 0.5
done
kill -TERM "$pid"; wait "$pid" || true; pid=
callgrind_annotate --inclusive=no target/profile/callgrind.out >target/profile/annotate.txt 2>/dev/null
head -n 40 target/profile/annotate.txt
