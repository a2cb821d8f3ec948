#!/usr/bin/env bash
# Installs what the tests, the demo and the benchmarks need on a fresh
# Debian/Ubuntu machine: the PostgreSQL 15 server binaries, the C build
# dependencies of librdkafka, the Rust toolchain components, and tansu (a
# Kafka-protocol broker used as the local test broker). Safe to run again:
# it installs only what is missing.
set -euo pipefail

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

if command -v rustup >/dev/null; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi

# The local Kafka-protocol broker for the tests and the demo. A clean build
# takes about 15 minutes on 2 cores, so it is installed once per machine.
tansu_version=0.6.0
if [ -z "${OUTBOXD_TEST_KAFKA_BROKERS:-}" ]; then
  tansu="${OUTBOXD_TANSU:-$HOME/.cargo/bin/tansu}"
  if [ ! -x "$tansu" ]; then
    log "installing tansu $tansu_version (the local test broker; this takes a while)"
    cargo install tansu --version "$tansu_version" --locked --features dynostore
  fi
  log "broker: $tansu"
fi
