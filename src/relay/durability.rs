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
//! * **Exactly-once** ([`crate::relay::exactly_once`]): acknowledgements only say
//!   that a record reached the open Kafka transaction. Events count as
//!   acknowledged in the tracker when that transaction commits, so the slot
//!   never passes what a `read_committed` consumer cannot see.
//!
//!   A Kafka commit takes a few round trips. So a closing transaction
//!   commits in the background on one producer while the next one fills
//!   on the other ([`crate::kafka::sink::KafkaSink::start_commit`]). Between the
//!   closing and the commit's start (until every record of the closing
//!   transaction is acknowledged, and the previous commit is done), the
//!   stream is read ahead: its events are held ([`ExactlyOnce::held`],
//!   bounded by `kafka.max_inflight` rows and `kafka.max_inflight_bytes`,
//!   with the records in flight) and handled in order once the
//!   commit has started. They never join the transaction being committed,
//!   and no record of theirs is sent before every record of it is
//!   acknowledged, so each partition keeps commit order.

use std::collections::VecDeque;
use std::time::Instant;

use tokio::task::JoinHandle;

use crate::kafka::sink::KafkaSinkError;
use crate::lsn::Lsn;
use crate::relay::exactly_once::{Group, LastCommit, Transactions};
use crate::relay::progress::{AckTracker, TxnId};
use crate::source::stream::StreamEvent;

/// The session's delivery mode.
#[derive(Debug)]
pub(super) enum Durability {
    AtLeastOnce,
    ExactlyOnce(Box<ExactlyOnce>),
}

/// Exactly-once state of a session: the open Kafka transaction, the
/// commit under way, and the events read ahead meanwhile.
#[derive(Debug)]
pub(super) struct ExactlyOnce {
    pub(super) t: Transactions,
    /// Stream events read while closing, handled after the commit.
    pub(super) held: VecDeque<StreamEvent>,
    /// Outbox rows among them, and their bytes (the bounds).
    pub(super) held_rows: usize,
    pub(super) held_bytes: usize,
    /// The commit running in the background, and the PostgreSQL
    /// transactions it holds.
    pub(super) committing: Option<JoinHandle<Result<(), KafkaSinkError>>>,
    pub(super) committing_group: Group,
    /// When closing began (the progress record was sent), and when the
    /// commit request went out.
    pub(super) closing_since: Option<Instant>,
    /// The committing transaction's closing time, and its commit's start.
    pub(super) committing_since: Option<Instant>,
    pub(super) commit_started: Option<Instant>,
    /// The last PostgreSQL transaction (its commit LSN) of the last Kafka
    /// transaction this session committed: its progress record covers it.
    pub(super) committed_through: Option<Lsn>,
}

impl ExactlyOnce {
    /// Whether the open Kafka transaction should close now: at a
    /// PostgreSQL commit, past a bound. Past `max_wait` only, it goes on
    /// filling while the previous commit is under way: closing would only
    /// hold the stream back until that commit is done. Under load the
    /// transactions so grow to what one commit's time brings in.
    fn should_close(&self, now: Instant) -> bool {
        let g = &self.t.group;
        g.due(&self.t.limits, now) && (self.committing.is_none() || g.over_size(&self.t.limits))
    }

    /// Drops the events read ahead (at shutdown: the slot still holds
    /// them), with their counts.
    pub(super) fn drop_held(&mut self) {
        self.held.clear();
        self.held_rows = 0;
        self.held_bytes = 0;
    }

    pub(super) fn new(t: Transactions) -> Self {
        ExactlyOnce {
            t,
            held: VecDeque::new(),
            held_rows: 0,
            held_bytes: 0,
            committing: None,
            committing_group: Group::default(),
            closing_since: None,
            committing_since: None,
            commit_started: None,
            committed_through: None,
        }
    }
}

impl Durability {
    /// Whether the PostgreSQL transaction committing at `final_lsn` is to
    /// be published: not when the progress record says it is in Kafka.
    pub(super) fn admit(&self, final_lsn: Lsn) -> bool {
        match self {
            Durability::AtLeastOnce => true,
            Durability::ExactlyOnce(e) => e.t.admit(final_lsn),
        }
    }

    /// A published PostgreSQL transaction began.
    pub(super) fn begin(&mut self) {
        if let Durability::ExactlyOnce(e) = self {
            e.t.group.begin();
        }
    }

