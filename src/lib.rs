//! outboxd: a transactional-outbox relay from PostgreSQL logical replication
//! (pgoutput) to Kafka.
//!
//! The tree is laid out by role, and reading it top-down tells the data path:
//!
//! * [`postgres`]: the wire. The replication connection (startup, TLS,
//!   authentication, CopyBoth), the pgoutput decoder, and catalog reads:
//!   slots, the publication proof, failover protection, timelines.
//! * [`source`]: what the stream yields. The decoded stream reduced to outbox
//!   transactions ([`source::stream`]), outbox rows ([`source::outbox`]) and
//!   events emitted as logical decoding messages ([`source::emitted`]).
//! * [`relay`]: sessions and their loop, progress (the ack tracker and which
//!   LSN is confirmable), exactly-once transactions, the leader lease, the
//!   slot register, where a session resumes, and polling mode.
//! * [`kafka`]: the producer and topics ([`kafka::sink`]), records and dead
//!   letters ([`kafka::records`]), CloudEvents, and table rows handed to the
//!   producer ([`kafka::enqueue`]).
//! * [`daemon`]: the supervisor, one relay per configured source
//!   (`[[sources]]`), their lifecycle (failures, SIGHUP, pause/resume).
//! * [`coordination`]: several replicas sharing the sources through a Kafka
//!   consumer group (`[coordination]`).
//! * [`ops`]: the HTTP endpoints, the sources' board, liveness and
//!   readiness, logging, tracing.
//! * [`cli`]: the commands built on the floors below: check, status,
//!   replay, retention, progress.
//! * [`config`]: the configuration file, one module per section: types and
//!   validation only.
//! * [`lsn`], [`metrics`], [`shell`]: the ground floor.
//!
//! An event travels: [`postgres::connection`] streams WAL from a logical
//! slot, [`postgres::pgoutput`] decodes it, [`source::stream`] reduces it to
//! outbox transactions and [`source::outbox`] turns inserted rows into
//! events, [`kafka::records`] into Kafka records, [`kafka::sink`] sends them,
//! and [`relay::progress`] decides which LSN the [`relay`] may confirm.

pub mod cli;
pub mod config;
pub mod coordination;
pub mod daemon;
pub mod kafka;
pub mod lsn;
pub mod metrics;
pub mod ops;
pub mod park;
pub mod postgres;
pub mod relay;
pub mod schema;
pub mod shell;
pub mod source;

pub use lsn::Lsn;
