#!/usr/bin/env bash
# Makes the Rust builder image the Dockerfile's build stage names
# (`FROM rust:<version>-slim-bookworm`), in local container storage, since
# no image can be pulled here. It is made the way the official image is
# made (github.com/rust-lang/docker-rust, the slim variant): FROM
# debian:bookworm-slim, ca-certificates, gcc and libc6-dev from apt, and a
# rustup toolchain of the minimal profile (rustc, cargo, rust-std) under
# RUSTUP_HOME=/usr/local/rustup and CARGO_HOME=/usr/local/cargo, with
# /usr/local/cargo/bin first on PATH and RUST_VERSION set. Where the official
# image downloads that toolchain with rustup-init, this one copies the
# machine's own toolchain of the same version, component by component from
# rustup's install manifests. It also trusts the certificate authorities the
# machine itself added (see below). The Dockerfile stays unchanged: the image gets
# the name Docker would pull. Prints the image name.
set -euo pipefail
cd "$(dirname "$0")/../.."

tag=$(sed -n 's/^FROM rust:\([^ ]*\) AS build$/\1/p' Dockerfile)
[ -n "$tag" ] || { echo "rust-builder: no 'FROM rust:<tag> AS build' line in the Dockerfile" >&2; exit 1; }
case "$tag" in
  *-slim-bookworm) want=${tag%-slim-bookworm} ;;
  *) echo "rust-builder: only the slim-bookworm variant is made here, not rust:$tag" >&2; exit 1 ;;
esac
image="docker.io/library/rust:$tag"
builder_version=3

# The machine's toolchain whose rustc is version $want (1.95 matches 1.95.x).
toolchain="" version=""
while read -r tc _; do
  v=$(rustc "+$tc" --version 2>/dev/null | awk '{print $2}') || continue
  case "$v" in "$want" | "$want".*) toolchain=$tc version=$v; break ;; esac
done < <(rustup toolchain list)
if [ -z "$toolchain" ]; then
  echo "rust-builder: no Rust $want toolchain on this machine; installing it with rustup" >&2
  rustup toolchain install "$want" --profile minimal >&2
  toolchain="$want-x86_64-unknown-linux-gnu"
  version=$(rustc "+$toolchain" --version | awk '{print $2}')
fi

label=$(podman image inspect --format '{{ index .Labels "org.outboxd.builder" }}' "$image" 2>/dev/null || true)
if [ "$label" = "$builder_version/$version" ]; then
  echo "$image"
  exit 0
fi

base=$(scripts/lib/debian-slim.sh)
echo "rust-builder: making $image from $base and the machine's Rust $version ($toolchain)" >&2
sysroot=$(rustc "+$toolchain" --print sysroot)
host=$(rustc "+$toolchain" -vV | sed -n 's/^host: //p')
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT

# The toolchain: only the minimal profile's components, with rustup's own
# records of them, so that rustup inside the image knows what it has.
name="$version-$host"
dest="$ctx/rustup/toolchains/$name"
components=("rustc-$host" "cargo-$host" "rust-std-$host")
mkdir -p "$dest/lib/rustlib"
for c in "${components[@]}"; do
  manifest="$sysroot/lib/rustlib/manifest-$c"
  [ -f "$manifest" ] || { echo "rust-builder: $toolchain has no $c component ($manifest)" >&2; exit 1; }
  sed -n 's/^file://p' "$manifest" | (cd "$sysroot" && tar -c -T -) | tar -x -C "$dest"
  cp "$manifest" "$dest/lib/rustlib/"
done
printf '%s\n' "${components[@]}" >"$dest/lib/rustlib/components"
cp "$sysroot/lib/rustlib/rust-installer-version" "$sysroot/lib/rustlib/multirust-channel-manifest.toml" "$dest/lib/rustlib/"
{
  echo 'config_version = "1"'
  for c in rustc cargo rust-std; do
    printf '\n[[components]]\npkg = "%s"\ntarget = "%s"\nis_extension = false\n' "$c" "$host"
  done
} >"$dest/lib/rustlib/multirust-config.toml"
printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\n' "$name" >"$ctx/rustup/settings.toml"

# The machine's own certificate authorities (what it added to Debian's
# under /usr/local/share/ca-certificates): where its traffic to the package
# registries passes a TLS-inspecting proxy, cargo in the builder must trust
# that proxy as cargo on the machine does. None: nothing is added.
mkdir -p "$ctx/local-ca"
find /usr/local/share/ca-certificates -maxdepth 1 -name '*.crt' -exec cp {} "$ctx/local-ca/" \; 2>/dev/null || true

# rustup itself, and its proxies, as rustup-init lays them out.
mkdir -p "$ctx/cargo/bin"
cp "$(command -v rustup)" "$ctx/cargo/bin/rustup"
for proxy in cargo cargo-clippy cargo-fmt cargo-miri clippy-driver rls rust-analyzer rust-gdb rust-gdbgui rust-lldb rustc rustdoc rustfmt; do
  ln "$ctx/cargo/bin/rustup" "$ctx/cargo/bin/$proxy"
done

cat >"$ctx/Containerfile" <<EOF
FROM $base
ENV RUSTUP_HOME=/usr/local/rustup \\
    CARGO_HOME=/usr/local/cargo \\
    PATH=/usr/local/cargo/bin:\$PATH \\
    RUST_VERSION=$version
RUN apt-get update \\
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \\
 && rm -rf /var/lib/apt/lists/*
COPY local-ca /usr/local/share/ca-certificates
RUN update-ca-certificates >/dev/null
COPY rustup /usr/local/rustup
COPY cargo /usr/local/cargo
RUN chmod -R a+w \$RUSTUP_HOME \$CARGO_HOME \\
 && rustup --version && cargo --version && rustc --version
LABEL org.outboxd.builder=$builder_version/$version
EOF
buildah bud --quiet --isolation=chroot --pull=never --layers=false -t "$image" -f "$ctx/Containerfile" "$ctx" >"$ctx/build.log" 2>&1 \
  || { cat "$ctx/build.log" >&2; echo "rust-builder: building $image failed" >&2; exit 1; }
echo "$image"
