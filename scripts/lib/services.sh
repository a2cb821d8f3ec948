# Throwaway local services for the demo and the image check: a PostgreSQL
# with wal_level=logical and a tansu broker, on free ports, in a temporary
# directory. Source this file, call start_services, and call
# stop_services on exit. Sets: WORK, PG_PORT, KAFKA_PORT, PSQL (array).
# services_config writes an outboxd config for them to $WORK/outboxd.toml.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_services() {
  WORK=$(mktemp -d /tmp/outboxd-services-XXXXXX)
  PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | head -n1)
  AS_PG=()
  if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$WORK"; AS_PG=(runuser -u postgres --); fi
  PG_PORT=$(free_port)
  KAFKA_PORT=$(free_port)
  "${AS_PG[@]}" "$PG_BIN/initdb" -D "$WORK/data" -U postgres --auth=trust -E UTF8 --no-sync >/dev/null
  "${AS_PG[@]}" "$PG_BIN/pg_ctl" -D "$WORK/data" -w -l "$WORK/pg.log" start \
    -o "-c port=$PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$WORK -c wal_level=logical" >/dev/null
  PSQL=(psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1)
  "${OUTBOXD_TANSU:-$HOME/.cargo/bin/tansu}" broker --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" --storage-engine memory://tansu/ >"$WORK/tansu.log" 2>&1 &
  TANSU_PID=$!
  for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$KAFKA_PORT") 2>/dev/null && return 0; sleep 0.1; done
  echo "the broker did not start: $(cat "$WORK/tansu.log")" >&2
  return 1
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
  [ -n "${TANSU_PID:-}" ] && kill "$TANSU_PID" 2>/dev/null || true
  [ -n "${WORK:-}" ] && "${AS_PG[@]}" "$PG_BIN/pg_ctl" -D "$WORK/data" stop -m immediate >/dev/null 2>&1 || true
  [ -n "${WORK:-}" ] && rm -rf "$WORK"
}
