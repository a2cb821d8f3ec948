#!/usr/bin/env bash
# Installs what the tests, the demo and the benchmarks need on a fresh
# Debian/Ubuntu machine: the PostgreSQL 15 server binaries, PostgreSQL 17
# and 18 in Debian roots of their own (debootstrap; scripts/lib/
# postgres-root.sh; OUTBOXD_PG_VERSIONS="17 18" by default), the C build
# dependencies of librdkafka, the Rust toolchain components, a JDK (17+)
# and Maven, and from Maven Central Apache Kafka's jars (the local test
# broker; scripts/kafka.sh) and Kafka Connect with Debezium (the incumbent
# the suite and the benchmark compare with; scripts/debezium.sh), and the
# CloudEvents Python SDK (scripts/lib/cloudevents-sdk.sh), Apicurio
# Registry and a Java 21+ for it (scripts/registry.sh) with Confluent's
# Python registry clients (scripts/lib/registry-clients.sh), into
# ~/.cache/outboxd. Safe to run again:
# it installs only what is missing.
#
#   scripts/setup.sh              everything the tests need (scripts/test.sh)
#   scripts/setup.sh quick-start  only what scripts/demo.sh needs: PostgreSQL
#                                 15, the build dependencies, a JDK and Maven,
#                                 and the broker's jars
set -euo pipefail
what=${1:-tests}
case "$what" in
  tests|quick-start) ;;
  *) printf 'setup: unknown target %s (tests or quick-start)\n' "$what" >&2; exit 2 ;;
esac

log() { printf 'setup: %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root to run: $*"; exit 1
  fi
}

apt_updated=
apt_install() {
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

pg_bin=
for v in 15 16 17; do
  if [ -x "/usr/lib/postgresql/$v/bin/postgres" ]; then pg_bin=/usr/lib/postgresql/$v/bin; break; fi
done
if [ -z "$pg_bin" ]; then
  log "installing the PostgreSQL 15 server"
  apt_install postgresql-15 postgresql-client-15
  pg_bin=/usr/lib/postgresql/15/bin
fi
log "PostgreSQL binaries: $pg_bin"

# Newer servers for the version matrix, each in a Debian root of its own.
pg_versions=${OUTBOXD_PG_VERSIONS-17 18}
[ "$what" = quick-start ] && pg_versions=
if [ -n "$pg_versions" ]; then
  dpkg -s debootstrap >/dev/null 2>&1 || { log "installing debootstrap"; apt_install debootstrap; }
  for v in $pg_versions; do
    log "PostgreSQL $v: $("$(dirname "$0")/lib/postgres-root.sh" "$v")"
  done
fi

missing=()
for pkg in libssl-dev pkg-config make g++; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing build dependencies: ${missing[*]}"
  apt_install "${missing[@]}"
fi

for tool in runuser psql; do
  command -v "$tool" >/dev/null || { log "missing $tool"; exit 1; }
done

if command -v rustup >/dev/null && [ "$what" = tests ]; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi

# Apache Kafka, the local broker of the tests, the demo and the benchmark:
# a JDK and Maven from Debian, the broker's jars from Maven Central. Also
# with OUTBOXD_TEST_KAFKA_BROKERS set: the tests that stop brokers, and the
# cluster test, start brokers of their own.
missing=()
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  apt_install "${missing[@]}"
fi
"$(dirname "$0")/kafka.sh" fetch
log "broker: Apache Kafka $("$(dirname "$0")/kafka.sh" version) (scripts/kafka.sh)"
# The services' scripts pick free ports with python3.
command -v python3 >/dev/null || { log "installing python3"; apt_install python3; }
[ "$what" = quick-start ] && exit 0
# The CloudEvents SDK the tests decode CloudEvents records with.
if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  log "installing python3 and python3-venv"
  apt_install python3 python3-venv
fi
log "CloudEvents SDK: $("$(dirname "$0")/lib/cloudevents-sdk.sh")"
# The Schema Registry (Apicurio, on a Java 21+ that scripts/registry.sh
# finds or installs) and the independent clients that decode its records.
"$(dirname "$0")/registry.sh" fetch
log "Schema Registry: Apicurio $("$(dirname "$0")/registry.sh" version) on $("$(dirname "$0")/registry.sh" java) (scripts/registry.sh)"
log "registry clients: $("$(dirname "$0")/lib/registry-clients.sh")"
"$(dirname "$0")/debezium.sh" fetch
log "incumbent: Debezium $("$(dirname "$0")/debezium.sh" version) on Kafka Connect (scripts/debezium.sh)"
