#!/usr/bin/env bash
# Is the image's binary reproducible? Builds the Dockerfile's build stage
# twice from scratch (buildah --no-cache: apt, crate downloads and the whole
# cargo build each time) and compares the SHA-256 of the stripped
# /src/target/release/outboxd. Both builds use one snapshot of the commit
# (git archive HEAD), so edits made meanwhile cannot differ between them.
# When the binaries differ, it lists the compiled artifacts (rlib, .a, .o)
# and the ELF sections that differ, the first places to look.
#
#   scripts/image-reproducibility.sh     (two cold builds: ~2 x the cold build time)
#
# Not part of scripts/test.sh; its last result is recorded in docs/image.md.
# OUTBOXD_REPRO_KEEP=DIR keeps both binaries and artifact lists there.
set -euo pipefail
cd "$(dirname "$0")/.."

export CONTAINERS_CONF="${OUTBOXD_TOOLS:-$HOME/.cache/outboxd/tools}/containers.conf"
[ -f "$CONTAINERS_CONF" ] || scripts/lib/deploy-tools.sh >/dev/null
scripts/lib/rust-builder.sh >/dev/null
work=${OUTBOXD_REPRO_KEEP:-$(mktemp -d)}
mkdir -p "$work"
trap '[ -n "${OUTBOXD_REPRO_KEEP:-}" ] || rm -rf "$work"; podman image rm localhost/outboxd-repro:1 localhost/outboxd-repro:2 >/dev/null 2>&1 || true' EXIT

src="$work/src"
rm -rf "$src" && mkdir -p "$src"
git archive HEAD | tar -x -C "$src"
echo "building $(git rev-parse --short HEAD) twice"

for n in 1 2; do
  start=$(date +%s)
  buildah bud --isolation=chroot --pull=never --no-cache --layers=false --target build \
    -t "localhost/outboxd-repro:$n" -f "$src/Dockerfile" "$src" >"$work/build-$n.log" 2>&1 \
    || { tail -n 40 "$work/build-$n.log" >&2; exit 1; }
  podman run --rm "localhost/outboxd-repro:$n" cat /src/target/release/outboxd >"$work/outboxd-$n"
  # Every compiled artifact, to find which one differs.
  podman run --rm "localhost/outboxd-repro:$n" sh -c \
    'cd /src/target/release && find . \( -name "*.rlib" -o -name "*.a" -o -name "*.o" \) -type f | sort | xargs sha256sum' \
    | sed 's/-[0-9a-f]\{16\}\([./]\)/\1/g' | sort -k2 >"$work/artifacts-$n"
  printf 'build %s: %s s, sha256 %s\n' "$n" "$(($(date +%s) - start))" "$(sha256sum <"$work/outboxd-$n" | cut -d' ' -f1)"
done

if cmp -s "$work/outboxd-1" "$work/outboxd-2"; then
  echo "reproducible: the two builds' binaries are identical ($(stat -c %s "$work/outboxd-1") bytes)"
else
  echo "NOT reproducible: the binaries differ. Compiled artifacts that differ:"
  join -1 2 -2 2 "$work/artifacts-1" "$work/artifacts-2" | awk '$2 != $3 { print "  " $1 }' | head -n 40
  echo "ELF sections that differ:"
  for s in $(readelf -SW "$work/outboxd-1" | sed -n 's/^ *\[ *[0-9]*\] \(\.[^ ]*\).*/\1/p'); do
    objcopy -O binary --only-section="$s" "$work/outboxd-1" "$work/s1" 2>/dev/null || continue
    objcopy -O binary --only-section="$s" "$work/outboxd-2" "$work/s2" 2>/dev/null || continue
    cmp -s "$work/s1" "$work/s2" || echo "  $s ($(stat -c %s "$work/s1") bytes)"
  done
  exit 1
fi