    /// A record of `txn`, `bytes` long, was handed to the producer.
    pub(super) fn sent(&mut self, txn: TxnId, bytes: usize) {
        if let Durability::ExactlyOnce(e) = self {
            e.t.group.sent(txn, bytes, Instant::now());
        }
    }

    /// An event of `txn` was parked (exactly-once: the progress record of
    /// the open Kafka transaction is to cover it).
    pub(super) fn parked(&mut self, txn: TxnId) {
        if let Durability::ExactlyOnce(e) = self {
            e.t.group.parked(txn, Instant::now());
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
        if let Durability::ExactlyOnce(e) = self {
            e.t.group.commit(last);
            if e.should_close(Instant::now()) {
                e.t.closing = true;
            }
        }
    }

    /// Whether stream events are handled now (`false`: held until the
    /// Kafka commit under way is done).
    pub(super) fn accepting(&self) -> bool {
        match self {
            Durability::AtLeastOnce => true,
            Durability::ExactlyOnce(e) => !e.t.closing,
        }
    }

    /// Holds a stream event read while a commit is under way.
    pub(super) fn hold(&mut self, ev: StreamEvent) {
        if let Durability::ExactlyOnce(e) = self {
            if let Some(bytes) = row_bytes(&ev) {
                e.held_rows += 1;
                e.held_bytes += bytes;
            }
            e.held.push_back(ev);
        }
    }

    /// The next held event, once commits allow.
    pub(super) fn release(&mut self) -> Option<StreamEvent> {
        match self {
            Durability::ExactlyOnce(e) if !e.t.closing => {
                let ev = e.held.pop_front()?;
                if let Some(bytes) = row_bytes(&ev) {
                    e.held_rows -= 1;
                    e.held_bytes -= bytes;
                }
                Some(ev)
            }
            _ => None,
        }
    }

    /// Rows read ahead and not yet handled, and their bytes (they count
    /// against `kafka.max_inflight` and `kafka.max_inflight_bytes`).
    pub(super) fn held(&self) -> (usize, usize) {
        match self {
            Durability::AtLeastOnce => (0, 0),
            Durability::ExactlyOnce(e) => (e.held_rows, e.held_bytes),
        }
    }

    /// Events are held, and may be handled now.
    pub(super) fn releasable(&self) -> bool {
        match self {
            Durability::ExactlyOnce(e) => !e.t.closing && !e.held.is_empty(),
            Durability::AtLeastOnce => false,
        }
    }

    /// How long the oldest Kafka transaction still open (committing or
    /// filling) has been open.
    pub(super) fn oldest_transaction_age(&self) -> Option<std::time::Duration> {
        match self {
            Durability::ExactlyOnce(e) => e.committing_group.age().max(e.t.group.age()),
            Durability::AtLeastOnce => None,
        }
    }

    /// The background commit, if one is under way.
    pub(super) fn commit_handle(&mut self) -> Option<&mut JoinHandle<Result<(), KafkaSinkError>>> {
        match self {
            Durability::ExactlyOnce(e) => e.committing.as_mut(),
            Durability::AtLeastOnce => None,
        }
    }

    /// When the open Kafka transaction's `max_wait` runs out, for the
    /// loop's timer; `None` if nothing waits for one.
    pub(super) fn deadline(&self) -> Option<tokio::time::Instant> {
        match self {
            Durability::AtLeastOnce => None,
            // Closing, half a PostgreSQL transaction in, or waiting for the
            // commit under way (whose end wakes the loop anyway).
            Durability::ExactlyOnce(e)
                if e.t.closing || e.t.group.mid_transaction() || e.committing.is_some() =>
            {
                None
            }
            Durability::ExactlyOnce(e) => {
                e.t.group
                    .deadline(&e.t.limits)
                    .map(tokio::time::Instant::from_std)
            }
        }
    }

    /// Whether a Kafka commit is due now.
    pub(super) fn commit_due(&mut self) -> bool {
        match self {
            Durability::AtLeastOnce => false,
            Durability::ExactlyOnce(e) => {
                if !e.t.closing && e.should_close(Instant::now()) {
                    e.t.closing = true;
                }
                e.t.closing
            }
        }
    }

    /// Nothing sent is waiting for a Kafka commit.
    pub(super) fn settled(&self) -> bool {
        match self {
            Durability::AtLeastOnce => true,
            Durability::ExactlyOnce(e) => e.t.group.is_empty() && e.held.is_empty() && e.committing.is_none(),
        }
    }

    /// Whether the relay may hand back (publish itself) a parked event of
    /// the PostgreSQL transaction committing at `commit_lsn`: exactly-once,
    /// once a progress record in Kafka covers it (read at start, or
    /// committed by this session), so that a replay skips it; at-least-once,
    /// always (a replay may publish it again: a duplicate, which that mode
    /// allows).
    pub(super) fn in_kafka(&self, commit_lsn: Lsn) -> bool {
        match self {
            Durability::AtLeastOnce => true,
            Durability::ExactlyOnce(e) => {
                !e.t.admit(commit_lsn) || e.committed_through.is_some_and(|c| commit_lsn <= c)
            }
        }
    }

    /// Records go into Kafka transactions (exactly-once).
    pub(super) fn in_transaction(&self) -> bool {
        matches!(self, Durability::ExactlyOnce(_))
    }

    pub(super) fn exactly_once(&mut self) -> Option<&mut ExactlyOnce> {
        match self {
            Durability::AtLeastOnce => None,
            Durability::ExactlyOnce(e) => Some(e),
        }
    }
}

/// An outbox row's bytes as read (its text columns), or `None` for an
/// event that is not a row.
fn row_bytes(ev: &StreamEvent) -> Option<usize> {
    match ev {
        StreamEvent::Insert { row, .. } => Some(
            row.aggregate_type.len()
                + row.aggregate_id.len()
                + row.event_type.len()
                + row.payload.len()
                + row.headers.len(),
        ),
        StreamEvent::Unreadable { row, .. } => {
            Some(row.id.len() + row.aggregate_id.len() + row.columns_json.len())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExactlyOnceConfig;
    use crate::relay::exactly_once::Identity;
    use crate::source::outbox::{CreatedAt, OutboxRow};

    fn exactly_once() -> Durability {
        let identity = Identity {
            writer: "host/1".into(),
            slot: "s".into(),
            database: "db".into(),
            system_id: "7300000000000000001".into(),
            timeline: 1,
        };
        let t = Transactions::new(&ExactlyOnceConfig::default(), "outboxd.progress".into(), identity);
        Durability::ExactlyOnce(Box::new(ExactlyOnce::new(t)))
    }

    fn insert(payload_bytes: usize) -> StreamEvent {
        StreamEvent::Insert {
            row: OutboxRow {
                id: uuid::Uuid::nil().to_string(),
                aggregate_type: "Order".into(),
                aggregate_id: "o-1".into(),
                event_type: "t".into(),
                payload: crate::source::outbox::Payload::Json("x".repeat(payload_bytes)),
                headers: "{}".into(),
                created_at: CreatedAt::Unrepresentable("infinity".into()),
                extra: Vec::new(),
                facts: None,
            },
            lsn: Lsn(1),
        }
    }

    #[test]
    fn rows_read_ahead_count_by_row_and_by_byte_until_released() {
        let mut d = exactly_once();
        assert_eq!(d.held(), (0, 0));
        let e = d.exactly_once().unwrap();
        e.t.closing = true;
        d.hold(insert(100_000));
        d.hold(StreamEvent::Keepalive {
            wal_end: Lsn(2),
            reply_requested: false,
        });
        d.hold(insert(10));
        let row = |p: usize| "Order".len() + "o-1".len() + "t".len() + p + "{}".len();
        assert_eq!(d.held(), (2, row(100_000) + row(10)), "a keepalive is no row");
        assert!(d.release().is_none(), "nothing is released while closing");
        d.exactly_once().unwrap().t.closing = false;
        assert!(matches!(d.release(), Some(StreamEvent::Insert { .. })));
        assert_eq!(d.held(), (1, row(10)));
        assert!(matches!(d.release(), Some(StreamEvent::Keepalive { .. })));
        assert!(matches!(d.release(), Some(StreamEvent::Insert { .. })));
        assert_eq!(d.held(), (0, 0));
        assert_eq!(Durability::AtLeastOnce.held(), (0, 0));
    }
}
