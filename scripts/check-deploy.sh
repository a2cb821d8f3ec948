#!/usr/bin/env bash
# Checks the deployment artifacts: the Dockerfile (hadolint), the Helm chart
# (lint, render, Kubernetes schema validation, yamllint, and the properties
# operators rely on), the alert rules and the dashboard, and the image: the
# whole Dockerfile built with buildah (base images made locally, since none
# can be pulled here; layers cached between runs), then run as the chart
# runs it against throwaway PostgreSQL and Apache Kafka
# (scripts/lib/image.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== check-deploy: %s\n' "$*"; }
fail() { printf 'check-deploy: FAILED: %s\n' "$*" >&2; exit 1; }

tools=$(scripts/lib/deploy-tools.sh | tail -n1)
export PATH="$tools:$PATH"
py="$(dirname "$tools")/venv/bin/python" # has PyYAML (a kubernetes-validate dependency)
target="${CARGO_TARGET_DIR:-target}"
render=$(mktemp -d)
cleanup() { rm -rf "$render"; }
trap cleanup EXIT

log "hadolint Dockerfile"
hadolint Dockerfile

log "helm lint"
helm lint --strict helm/outboxd --set secrets.PGPASSWORD=x

log "helm template: default, existingSecret, and everything on with the monitoring API"
helm template t helm/outboxd --set secrets.PGPASSWORD=x >"$render/default.yaml"
helm template t helm/outboxd --set existingSecret=pg-credentials >"$render/existing.yaml"
helm template t helm/outboxd --set secrets.PGPASSWORD=x \
  --set serviceMonitor.enabled=true --set prometheusRule.enabled=true --set podDisruptionBudget.enabled=true \
  --api-versions monitoring.coreos.com/v1 >"$render/full.yaml"
helm template t helm/outboxd --set secrets.PGPASSWORD=x --set serviceMonitor.enabled=true >"$render/no-api.yaml"
helm template t helm/outboxd --set secrets.PGPASSWORD=x --set replicaCount=2 --set strategy.type=RollingUpdate \
  --set podDisruptionBudget.enabled=true >"$render/ha.yaml"
printf 'drainTimeoutSeconds: 60\nconfig: |\n  [postgres]\n  url = "postgres://u@h/db"\n' >"$render/other-values.yaml"
helm template t helm/outboxd --set secrets.PGPASSWORD=x -f "$render/other-values.yaml" >"$render/other-config.yaml"
cat >"$render/sources-values.yaml" <<'YAML'
sources:
  - name: orders
    postgres: {url: "postgres://outboxd:${PGPASSWORD}@orders-db/orders", slot: outboxd_orders, publication: outboxd_orders}
  - name: billing
    required: false
    postgres: {url: "postgres://outboxd:${PGPASSWORD}@billing-db/billing", slot: outboxd_billing, publication: outboxd_billing}
    columns: {key: aggregateid, route: aggregatetype, additional: [{column: type, placement: header, name: eventType}, {column: part, placement: partition}]}
    routing: {topic: "billing.{aggregate_type}", on_poison: park, park: {max_sequences: 50}}
    kafka: {delivery: exactly-once}
YAML
helm template t helm/outboxd --set secrets.PGPASSWORD=x -f "$render/sources-values.yaml" >"$render/sources.yaml"
# Two pods of one source stay Recreate (a standby is never ready, so a
# surge pod would stall a rolling update).
helm template t helm/outboxd --set secrets.PGPASSWORD=x --set replicas=2 >"$render/standby.yaml"
# Three pods of those sources: they share them through a consumer group.
helm template t helm/outboxd --set secrets.PGPASSWORD=x -f "$render/sources-values.yaml" --set replicas=3 \
  --set 'sources[1].weight=2' >"$render/replicas.yaml"

log "kubernetes-validate --strict (core kinds)"
"$py" - "$render" <<'PY'
import sys, yaml, pathlib
out = pathlib.Path(sys.argv[1]) / "core"
out.mkdir()
for f in ("default.yaml", "existing.yaml", "full.yaml", "ha.yaml", "replicas.yaml"):
    docs = [d for d in yaml.safe_load_all(open(pathlib.Path(sys.argv[1]) / f)) if d]
    core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    for i, d in enumerate(core):
        (out / f"{f}-{i}.yaml").write_text(yaml.safe_dump(d))
