//! What the replication stream yields, for the relay: outbox transactions
//! ([`stream`]), the rows inserted into the outbox table ([`outbox`]), and
//! events written as logical decoding messages ([`emitted`], the table-less
//! outbox).

pub mod emitted;
pub mod outbox;
pub mod stream;
