//! outbox-sdk: write your domain rows and their events in one PostgreSQL
//! transaction, for outboxd (or any CDC or polling relay) to publish.
//!
//! The guarantee of the transactional outbox: the domain change and its
//! events commit together or not at all. Everything here takes the caller's
//! transaction (or any [`GenericClient`]) and never talks to Kafka.
//!
//! * [`outbox`]: append events (one round trip per batch), headers with a
//!   correlation id and a W3C `traceparent`;
//! * [`orders`]: seed 000's orders and their `OrderPlaced` event;
//! * [`event_store`] and [`accounts`]: seed 004's event-sourced accounts with
//!   optimistic concurrency, snapshots and time travel;
//! * [`migrate`]: the shipped migrations, applied once, safely in parallel;
//! * [`retention`]: trimming the outbox table and the seed's monitoring query;
//! * [`schema`]: table and column names, validated identifiers.

pub mod accounts;
pub mod error;
pub mod event_store;
pub mod migrate;
pub mod orders;
pub mod outbox;
pub mod retention;
pub mod schema;

pub use error::SdkError;
/// The sealed trait over `Client` and `Transaction` that every function here accepts.
pub use tokio_postgres::GenericClient;
