#!/usr/bin/env bash
# Debezium (the incumbent) on loopback, for the side-by-side benchmark and
# the compatibility and takeover tests: Kafka Connect standalone with the
# Debezium PostgreSQL connector and its Outbox Event Router.
#
#   scripts/debezium.sh fetch         jars into $OUTBOXD_DEBEZIUM_HOME (idempotent)
#   scripts/debezium.sh version       the Debezium version `fetch` installs
#   scripts/debezium.sh connector --host H --port P --user U --password PW
#                         --dbname D --slot S --publication PUB
#                         [--topic-replacement T] [--set key=value]...
#                                     prints the connector's properties, set up
#                                     as close to outboxd's records as the
#                                     EventRouter allows
#   scripts/debezium.sh start DIR --brokers B --connector FILE
#                         [--worker-set key=value]... [--heap H]
#                                     writes DIR/worker.properties, starts
#                                     Connect in the background, waits until
#                                     the task is RUNNING, writes DIR/pid and
#                                     DIR/rest (the REST address)
#   scripts/debezium.sh stop DIR [--kill]
#                                     SIGTERM (Connect commits its offsets,
#                                     Debezium confirms the slot) and waits;
#                                     --kill sends SIGKILL instead
#
# The jars come from Maven Central through jvm/connect/pom.xml into
# ~/.cache/outboxd/debezium-<version>/libs, with Maven's repository in
# ~/.cache/outboxd/m2 (shared with scripts/kafka.sh).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
pom="$root/jvm/connect/pom.xml"
version=$(sed -n 's:.*<debezium.version>\(.*\)</debezium.version>.*:\1:p' "$pom")
cache="${XDG_CACHE_HOME:-$HOME/.cache}/outboxd"
home="${OUTBOXD_DEBEZIUM_HOME:-$cache/debezium-$version}"
m2="${OUTBOXD_M2_REPO:-$cache/m2}"
java="${JAVA:-java}"

# shellcheck source=scripts/lib/maven.sh
. "$root/scripts/lib/maven.sh"

die() { printf 'debezium.sh: %s\n' "$*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

converter_pom="$root/jvm/apicurio-converter/pom.xml"
converter_version=$(sed -n 's:.*<apicurio.version>\(.*\)</apicurio.version>.*:\1:p' "$converter_pom")
converter_home="${OUTBOXD_APICURIO_CONVERTER_HOME:-$cache/apicurio-converter-$converter_version}"

fetch() {
  maven_fetch debezium.sh "Debezium $version and Kafka Connect" "$pom" "$home" "$m2" \
    "debezium-connector-postgres-$version.jar"
  maven_fetch debezium.sh "Apicurio Registry's converter $converter_version" "$converter_pom" \
    "$converter_home" "$m2" "apicurio-registry-utils-converter-$converter_version.jar"
}

# The connector: pgoutput on an existing publication, no snapshot, and the
# EventRouter mapping outboxd's columns the way outboxd does (topic from
# aggregate_type, key aggregate_id, the payload's text as the value, and the
# id, type, aggregateType and aggregateId headers).
connector() {
  local host="" port="" user="" password="" dbname="" slot="" publication=""
  local replacement='${routedByValue}.events' extra=()
  while [ $# -gt 0 ]; do
    case $1 in
      --host) host=$2; shift 2 ;;
      --port) port=$2; shift 2 ;;
      --user) user=$2; shift 2 ;;
      --password) password=$2; shift 2 ;;
      --dbname) dbname=$2; shift 2 ;;
      --slot) slot=$2; shift 2 ;;
      --publication) publication=$2; shift 2 ;;
      --topic-replacement) replacement=$2; shift 2 ;;
      --set) extra+=("$2"); shift 2 ;;
      *) die "connector: unknown option $1" ;;
    esac
  done
  for v in host port user dbname slot publication; do
    [ -n "${!v}" ] || die "connector: --$v is required"
  done
  cat <<EOF
name=outbox
connector.class=io.debezium.connector.postgresql.PostgresConnector
tasks.max=1
database.hostname=$host
database.port=$port
database.user=$user
database.password=$password
database.dbname=$dbname
topic.prefix=dbz
plugin.name=pgoutput
slot.name=$slot
publication.name=$publication
publication.autocreate.mode=disabled
table.include.list=public.outbox
skipped.operations=u,d,t
snapshot.mode=no_data
extended.headers.enabled=false
tombstones.on.delete=false
heartbeat.interval.ms=1000
lsn.flush.mode=connector
key.converter=org.apache.kafka.connect.storage.StringConverter
value.converter=org.apache.kafka.connect.storage.StringConverter
topic.creation.default.replication.factor=1
topic.creation.default.partitions=3
transforms=outbox
transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
transforms.outbox.table.field.event.id=id
transforms.outbox.table.field.event.key=aggregate_id
transforms.outbox.table.field.event.payload=payload
transforms.outbox.route.by.field=aggregate_type
transforms.outbox.route.topic.replacement=$replacement
transforms.outbox.table.fields.additional.placement=type:header:type,aggregate_type:header:aggregateType,aggregate_id:header:aggregateId
transforms.outbox.table.expand.json.payload=false
transforms.outbox.table.op.invalid.behavior=warn
EOF
  local kv
  for kv in "${extra[@]}"; do echo "$kv"; done
}

