//! outboxd: a transactional-outbox relay from PostgreSQL logical replication
//! (pgoutput) to Kafka.
//!
//! The data path, in the order an event travels:
//! [`pg::connection`] streams WAL from a logical slot, [`pg::pgoutput`]
//! decodes it, [`pg::outbox_stream`] reduces it to outbox transactions and
//! [`outbox`] turns inserted rows into typed events.

pub mod lsn;
pub mod outbox;
pub mod pg;

pub use lsn::Lsn;
