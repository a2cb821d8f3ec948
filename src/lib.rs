//! outboxd: a transactional-outbox relay from PostgreSQL logical replication
//! (pgoutput) to Kafka.
//!
//! The data path, in the order an event travels:
//! [`pg::connection`] streams WAL from a logical slot, [`pg::pgoutput`]
//! decodes it, [`pg::outbox_stream`] reduces it to outbox transactions and
//! [`outbox`] turns inserted rows into typed events, [`routing`] into Kafka
//! records, [`kafka`] sends them, and [`progress`] decides which LSN
//! [`pipeline`] may confirm.

pub mod check;
pub mod cloudevents;
pub mod commands;
pub mod config;
pub mod emitted;
pub mod enqueue;
pub mod exactly_once;
pub mod health;
pub mod http;
pub mod kafka;
pub mod leader;
pub mod lsn;
pub mod metrics;
pub mod otel;
pub mod outbox;
pub mod pg;
pub mod pipeline;
pub mod polling;
pub mod progress;
pub mod replay;
pub mod retention;
pub mod routing;
pub mod slot_register;
pub mod status;
pub mod telemetry;

pub use lsn::Lsn;
