#!/usr/bin/env bash
# Builds the image from the whole Dockerfile, build stage included, with
# buildah, and checks it the way the Helm chart runs it.
#
#   scripts/lib/image.sh CONSUME
#
# CONSUME is a host-built `outboxd-consume` (src/bin), used to read what the outboxd
# in the image published. No image can be pulled here, so the two base
# images are made locally first (scripts/lib/debian-slim.sh and
# scripts/lib/rust-builder.sh, once per machine); crates and Debian packages
# come from the registries this machine reaches. buildah keeps every layer
# (--layers): the apt layers are reused, and the cargo build runs again only
# when the build context changes, which .dockerignore narrows to Cargo.toml,
# Cargo.lock, src/, sdk/, vendor/ (librdkafka) and migrations/.
#
# Checks: the build context holds no target/ or .git; `outboxd --help`; the
# image runs as uid 10001; and, with a read-only root filesystem, every
# capability dropped and no-new-privileges (the chart's securityContext),
# `outboxd check` against throwaway PostgreSQL and Apache Kafka, then
# `outboxd run`: ready on /readyz, an outbox row reaches Kafka, and SIGTERM
# drains and exits 0. Prints the build time, the image size and its layers.
set -euo pipefail
cd "$(dirname "$0")/../.."
consume=$(realpath "$1")
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

log() { printf 'image: %s\n' "$*"; }
fail() { printf 'image: FAILED: %s\n' "$*" >&2; exit 1; }

work=$(mktemp -d)
container=""
# shellcheck source=services.sh
source scripts/lib/services.sh
cleanup() {
  [ -z "$container" ] || podman rm -f "$container" >/dev/null 2>&1 || true
  stop_services
  rm -rf "$work"
}
trap cleanup EXIT

builder=$(scripts/lib/rust-builder.sh)
base=$(scripts/lib/debian-slim.sh)
log "base images: $builder, $base"

# What the builder receives: the context after .dockerignore.
printf 'FROM %s\nCOPY . /context\n' "$base" >"$work/Containerfile.context"
buildah bud --quiet --isolation=chroot --pull=never --layers=false -t localhost/outboxd-context:check \
  -f "$work/Containerfile.context" . >/dev/null
read -r ctx_bytes ctx_files < <(podman run --rm localhost/outboxd-context:check \
  sh -c 'echo "$(du -sb /context | cut -f1) $(find /context -type f | wc -l)"')
for unwanted in target .git; do
  ! podman run --rm localhost/outboxd-context:check test -e "/context/$unwanted" \
    || fail "$unwanted/ is in the build context: check .dockerignore"
done
podman image rm localhost/outboxd-context:check >/dev/null
log "build context: $ctx_files files, $((ctx_bytes / 1024)) KiB (no target/, no .git)"

previous=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
untagged() { podman images -a --no-trunc --format '{{.ID}} {{.Repository}}' 2>/dev/null | awk '$2 == "<none>" { sub(/^sha256:/, "", $1); print $1 }' | sort -u; }
cached_before=$(untagged || true)
start=$(date +%s)
buildah bud --isolation=chroot --pull=never --layers -t "$image" -f Dockerfile . >"$work/build.log" 2>&1 \
  || { tail -n 60 "$work/build.log" >&2; fail "the Dockerfile does not build (log above)"; }
seconds=$(($(date +%s) - start))
if grep -q 'Compiling outboxd' "$work/build.log"; then how="the cargo build ran"; else how="every layer from the cache"; fi
size=$(podman image inspect --format '{{.Size}}' "$image")
log "built $image from the whole Dockerfile in ${seconds} s ($how); $((size / 1000 / 1000)) MB"
podman history --format '{{.Size}}\t{{.CreatedBy}}' "$image" \
  | awk -F'\t' '$1 != "0B" { printf "  %8s  %s\n", $1, substr($2, 1, 90) }'

