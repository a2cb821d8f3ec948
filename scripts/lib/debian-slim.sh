#!/usr/bin/env bash
# Makes docker.io/library/debian:bookworm-slim in local container storage,
# once per machine, since no image can be pulled here. It is made the way
# the official image is made (debuerreotype): a minbase debootstrap from
# the Debian mirror apt already uses, then "slimmed": dpkg is told to skip
# documentation, manual pages and translations (copyright files are kept),
# the files already installed there are removed, and apt keeps no package
# cache or index. The image carries the same PATH and CMD as the official
# one. Prints the image name.
#
# An image from an older version of this script (a plain, unslimmed
# debootstrap) is replaced: the label org.outboxd.base-version says which.
set -euo pipefail

image=docker.io/library/debian:bookworm-slim
base_version=2

label=$(podman image inspect --format '{{ index .Labels "org.outboxd.base-version" }}' "$image" 2>/dev/null || true)
if [ "$label" = "$base_version" ]; then
  echo "$image"
  exit 0
fi

# Only active entries of enabled files: comments may name other archives.
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null \
  | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | tr -d ' ' | grep -v security | head -n1 || true)
mirror=${mirror:-http://deb.debian.org/debian}
echo "debian-slim: making $image with debootstrap from $mirror" >&2
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null

# Slim: what dpkg must not install from now on, and what it already did.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'CFG'
# Keeps images small (as the official slim images do).
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
CFG
find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$rootfs"/usr/share/{groff,info,linda,lintian/overrides,locale,man}/*

# apt: no package cache, no translations, no suggested packages kept.
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'CFG'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
CFG
echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
printf 'Apt::AutoRemove::SuggestsImportant "false";\n' >"$rootfs/etc/apt/apt.conf.d/docker-autoremove-suggests"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
rm -f "$rootfs"/var/log/apt/* "$rootfs"/var/log/dpkg.log "$rootfs"/var/log/bootstrap.log "$rootfs"/var/log/alternatives.log

tar -C "$rootfs" --numeric-owner -c . | podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' \
  --change "LABEL org.outboxd.base-version=$base_version" \
  - "$image" >/dev/null
# The first versions of this script tagged the image localhost/debian.
podman image rm localhost/debian:bookworm-slim >/dev/null 2>&1 || true
echo "$image"