start() {
  local dir=$1; shift
  local brokers="" connector_file="" heap="-Xms256m -Xmx1g" extra=()
  while [ $# -gt 0 ]; do
    case $1 in
      --brokers) brokers=$2; shift 2 ;;
      --connector) connector_file=$2; shift 2 ;;
      --worker-set) extra+=("$2"); shift 2 ;;
      --heap) heap=$2; shift 2 ;;
      *) die "start: unknown option $1" ;;
    esac
  done
  [ -n "$brokers" ] || die "start: --brokers is required"
  [ -f "$connector_file" ] || die "start: --connector FILE is required"
  fetch
  mkdir -p "$dir"
  local port name
  port=$(free_port)
  name=$(sed -n 's/^name=//p' "$connector_file")
  {
    echo "bootstrap.servers=$brokers"
    echo "listeners=http://127.0.0.1:$port"
    echo "key.converter=org.apache.kafka.connect.storage.StringConverter"
    echo "value.converter=org.apache.kafka.connect.storage.StringConverter"
    echo "offset.storage.file.filename=$dir/connect.offsets"
    # Connect's default is 60 s: the LSN would be confirmed a minute late.
    # One second is what a tuned deployment picks.
    echo "offset.flush.interval.ms=1000"
    echo "offset.flush.timeout.ms=5000"
    # Every plugin used has a service manifest: no reflective scan.
    echo "plugin.discovery=service_load"
    # The same producer settings as outboxd: idempotent, acks=all,
    # five in flight, linger 5 ms, batches up to 1 MB.
    echo "producer.enable.idempotence=true"
    echo "producer.max.in.flight.requests.per.connection=5"
    echo "producer.acks=all"
    echo "producer.linger.ms=5"
    echo "producer.batch.size=1000000"
    echo "producer.compression.type=none"
    local kv
    for kv in "${extra[@]}"; do echo "$kv"; done
  } >"$dir/worker.properties"
  echo "http://127.0.0.1:$port" >"$dir/rest"
  # shellcheck disable=SC2086
  setsid "$java" $heap -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$root/jvm/conf/log4j2.properties" \
    -cp "$home/libs/*:$converter_home/libs/*" org.apache.kafka.connect.cli.ConnectStandalone \
    "$dir/worker.properties" "$connector_file" >"$dir/connect.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$dir/pid"
  local state=""
  for _ in $(seq 1 240); do
    kill -0 "$pid" 2>/dev/null || die "Kafka Connect exited: $(tail -n 30 "$dir/connect.log")"
    state=$(curl -fsS "http://127.0.0.1:$port/connectors/$name/status" 2>/dev/null \
      | python3 -c 'import json,sys; t=json.load(sys.stdin)["tasks"]; print(t[0]["state"] if t else "")' 2>/dev/null || true)
    case $state in
      RUNNING) grep -q 'Processing messages\|Searching for WAL resume position\|streaming' "$dir/connect.log" && return 0 ;;
      FAILED) die "the Debezium task failed: $(curl -fsS "http://127.0.0.1:$port/connectors/$name/status")" ;;
    esac
    sleep 0.5
  done
  die "Debezium did not start streaming within 120 s (task state: ${state:-none}); see $dir/connect.log"
}

stop() {
  local dir=$1 signal=TERM
  [ "${2:-}" = "--kill" ] && signal=KILL
  [ -f "$dir/pid" ] || return 0
  local pid
  pid=$(cat "$dir/pid")
  kill -"$signal" "$pid" 2>/dev/null || true
  for _ in $(seq 1 120); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$dir/pid"; return 0; }
    sleep 0.25
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$dir/pid"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  fetch) fetch ;;
  version) echo "$version" ;;
  connector) connector "$@" ;;
  start) [ $# -ge 1 ] || die "usage: start DIR --brokers B --connector FILE"; start "$@" ;;
  stop) [ $# -ge 1 ] || die "usage: stop DIR [--kill]"; stop "$@" ;;
  *) die "usage: debezium.sh fetch|version|connector|start|stop" ;;
esac
