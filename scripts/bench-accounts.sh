#!/usr/bin/env bash
# The accounts service's time-travel benchmark (BENCHMARKS.md): starts its own
# PostgreSQL and broker, writes one account with 10,000 events (a snapshot
# every 100), starts examples/accounts_service, and measures
# GET /accounts/{id}/state?at= beside the same query in process and beside a
# full replay. Flags: --events N (default 10000), --requests N (default 2000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --locked --example accounts_service
cargo bench --locked --bench accounts -- "$@"
