# Throwaway local services for the demo and the image check: a PostgreSQL
# with wal_level=logical and an Apache Kafka broker (KRaft, one node), on
# free ports, in a temporary directory. Source this file, call
# start_services, and call stop_services on exit. Sets: WORK, PG_PORT,
# KAFKA_PORT, PSQL (array). services_config writes an outboxd config for
# them to $WORK/outboxd.toml.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

services_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

start_services() {
  WORK=$(mktemp -d /tmp/outboxd-services-XXXXXX)
  chmod 0755 "$WORK" # the postgres OS user reaches its own subdirectory
  PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | head -n1)
  AS_PG=()
  mkdir "$WORK/pg"
  if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$WORK/pg"; AS_PG=(runuser -u postgres --); fi
  PG_PORT=$(free_port)
  KAFKA_PORT=$(free_port)
  # The broker's JVM starts in the background while PostgreSQL starts.
  "$services_root/scripts/kafka.sh" init "$WORK/kafka" --port "$KAFKA_PORT" >/dev/null
  "$services_root/scripts/kafka.sh" start "$WORK/kafka" &
  local kafka_starting=$!
  "${AS_PG[@]}" "$PG_BIN/initdb" -D "$WORK/pg/data" -U postgres --auth=trust -E UTF8 --no-sync >/dev/null
  "${AS_PG[@]}" "$PG_BIN/pg_ctl" -D "$WORK/pg/data" -w -l "$WORK/pg/pg.log" start \
    -o "-c port=$PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$WORK/pg -c wal_level=logical" >/dev/null
  PSQL=(psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1)
  wait "$kafka_starting"
}

# Writes $WORK/outboxd.toml for these services, with optional extra TOML.
services_config() {
  cat >"$WORK/outboxd.toml" <<TOML
[postgres]
url = "postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"

[kafka]
brokers = "127.0.0.1:$KAFKA_PORT"
topic_replication_factor = 1

[http]
listen = "127.0.0.1:0"
TOML
  printf '%s\n' "${1:-}" >>"$WORK/outboxd.toml"
}

stop_services() {
  [ -n "${WORK:-}" ] || return 0
  "$services_root/scripts/kafka.sh" stop "$WORK/kafka" 2>/dev/null || true
  "${AS_PG[@]}" "$PG_BIN/pg_ctl" -D "$WORK/pg/data" stop -m immediate >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
