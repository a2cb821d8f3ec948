//! The single integration-test binary: end-to-end tests against a real
//! PostgreSQL that the harness starts (see `harness`).

#![allow(clippy::unwrap_used)]

mod harness;
mod replication;
