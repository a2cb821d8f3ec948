#!/usr/bin/env bash
# Makes a PostgreSQL server of another major version runnable on this
# bookworm machine: PostgreSQL 17 from Debian trixie, 18 from sid. Debian
# ships them only in newer suites whose C library bookworm does not have, so
# each version gets a Debian root of its own, made once with debootstrap into
# ~/.cache/outboxd/postgres/<version>/root, and a directory of wrappers,
# ~/.cache/outboxd/postgres/<version>/bin, that run each server tool
# (initdb, pg_ctl, postgres, psql, pg_basebackup, ...) inside that root
# with chroot, as the host's `postgres` user.
#
# Paths: a file the caller names must be visible at the same path inside
# the root. The root holds a symlink from its own host path to "/", so a
# path under <root>/ (for example a data directory under <root>/tmp) means
# the same file on the host and inside the chroot. The test harness puts
# its servers under <root>/tmp for that reason. TCP on 127.0.0.1 and Unix
# sockets under the root work across the chroot.
#
# Usage: postgres-root.sh VERSION   (prints the wrapper directory)
# Needs root (debootstrap and chroot). Idempotent: a finished root is kept.
set -euo pipefail

version=${1:?usage: postgres-root.sh VERSION (17 or 18)}
case "$version" in
  17) suite=trixie ;;
  18) suite=sid ;;
  *) echo "postgres-root: no Debian suite known for PostgreSQL $version (17 or 18; 15 comes from the host)" >&2; exit 2 ;;
esac
log() { printf 'postgres-root: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { log "PostgreSQL $version runs in a chroot, which needs root (as CI has); to test only against the host's PostgreSQL 15, set OUTBOXD_PG_VERSIONS=\"\""; exit 1; }
id postgres >/dev/null 2>&1 || { log "the host has no postgres user: install postgresql-common first (scripts/setup.sh does)"; exit 1; }

base="${OUTBOXD_PG_ROOTS:-$HOME/.cache/outboxd/postgres}/$version"
root="$base/root"
stamp="$base/.complete"
uid=$(id -u postgres)
gid=$(id -g postgres)

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$suite $uid:$gid" ]; then
  command -v debootstrap >/dev/null || { log "debootstrap is missing (scripts/lib/deploy-tools.sh installs it)"; exit 1; }
  mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null \
    | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | tr -d ' ' | grep -v security | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  log "making a Debian $suite root with postgresql-$version in $root (from $mirror; about a minute)"
  rm -rf "$base"
  mkdir -p "$base"
  debootstrap --variant=minbase --include="postgresql-$version" "$suite" "$root.tmp" "$mirror" >"$base/debootstrap.log" 2>&1 \
    || { tail -n 20 "$base/debootstrap.log" >&2; log "debootstrap failed (log: $base/debootstrap.log)"; exit 1; }
  mv "$root.tmp" "$root"
  # The package made a cluster of its own; the harness makes its own.
  chroot "$root" pg_dropcluster "$version" main 2>/dev/null || true
  # The server runs as the host's postgres user, so that files it writes
  # belong to the same user on both sides of the chroot.
  chroot "$root" groupmod -o -g "$gid" postgres
  chroot "$root" usermod -o -u "$uid" -g "$gid" postgres
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  mkdir -p "$root$(dirname "$root")"
  ln -sfn / "$root$root"
  # The server's user must be able to walk that path inside the root
  # (/root, for one, is private there as on the host).
  d=$(dirname "$root$root")
  while [ "$d" != "$root" ]; do chmod o+x "$d"; d=$(dirname "$d"); done
  chmod 1777 "$root/tmp"
  echo "$suite $uid:$gid" >"$stamp"
fi

bin="$base/bin"
mkdir -p "$bin"
for tool in "$root/usr/lib/postgresql/$version/bin/"*; do
  name=$(basename "$tool")
  cat >"$bin/$name.tmp" <<SH
#!/bin/sh
# $name of PostgreSQL $version, run in the Debian $suite root made by scripts/lib/postgres-root.sh.
if [ "\$(id -u)" != 0 ]; then
  echo "$name: PostgreSQL $version runs in a chroot: run this as root (it switches to the postgres user itself)" >&2; exit 1
fi
exec chroot --userspec=$uid:$gid "$root" /usr/lib/postgresql/$version/bin/$name "\$@"
SH
  chmod 0755 "$bin/$name.tmp"
  mv "$bin/$name.tmp" "$bin/$name"
done
# Where callers must keep files the server reads or writes.
echo "$root/tmp" >"$bin/.outboxd-chroot-tmp"
echo "$bin"