PY
kubernetes-validate --strict --quiet "$render"/core/*.yaml

log "yamllint on the rendered chart and the alert rules"
yamllint -d '{extends: default, rules: {line-length: {max: 160}, document-start: disable, indentation: {spaces: consistent, indent-sequences: whatever}}}' \
  "$render/default.yaml" "$render/full.yaml" helm/outboxd/files/alerts.yaml

log "chart properties"
"$py" - "$render" <<'PY'
import json, sys, yaml, pathlib
r = pathlib.Path(sys.argv[1])
def docs(f): return [d for d in yaml.safe_load_all(open(r / f)) if d]
def kind(f, k): return [d for d in docs(f) if d["kind"] == k]
dep = kind("default.yaml", "Deployment")[0]
spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
c = pod["containers"][0]
assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate", "one reader per slot"
assert pod["terminationGracePeriodSeconds"] > 30 + 30, "grace period longer than the drain timeout and outboxd's margin past it"
assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
sc, psc = c["securityContext"], pod["securityContext"]
assert psc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"]
assert not sc["allowPrivilegeEscalation"]
assert c["resources"]["limits"]["memory"]
cm = kind("default.yaml", "ConfigMap")[0]["data"]["outboxd.toml"]
assert 'listen = "0.0.0.0:9187"' in cm and 'drain_timeout = "30s"' in cm and "${PGPASSWORD}" in cm
assert kind("default.yaml", "Secret")[0]["stringData"]["PGPASSWORD"] == "x"
assert c["envFrom"][0]["secretRef"]["name"] == "t-outboxd"
assert not kind("existing.yaml", "Secret"), "no Secret with existingSecret"
assert kind("existing.yaml", "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["secretRef"]["name"] == "pg-credentials"
assert kind("full.yaml", "ServiceMonitor") and kind("full.yaml", "PrometheusRule") and kind("full.yaml", "PodDisruptionBudget")
assert not kind("no-api.yaml", "ServiceMonitor"), "ServiceMonitor only when the API exists"
ann = lambda f: kind(f, "Deployment")[0]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
assert ann("default.yaml") != ann("other-config.yaml"), "pods roll when the config changes"
assert kind("other-config.yaml", "Deployment")[0]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 95
ha = kind("ha.yaml", "Deployment")[0]["spec"]
assert ha["replicas"] == 2 and ha["strategy"]["type"] == "RollingUpdate", "the HA mode renders"
rules = yaml.safe_load(open("helm/outboxd/files/alerts.yaml"))
names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
assert {"OutboxdReplicationLagHigh", "OutboxdRetainedWalHigh", "OutboxdNoAcks", "OutboxdNotReady", "OutboxdKafkaTransactionsAborting"} <= names
dash = json.load(open("deploy/grafana/outboxd-dashboard.json"))
exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
for m in ("outboxd_replication_lag_bytes", "outboxd_slot_retained_wal_bytes", "outboxd_commit_to_ack_seconds_bucket", "outboxd_ready", "outboxd_kafka_transactions_total", "outboxd_kafka_commit_seconds_bucket", "outboxd_failover_protected"):
    assert m in exprs, m
print("chart, alerts and dashboard: ok")
PY

log "the embedded config is valid for outboxd"
cargo build --quiet --bin outboxd --bin outboxd-consume
binary="$target/debug/outboxd"
"$py" -c 'import sys,yaml; print([d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"]=="ConfigMap"][0]["data"]["outboxd.toml"])' \
  "$render/default.yaml" >"$render/outboxd.toml"
PGPASSWORD=x "$binary" check --config-only --config "$render/outboxd.toml" \
  || fail "the chart's config does not validate"
"$py" -c 'import sys,yaml; print([d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"]=="ConfigMap"][0]["data"]["outboxd.toml"])' \
  "$render/sources.yaml" >"$render/sources.toml"
grep -q '^\[\[sources\]\]' "$render/sources.toml" || fail "values.sources rendered no [[sources]]"
for s in orders billing; do
  PGPASSWORD=x "$binary" check --config-only --source "$s" --config "$render/sources.toml" \
    || fail "the chart's config of source $s does not validate"
done
! grep -q '^\[coordination\]' "$render/sources.toml" || fail "one pod of several sources needs no [coordination]"
"$py" -c 'import sys,yaml; print([d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"]=="ConfigMap"][0]["data"]["outboxd.toml"])' \
  "$render/replicas.yaml" >"$render/replicas.toml"
grep -q '^\[coordination\]' "$render/replicas.toml" || fail "replicas: 3 of several sources rendered no [coordination]"
grep -q '^weight = 2' "$render/replicas.toml" || fail "a source's weight is not rendered"
PGPASSWORD=x POD_NAME=t-0 "$binary" check --config-only --config "$render/replicas.toml" \
  || fail "the chart's config of three replicas does not validate"
"$py" - "$render/replicas.yaml" <<'PY' || fail "three replicas: the Deployment is not set up for a group"
import sys, yaml
dep = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "Deployment"][0]
assert dep["spec"]["replicas"] == 3, dep["spec"]["replicas"]
standby = [d for d in yaml.safe_load_all(open(sys.argv[1].replace("replicas.yaml", "standby.yaml"))) if d and d["kind"] == "Deployment"][0]
assert standby["spec"]["replicas"] == 2 and standby["spec"]["strategy"]["type"] == "Recreate", standby["spec"]
assert "env" not in standby["spec"]["template"]["spec"]["containers"][0], "no POD_NAME without coordination"
assert dep["spec"]["strategy"]["type"] == "RollingUpdate", dep["spec"]["strategy"]
env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
assert any(e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" for e in env), env
PY

log "image: the whole Dockerfile, checked as the chart runs it"
scripts/lib/image.sh "$target/debug/outboxd-consume"
echo "check-deploy: all passed"
