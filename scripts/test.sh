#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what is missing, then
# formatting, lints, the deployment checks (Dockerfile, Helm chart, image),
# the quick start (scripts/demo.sh) and the accounts demo
# (scripts/demo-accounts.sh), unit tests and the end-to-end tests against a
# real PostgreSQL and Apache Kafka that the test harness starts and stops
# itself: the whole suite on PostgreSQL 15, then the integration
# suite on 17 and on 18 (OUTBOXD_PG_VERSIONS, default "17 18").
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
scripts/check-deploy.sh
# The quick start, as the README gives it: it exits non-zero unless every
# event it writes is consumed from Kafka.
scripts/demo.sh >/tmp/outboxd-demo.$$.log 2>&1 || { cat /tmp/outboxd-demo.$$.log; exit 1; }
echo "quick start (scripts/demo.sh): passed"
scripts/demo-accounts.sh >/tmp/outboxd-demo.$$.log 2>&1 || { cat /tmp/outboxd-demo.$$.log; exit 1; }
echo "accounts demo (scripts/demo-accounts.sh): passed"
rm -f /tmp/outboxd-demo.$$.log
echo "broker: Apache Kafka $(scripts/kafka.sh version) (KRaft; the harness checks each broker's own \"Kafka version\" line)"

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# Totals of one cargo test run (cargo prints one line per test binary).
totals() {
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
       END { printf "%d passed, %d failed\n", p, f }' "$@"
}
summary=()
run() {
  local label=$1 log="$logs/$1.log" start=$SECONDS status=0
  shift
  echo "=== $label"
  "$@" 2>&1 | tee "$log" || status=$?
  summary+=("tests, $label: $(totals "$log") in $((SECONDS - start)) s")
  return "$status"
}
failed=0
run "PostgreSQL 15, whole workspace" cargo test --workspace --locked || failed=1
for v in ${OUTBOXD_PG_VERSIONS-17 18}; do
  run "PostgreSQL $v, integration suite" env OUTBOXD_PG_VERSION="$v" cargo test --locked --test integration || failed=1
done
printf '%s\n' "${summary[@]}"
echo "tests: $(totals "$logs"/*.log)"
exit "$failed"
