#!/usr/bin/env bash
# The benchmark (BENCHMARKS.md): starts its own PostgreSQL and broker, then
# measures backlog drain against pg_recvlogical and polling mode, and
# commit-to-ack latency at a steady rate. Flags: --events N (default
# 200000), --rate N (default 2000), --latency-secs N (default 30).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo bench --locked --bench relay -- "$@"
