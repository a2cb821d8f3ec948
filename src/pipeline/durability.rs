//! How a sent record becomes durable in Kafka, and so when its PostgreSQL
//! transaction may be confirmed: the seam between the streaming loop and
//! the delivery mode (`kafka.delivery`).
//!
//! The loop reports what happens (a PostgreSQL transaction begins, a record
//! is sent, Kafka acknowledges it, a commit is read) and asks two
//! questions: may intake go on, and is a Kafka commit due. Each mode
//! answers for itself:
//!
//! * **At-least-once**: an acknowledgement makes its event durable at
//!   once; the [`AckTracker`] retires transactions as their events are
//!   acknowledged. No commit is ever due.
//! * **Exactly-once** ([`crate::exactly_once`]): acknowledgements only say
//!   that a record reached the open Kafka transaction. Events count as
//!   acknowledged in the tracker when that transaction commits, so the slot
//!   never passes what a `read_committed` consumer cannot see.

use std::time::Instant;

use crate::exactly_once::{LastCommit, Transactions};
use crate::lsn::Lsn;
use crate::progress::{AckTracker, TxnId};

/// The session's delivery mode.
#[derive(Debug)]
pub(super) enum Durability {
    AtLeastOnce,
    ExactlyOnce(Box<Transactions>),
}

impl Durability {
    /// Whether the PostgreSQL transaction committing at `final_lsn` is to
    /// be published: not when the progress record says it is in Kafka.
    pub(super) fn admit(&self, final_lsn: Lsn) -> bool {
        match self {
            Durability::AtLeastOnce => true,
            Durability::ExactlyOnce(t) => t.admit(final_lsn),
        }
    }

    /// A published PostgreSQL transaction began.
    pub(super) fn begin(&mut self) {
        if let Durability::ExactlyOnce(t) = self {
            t.group.begin();
        }
    }

    /// A record of `txn`, `bytes` long, was handed to the producer.
    pub(super) fn sent(&mut self, txn: TxnId, bytes: usize) {
        if let Durability::ExactlyOnce(t) = self {
            t.group.sent(txn, bytes, Instant::now());
        }
    }

    /// Kafka acknowledged a record of `txn`; returns how many events that
    /// made durable.
    pub(super) fn acked(&mut self, tracker: &mut AckTracker, txn: TxnId) -> u64 {
        match self {
            Durability::AtLeastOnce => {
                tracker.acked(txn);
                1
            }
            // Durable at the Kafka commit, not before.
            Durability::ExactlyOnce(_) => 0,
        }
    }

    /// A published PostgreSQL transaction's commit was read.
    pub(super) fn committed(&mut self, last: LastCommit) {
        if let Durability::ExactlyOnce(t) = self {
            t.group.commit(last);
            if t.group.due(&t.limits, Instant::now()) {
                t.closing = true;
            }
        }
    }

    /// Whether the loop may read the next stream event (not while a Kafka
    /// commit is due).
    pub(super) fn accepting(&self) -> bool {
        match self {
            Durability::AtLeastOnce => true,
            Durability::ExactlyOnce(t) => !t.closing,
        }
    }

    /// When the open Kafka transaction's `max_wait` runs out, for the
    /// loop's timer; `None` if nothing waits for one.
    pub(super) fn deadline(&self) -> Option<tokio::time::Instant> {
        match self {
            Durability::AtLeastOnce => None,
            Durability::ExactlyOnce(t) if t.closing || t.group.mid_transaction() => None,
            Durability::ExactlyOnce(t) => t.group.deadline(&t.limits).map(tokio::time::Instant::from_std),
        }
    }

    /// Whether a Kafka commit is due now.
    pub(super) fn commit_due(&mut self) -> bool {
        match self {
            Durability::AtLeastOnce => false,
            Durability::ExactlyOnce(t) => {
                if !t.closing && t.group.due(&t.limits, Instant::now()) {
                    t.closing = true;
                }
                t.closing
            }
        }
    }

    /// Nothing sent is waiting for a Kafka commit.
    pub(super) fn settled(&self) -> bool {
        match self {
            Durability::AtLeastOnce => true,
            Durability::ExactlyOnce(t) => t.group.is_empty(),
        }
    }

    pub(super) fn transactions(&mut self) -> Option<&mut Transactions> {
        match self {
            Durability::AtLeastOnce => None,
            Durability::ExactlyOnce(t) => Some(t),
        }
    }
}
