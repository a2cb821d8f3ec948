//! Parked events: `routing.on_poison = "park"` keeps each aggregate's
//! order across an event outboxd cannot publish.
//!
//! # The flow
//!
//! A *sequence* is the (topic, key) an event goes to: what Kafka keeps in
//! order. When an event of a sequence cannot be published for a reason
//! that belongs to the row (the `dlq.reason` classes, a schema mismatch, a
//! record its topic refuses), the relay parks it: it writes the event to
//! `outboxd_parked` and opens the sequence's header row in
//! `outboxd_parked_sequences` ([`store`]), in one PostgreSQL transaction.
//! From then on, every later event of that sequence is parked behind it
//! (the in-memory [`set::ParkedSet`], loaded at each session's start),
//! while other sequences flow on.
//!
//! # LSN progress
//!
//! A parked event is durable once its INSERT has committed, which happens
//! before the relay reads the next change (the insert runs inline, under
//! the replication keepalive). It is never counted in the `AckTracker`, so
//! a PostgreSQL transaction retires once its *sent* events are
//! acknowledged: the slot never passes an event that is neither in Kafka
//! nor in the table. A crash between the INSERT and the confirmation
//! replays the event, which parks again onto its own primary key
//! `(slot, commit_lsn, position)` and changes nothing.
//!
//! An event at or before its sequence's head position is never parked: a
//! replay after a crash publishes the head's predecessors again, as it
//! would without parking.
//!
//! # Redrive
//!
//! `outboxd parked redrive` ([`crate::cli::parked`]) re-publishes a
//! sequence in position order, under the configuration of the day, and
//! deletes each row only after Kafka acknowledged it (with exactly-once,
//! after the Kafka transaction that holds it committed, with a marker in
//! the progress topic for a crash between the two). Only rows the slot has
//! durably passed (its `restart_lsn`) are redriven, so a replay of the
//! WAL, even after a crash of PostgreSQL, never brings a redriven event
//! back. The header goes last, under `FOR UPDATE`, and only
//! when no row is left; the relay parks under `FOR SHARE` on the same
//! header and publishes the event itself once the header is gone. Every
//! event of the sequence is so published once, in order: by the redrive
//! before the header goes, or by the relay after.

pub mod set;
pub mod store;

pub use set::{Limits, ParkedSet};
pub use store::{ParkError, ParkStore, ParkedEvent, ParkedRow, SequenceHead};
