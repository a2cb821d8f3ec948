#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what is missing, then
# formatting, lints, unit tests and the end-to-end tests against a real
# PostgreSQL that the test harness starts and stops itself.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
