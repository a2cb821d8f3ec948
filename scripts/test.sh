#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what is missing, then
# formatting, lints, the deployment checks (Dockerfile, Helm chart, image),
# the quick start (scripts/demo.sh), unit tests and the end-to-end tests
# against a real PostgreSQL and Apache Kafka that the test harness starts
# and stops itself.
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
rm -f /tmp/outboxd-demo.$$.log
echo "broker: Apache Kafka $(scripts/kafka.sh version) (KRaft; the harness checks each broker's own \"Kafka version\" line)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
