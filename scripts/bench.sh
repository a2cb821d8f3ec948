#!/usr/bin/env bash
# The benchmark (BENCHMARKS.md): starts its own PostgreSQL and broker, then
# measures backlog drain against pg_recvlogical, polling mode and Debezium
# (Kafka Connect with the PostgreSQL connector and its Outbox Event Router,
# side by side on the same WAL), commit-to-consumer latency at a steady
# rate, and start-up to the first event. Flags: --events N (default
# 200000), --rate N (default 2000), --latency-secs N (default 30),
# --warmup-secs N (default 10), --startup-rounds N (default 3), --sources
# (three sources in one process beside one), --only-sources (that table alone),
# --only-replicas (twelve sources drained by one, two and three replicas),
# --skip-debezium, --skip-exactly-once (no exactly-once run beside
# at-least-once), --skip-tracing (no run with a span per event), --exactly-once-setting 'key = value' (a line for its
# [kafka.exactly_once] table), --outboxd-kafka 'key = value' (a line for outboxd's
# [kafka] table, for example 'max_inflight = 5000'). OUTBOXD_BENCH_REFERENCE=
# /path/to/outboxd adds a run of that binary (an earlier build) beside this
# one, on the same backlog (OUTBOXD_BENCH_REFERENCE_FIRST=1: its drain goes
# first, where the broker is coldest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo bench --locked --bench relay -- "$@"