help=$(podman run --rm "$image" --help)
grep -q 'Usage: outboxd \[OPTIONS\] <COMMAND>' <<<"$help" || fail "unexpected --help output: $help"
user=$(podman run --rm --entrypoint id "$image" -u)
[ "$user" = 10001 ] || fail "the image runs as uid $user, not 10001"
log "--help ok, runs as uid $user"

# As the chart runs it (helm/outboxd/templates/deployment.yaml): read-only
# root filesystem, no capabilities, no privilege escalation. Stricter in one
# point: the chart mounts an emptyDir on /tmp, here nothing is writable.
locked=(--read-only --read-only-tmpfs=false --cap-drop=ALL --security-opt=no-new-privileges --network host)

start_services
"${PSQL[@]}" -f migrations/0001_outbox.sql
http_port=$(free_port)
cat >"$work/outboxd.toml" <<TOML
[postgres]
url = "postgres://postgres:\${PGPASSWORD}@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
[kafka]
brokers = "127.0.0.1:$KAFKA_PORT"
topic_replication_factor = 1
[http]
listen = "127.0.0.1:$http_port"
[shutdown]
drain_timeout = "20s"
TOML
chmod 0644 "$work/outboxd.toml"
mount=(-v "$work/outboxd.toml:/etc/outboxd/outboxd.toml:ro")

podman run --rm "${locked[@]}" -e PGPASSWORD=unused "${mount[@]}" "$image" check --config /etc/outboxd/outboxd.toml
log "outboxd check passed inside the image (read-only root, no capabilities)"

container=$(podman run -d "${locked[@]}" -e PGPASSWORD=unused "${mount[@]}" "$image")
ready=""
for _ in $(seq 150); do
  if curl -fsS "http://127.0.0.1:$http_port/readyz" >/dev/null 2>&1; then ready=yes; break; fi
  [ "$(podman inspect --format '{{.State.Running}}' "$container")" = true ] || break
  sleep 0.2
done
[ -n "$ready" ] || { podman logs "$container" >&2; fail "outboxd in the image never became ready"; }
"${PSQL[@]}" -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
  VALUES ('0b7a1f6e-5d0c-4f0e-9d4e-2b8c7e1a9f00', 'ImageCheck', 'ic-1', 'image.checked.v1', '{\"ok\": true}')"
got=$("$consume" --brokers "127.0.0.1:$KAFKA_PORT" --count 1 --idle-secs 30 imagecheck.events 2>&1) \
  || { podman logs "$container" >&2; fail "the event did not reach imagecheck.events: $got"; }
grep -q 'ic-1' <<<"$got" || fail "unexpected record in imagecheck.events: $got"
podman stop -t 30 "$container" >/dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$container")
[ "$code" = 0 ] || { podman logs "$container" >&2; fail "outboxd exited $code after SIGTERM, not 0"; }
podman rm "$container" >/dev/null
container=""
log "outboxd run in the image (read-only root, no capabilities): ready, published to Kafka, drained on SIGTERM"

# A new build leaves the tag's previous image and the layers of earlier
# builds behind (the build stage's layer holds a whole target/ directory,
# about 1.5 GB). Remove what this build did not use; a general prune would
# also drop this build's cached layers, the next run's cache.
if [ -n "$previous" ] && [ "$previous" != "$(podman image inspect --format '{{.Id}}' "$image")" ]; then
  podman image rm "$previous" >/dev/null 2>&1 || true
fi
used=$(sed -n 's/^--> \(Using cache \)\{0,1\}\([0-9a-f]\{11,64\}\)$/\2/p' "$work/build.log" | sort -u)
stale=()
for id in $cached_before; do
  keep=""
  for u in $used; do case "$id" in "$u"*) keep=1; break ;; esac; done
  [ -n "$keep" ] || stale+=("$id")
done
# A layer goes once its children are gone: a pass per level of the chains.
for _ in 1 2 3 4 5 6 7 8; do
  removed=0
  for id in "${stale[@]}"; do
    podman image rm "$id" >/dev/null 2>&1 && removed=$((removed + 1))
  done
  [ "$removed" -gt 0 ] || break
done
