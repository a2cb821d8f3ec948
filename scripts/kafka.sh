#!/usr/bin/env bash
# Apache Kafka (KRaft) on loopback for the tests, the demo, the benchmark and
# the image check: the one path that fetches, formats, starts and stops it.
#
#   scripts/kafka.sh fetch        jars into $OUTBOXD_KAFKA_HOME (idempotent)
#   scripts/kafka.sh version      the broker version that `fetch` installs
#   scripts/kafka.sh init DIR [--node-id N] [--roles R] [--port P]
#                         [--controller-port C] [--voters V]
#                         [--cluster-id ID] [--set key=value]...
#                                 writes DIR/server.properties and formats
#                                 DIR/data (a KRaft node, static quorum)
#   scripts/kafka.sh run DIR      runs the node in the foreground (exec java)
#   scripts/kafka.sh start DIR    runs it in the background, waits until it
#                                 is ready, writes DIR/pid
#   scripts/kafka.sh stop DIR     SIGTERM (controlled shutdown), then waits
#
# `init` without options makes a single combined broker+controller on free
# ports; it prints the bootstrap address. The jars come from Maven Central
# through jvm/broker/pom.xml into a cache outside the checkout:
# ~/.cache/outboxd/kafka-<version>/libs, with Maven's own repository in
# ~/.cache/outboxd/m2.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
pom="$root/jvm/broker/pom.xml"
version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom")
cache="${XDG_CACHE_HOME:-$HOME/.cache}/outboxd"
home="${OUTBOXD_KAFKA_HOME:-$cache/kafka-$version}"
m2="${OUTBOXD_M2_REPO:-$cache/m2}"
java="${JAVA:-java}"

# shellcheck source=scripts/lib/maven.sh
. "$root/scripts/lib/maven.sh"

die() { printf 'kafka.sh: %s\n' "$*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

fetch() {
  maven_fetch kafka.sh "Apache Kafka $version" "$pom" "$home" "$m2" "kafka_2.13-$version.jar"
}

# Sets JVM_CMD to the java command line for main class and arguments "$@".
# A small heap is plenty for the tests; KAFKA_HEAP_OPTS overrides it.
jvm_cmd() {
  # shellcheck disable=SC2086
  JVM_CMD=("$java" ${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m} -XX:+UseG1GC -XX:MaxGCPauseMillis=20
    -Djava.awt.headless=true -Dlog4j2.configurationFile="$root/jvm/conf/log4j2.properties"
    -cp "$home/libs/*" "$@")
}

init() {
  local dir=$1; shift
  local node_id=1 roles=broker,controller port="" cport="" voters="" cluster_id="" extra=()
  while [ $# -gt 0 ]; do
    case $1 in
      --node-id) node_id=$2; shift 2 ;;
      --roles) roles=$2; shift 2 ;;
      --port) port=$2; shift 2 ;;
      --controller-port) cport=$2; shift 2 ;;
      --voters) voters=$2; shift 2 ;;
      --cluster-id) cluster_id=$2; shift 2 ;;
      --set) extra+=("$2"); shift 2 ;;
      *) die "init: unknown option $1" ;;
    esac
  done
  fetch
  [ -n "$cport" ] || cport=$(free_port)
  [ -n "$voters" ] || voters="$node_id@127.0.0.1:$cport"
  # A cluster id is 16 random bytes in unpadded base64url. The --cluster-id=
  # form keeps one that starts with '-' from being read as an option.
  [ -n "$cluster_id" ] || cluster_id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
  mkdir -p "$dir"
  local listeners="" advertised=""
  case ",$roles," in *,broker,*)
    [ -n "$port" ] || port=$(free_port)
    listeners="PLAINTEXT://127.0.0.1:$port"
    advertised="PLAINTEXT://127.0.0.1:$port" ;;
  esac
  case ",$roles," in *,controller,*)
    listeners="${listeners:+$listeners,}CONTROLLER://127.0.0.1:$cport" ;;
  esac
  {
    echo "process.roles=$roles"
    echo "node.id=$node_id"
    echo "controller.quorum.voters=$voters"
    echo "controller.listener.names=CONTROLLER"
    echo "listeners=$listeners"
    [ -n "$advertised" ] && echo "advertised.listeners=$advertised"
    [ -n "$advertised" ] && echo "inter.broker.listener.name=PLAINTEXT"
    echo "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
    echo "log.dirs=$dir/data"
    # What a careful production cluster sets: topics are created on
    # purpose (outboxd creates its own), not by the first client that asks.
    echo "auto.create.topics.enable=false"
    echo "num.partitions=1"
    echo "offsets.topic.replication.factor=1"
    echo "offsets.topic.num.partitions=1"
    echo "group.initial.rebalance.delay.ms=0"
    echo "transaction.state.log.replication.factor=1"
    echo "transaction.state.log.min.isr=1"
    echo "share.coordinator.state.topic.replication.factor=1"
    echo "share.coordinator.state.topic.min.isr=1"
    # Fast failure detection for the fault tests (defaults: 9 s and 2 s).
    echo "broker.session.timeout.ms=6000"
    echo "broker.heartbeat.interval.ms=1000"
    local kv
    for kv in "${extra[@]}"; do echo "$kv"; done
  } >"$dir/server.properties"
  rm -rf "$dir/data"
  jvm_cmd kafka.tools.StorageTool format --cluster-id="$cluster_id" -c "$dir/server.properties"
  "${JVM_CMD[@]}" >"$dir/format.log" 2>&1 || die "formatting $dir/data failed: $(cat "$dir/format.log")"
  [ -n "$port" ] && echo "127.0.0.1:$port"
  return 0
}

run() {
  local dir=$1
  [ -f "$dir/server.properties" ] || die "$dir has no server.properties: run 'kafka.sh init $dir' first"
  fetch
  jvm_cmd kafka.Kafka "$dir/server.properties"
  exec "${JVM_CMD[@]}"
}

start() {
  local dir=$1 pid
  "$0" run "$dir" >"$dir/server.log" 2>&1 &
  pid=$!
  echo "$pid" >"$dir/pid"
  for _ in $(seq 1200); do
    grep -q 'Kafka Server started' "$dir/server.log" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || die "the broker exited during start-up: $(tail -n 30 "$dir/server.log")"
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  die "the broker was not ready within 120 s: $(tail -n 30 "$dir/server.log")"
}

stop() {
  local dir=$1 pid
  [ -f "$dir/pid" ] || return 0
  pid=$(cat "$dir/pid")
  kill -TERM "$pid" 2>/dev/null || { rm -f "$dir/pid"; return 0; }
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$dir/pid"
}

cmd=${1:-}; shift || true
case $cmd in
  fetch) fetch ;;
  version) echo "$version" ;;
  init) [ $# -ge 1 ] || die "usage: kafka.sh init DIR [options]"; init "$@" ;;
  run) [ $# -eq 1 ] || die "usage: kafka.sh run DIR"; run "$1" ;;
  start) [ $# -eq 1 ] || die "usage: kafka.sh start DIR"; start "$1" ;;
  stop) [ $# -eq 1 ] || die "usage: kafka.sh stop DIR"; stop "$1" ;;
  *) die "usage: kafka.sh fetch|version|init DIR|run DIR|start DIR|stop DIR" ;;
esac
