#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what is missing, then
# formatting, lints, the module graph (no import circle), the deployment
# checks (Dockerfile, Helm chart, image), the quick start (scripts/demo.sh)
# and the accounts demo (scripts/demo-accounts.sh), then the tests against
# a real PostgreSQL and Apache Kafka that the harness starts and stops:
#
# * on PostgreSQL 15, the whole workspace: unit, integration and doc tests;
# * on every other supported version (OUTBOXD_PG_VERSIONS, default
#   "17 18"), the integration tests of version-specific behaviour, the
#   module `every_version` (tests/integration/every_version/mod.rs says
#   which tests belong there).
#
# It ends with the time of each stage, the slowest tests, and a check that
# no process the run started is still running.
set -euo pipefail
cd "$(dirname "$0")/.."

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary=()
stage() {
  local label=$1 start=$SECONDS
  shift
  echo "=== $label"
  "$@"
  summary+=("$label: $((SECONDS - start)) s")
}
quiet() {
  local log="$logs/quiet.log"
  "$@" >"$log" 2>&1 || { cat "$log"; return 1; }
}

stage "setup (scripts/setup.sh)" scripts/setup.sh
stage "cargo fmt --check" cargo fmt --all -- --check
stage "cargo clippy" cargo clippy --workspace --all-targets --locked -- -D warnings
stage "module graph" python3 scripts/lib/module-graph.py

# Every process started from here on carries this marker, so that the end
# of the run can tell whether one was left behind.
marker="outboxd-test-$$-$RANDOM"
export OUTBOXD_TEST_RUN=$marker
stage "deployment checks (scripts/check-deploy.sh)" scripts/check-deploy.sh
# The quick start, as the README gives it: it exits non-zero unless every
# event it writes is consumed from Kafka.
stage "quick start (scripts/demo.sh)" quiet scripts/demo.sh
stage "accounts demo (scripts/demo-accounts.sh)" quiet scripts/demo-accounts.sh
echo "broker: Apache Kafka $(scripts/kafka.sh version) (KRaft; the harness checks each broker's own \"Kafka version\" line)"

# Totals of one test run (libtest prints one line per test binary).
totals() {
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
       END { printf "%d passed, %d failed\n", p, f }' "$@"
}
tests() {
  local key=$1 label=$2 start=$SECONDS status=0
  shift 2
  echo "=== $label"
  "$@" 2>&1 | tee "$logs/$key.log" || status=$?
  summary+=("tests, $label: $(totals "$logs/$key.log") in $((SECONDS - start)) s")
  return "$status"
}
failed=0
tests pg15 "PostgreSQL 15, whole workspace" \
  scripts/lib/timed-tests.py "$logs/pg15.times" --workspace --locked || failed=1
for v in ${OUTBOXD_PG_VERSIONS-17 18}; do
  tests "pg$v" "PostgreSQL $v, every_version::" env OUTBOXD_PG_VERSION="$v" \
    scripts/lib/timed-tests.py "$logs/pg$v.times" --locked --test integration -- every_version:: || failed=1
done
unset OUTBOXD_TEST_RUN

echo
printf '%s\n' "${summary[@]}"
echo "tests: $(totals "$logs"/*.log)"
echo "slowest tests:"
for f in "$logs"/*.times; do
  k=$(basename "$f" .times)
  awk -v k="$k" -F'\t' '{ printf "%8.1f s  %-5s %s::%s\n", $1, k, $2, $3 }' "$f"
done | sort -rn | awk 'NR <= 15'   # awk reads to the end: `head` would SIGPIPE sort under pipefail
scripts/lib/leftovers.py "$marker" || failed=1
exit "$failed"
