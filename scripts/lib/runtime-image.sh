#!/usr/bin/env bash
# Proves the Dockerfile's runtime stage: builds it with buildah around a
# host-built outboxd binary (the Rust build stage needs a rust:* image that
# cannot be pulled here), then runs `outboxd --help`, checks the user, and
# runs `outboxd check` in the container against throwaway PostgreSQL and
# broker instances on the host network.
#
# The base image debian:bookworm-slim is made locally with debootstrap
# from the Debian mirror apt already uses, once per machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
binary=$(realpath "$1")
image=localhost/outboxd:check

tools="${OUTBOXD_TOOLS:-$HOME/.cache/outboxd/tools}"
mkdir -p "$tools"
cat >"$tools/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF="$tools/containers.conf"

if ! podman image exists localhost/debian:bookworm-slim; then
  # Only active entries of enabled files: comments may name other archives.
  mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null \
    | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | tr -d ' ' | grep -v security | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  echo "runtime-image: making debian:bookworm-slim with debootstrap from $mirror"
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
  tar -C "$rootfs" -c . | podman import - localhost/debian:bookworm-slim >/dev/null
  rm -rf "$rootfs"
fi

ctx=$(mktemp -d)
# shellcheck source=services.sh
source scripts/lib/services.sh
cleanup() { stop_services; rm -rf "$ctx"; }
trap cleanup EXIT

cp "$binary" "$ctx/outboxd"
# The runtime stage exactly as in the Dockerfile, with the binary from the
# build context instead of the build stage.
sed -n '/^FROM debian:bookworm-slim AS runtime/,$p' Dockerfile \
  | sed 's#^COPY --from=build /src/target/release/outboxd #COPY outboxd #' >"$ctx/Dockerfile"
grep -q '^COPY outboxd /usr/local/bin/outboxd' "$ctx/Dockerfile" || { echo "runtime stage not found" >&2; exit 1; }
buildah bud --quiet --isolation=chroot --pull=never -t "$image" -f "$ctx/Dockerfile" "$ctx" >/dev/null

help=$(podman run --rm "$image" --help)
grep -q 'Usage: outboxd <COMMAND>' <<<"$help" || { echo "unexpected --help output: $help" >&2; exit 1; }
user=$(podman run --rm --entrypoint id "$image" -u)
[ "$user" = 10001 ] || { echo "the image runs as uid $user, not 10001" >&2; exit 1; }
echo "runtime-image: --help ok, runs as uid $user"

start_services
"${PSQL[@]}" -f migrations/0001_outbox.sql
cat >"$ctx/outboxd.toml" <<TOML
[postgres]
url = "postgres://postgres:\${PGPASSWORD}@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
[kafka]
brokers = "127.0.0.1:$KAFKA_PORT"
[http]
listen = "0.0.0.0:9187"
TOML
chmod 0644 "$ctx/outboxd.toml"
podman run --rm --network host -e PGPASSWORD=unused \
  -v "$ctx/outboxd.toml:/etc/outboxd/outboxd.toml:ro" "$image" check --config /etc/outboxd/outboxd.toml
echo "runtime-image: outboxd check passed inside the image"
# Earlier builds of the tag are left untagged: do not let them pile up.
podman image prune -f >/dev/null 2>&1 || true
