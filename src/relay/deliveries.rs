//! What a session has in flight at Kafka, and its reports as they arrive.
//!
//! Each record the session sends is entered under its ticket with what its
//! report needs (its transaction, LSN, position, kind and span). Reports
//! come from the sink's [`ReportQueue`] in batches (see
//! [`crate::kafka::delivery`]): [`Deliveries::next`] hands them out one by
//! one, so the streaming loop handles a report as before, but it is woken
//! once per batch, not once per record.
//!
//! A report whose ticket is not in flight belongs to records the session
//! gave up on ([`Deliveries::clear`], after an aborted Kafka transaction):
//! it is dropped, as their futures used to be.
//!
//! On a shared producer, a record that comes back purged unsent (another
//! delivery failed, see [`crate::kafka::delivery`]) is not a failure of
//! this session: it is kept, with its entry, and handed back in the order
//! the session first sent it by [`Deliveries::take_purged`], for the
//! session to send again once everything else it sent has reported.

use std::collections::{BTreeMap, VecDeque};

use super::session::{record_from_message, Delivery, Sent};
use crate::kafka::delivery::{Report, ReportQueue, Ticket};
use crate::kafka::records::KafkaRecord;
use crate::kafka::FastMap;
use crate::lsn::Lsn;
use crate::ops::otel::PendingSpan;
use crate::relay::exactly_once::RowPos;
use crate::relay::progress::TxnId;

/// One record in flight.
pub(super) struct InFlight {
    /// Its place in the order the session first sent its records.
    order: u64,
    txn: TxnId,
    lsn: Lsn,
    pos: RowPos,
    sent: Sent,
    span: Option<Box<PendingSpan>>,
    /// Its key, value and headers.
    bytes: usize,
}

impl InFlight {
    /// The LSN of the row it carries.
    pub(super) fn lsn(&self) -> Lsn {
        self.lsn
    }
}

/// The session's records in flight and the reports not yet handled.
pub(super) struct Deliveries {
    queue: ReportQueue,
    in_flight: FastMap<Ticket, InFlight>,
    /// The bytes of the records in flight.
    bytes: usize,
    /// Reports taken from the queue, not yet handed out.
    ready: VecDeque<(Ticket, Report)>,
    /// The producer is shared: records purged unsent are kept here, in the
    /// order they were first sent, to be sent again.
    keeps_purged: bool,
    purged: BTreeMap<u64, (InFlight, KafkaRecord)>,
    /// The next record's place in the send order.
    next_order: u64,
}

impl std::fmt::Debug for Deliveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deliveries")
            .field("in_flight", &self.in_flight.len())
            .field("ready", &self.ready.len())
            .field("purged", &self.purged.len())
            .finish()
    }
}

impl Deliveries {
    /// Reports of `queue`; `keeps_purged` for a shared producer.
    pub(super) fn new(queue: ReportQueue, keeps_purged: bool) -> Self {
        Deliveries {
            queue,
            in_flight: FastMap::default(),
            bytes: 0,
            ready: VecDeque::new(),
            keeps_purged,
            purged: BTreeMap::new(),
            next_order: 0,
        }
    }

    /// Follows a new sink's queue. Only with nothing in flight or kept:
    /// the old sink's reports would never come.
    pub(super) fn follow(&mut self, queue: ReportQueue, keeps_purged: bool) {
        debug_assert!(self.in_flight.is_empty() && self.purged.is_empty());
        self.queue = queue;
        self.keeps_purged = keeps_purged;
        self.ready.clear();
    }

    /// Records that came back purged unsent, waiting to be sent again.
    pub(super) fn has_purged(&self) -> bool {
        !self.purged.is_empty()
    }

    /// The records purged unsent, in the order they were first sent, with
    /// their entries.
    pub(super) fn take_purged(&mut self) -> VecDeque<(InFlight, KafkaRecord)> {
        std::mem::take(&mut self.purged).into_values().collect()
    }

    /// Enters a record sent again under its new `ticket`; it keeps its
    /// place in the send order.
    pub(super) fn resent(&mut self, ticket: Ticket, entry: InFlight) {
        self.bytes += entry.bytes;
        self.in_flight.insert(ticket, entry);
    }

    /// Keeps again records taken by [`Deliveries::take_purged`] and not
    /// sent (the producer purged once more): they take their places among
    /// those the new purge gives back.
    pub(super) fn keep_purged(&mut self, records: VecDeque<(InFlight, KafkaRecord)>) {
        for (entry, record) in records {
            self.purged.insert(entry.order, (entry, record));
        }
    }

    /// Records sent and not yet reported.
    pub(super) fn len(&self) -> usize {
        self.in_flight.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// The bytes (keys, values, headers) of the records in flight.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Enters a record of `bytes` just sent under `ticket`.
    pub(super) fn push(
        &mut self,
        ticket: Ticket,
        (txn, lsn, pos, sent): (TxnId, Lsn, RowPos, Sent),
        bytes: usize,
        span: Option<Box<PendingSpan>>,
    ) {
        self.bytes += bytes;
        let order = self.next_order;
        self.next_order += 1;
        self.in_flight.insert(
            ticket,
            InFlight {
                order,
                txn,
                lsn,
                pos,
                sent,
                span,
                bytes,
            },
        );
    }

    /// Forgets every record in flight: their reports are dropped.
    pub(super) fn clear(&mut self) {
        self.in_flight.clear();
        self.bytes = 0;
        self.ready.clear();
        self.purged.clear();
    }

    /// The next report of a record in flight, or `None` when nothing is in
    /// flight. Cancel-safe: a report is removed only when it is returned.
    pub(super) async fn next(&mut self) -> Option<Delivery> {
        loop {
            while let Some((ticket, report)) = self.ready.pop_front() {
                let Some(f) = self.in_flight.remove(&ticket) else {
                    continue;
                };
                self.bytes -= f.bytes;
                if self.keeps_purged && report.was_purged_unsent() {
                    if let Report::Failed(_, msg) = &report {
                        self.purged.insert(f.order, (f, record_from_message(msg)));
                        continue;
                    }
                }
                if let Some(span) = f.span {
                    span.finish(match &report {
                        Report::Stored { partition, offset } => Ok((*partition, *offset)),
                        Report::Failed(e, _) => Err(e.to_string()),
                        Report::Unproven { .. } => Err("delivered without an offset".to_owned()),
                        Report::Canceled => Err("the delivery was canceled".to_owned()),
                    });
                }
                return Some((f.txn, f.lsn, f.pos, f.sent, report));
            }
            if self.in_flight.is_empty() {
                return None;
            }
            self.queue.take(&mut self.ready);
            if self.ready.is_empty() {
                self.queue.arrived().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::kafka::delivery::ticket;
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};
    use rdkafka::message::{OwnedHeaders, OwnedMessage, Timestamp};

    fn pos(index: u32) -> RowPos {
        RowPos {
            commit_lsn: Lsn(100),
            index,
        }
    }

    fn stored() -> Report {
        Report::Stored {
            partition: 0,
            offset: 1,
        }
    }

    fn entry(index: u32) -> (TxnId, Lsn, RowPos, Sent) {
        (
            TxnId::for_tests(1),
            Lsn(10 + u64::from(index)),
            pos(index),
            Sent::Event,
        )
    }

    #[tokio::test]
    async fn reports_come_in_any_order_and_free_their_bytes() {
        let queue = ReportQueue::default();
        let mut d = Deliveries::new(queue.clone(), false);
        let tickets: Vec<Ticket> = (0..3).map(|_| ticket(false)).collect();
        for (i, t) in tickets.iter().enumerate() {
            d.push(*t, entry(i as u32), 100 * (i + 1), None);
        }
        assert_eq!((d.len(), d.bytes()), (3, 600));
        queue.deliver(tickets[2], stored());
        queue.deliver(tickets[0], stored());
        let (_, _, first, _, _) = d.next().await.unwrap();
        assert_eq!(first, pos(2));
        assert_eq!((d.len(), d.bytes()), (2, 300));
        let (_, _, second, _, _) = d.next().await.unwrap();
        assert_eq!(second, pos(0));
        assert_eq!((d.len(), d.bytes()), (1, 200));
        // The last one has not reported: next waits.
        let waited = tokio::time::timeout(Duration::from_millis(50), d.next()).await;
        assert!(waited.is_err(), "no report, no delivery");
        queue.deliver(tickets[1], stored());
        let (_, _, third, _, _) = d.next().await.unwrap();
        assert_eq!(third, pos(1));
        assert_eq!((d.len(), d.bytes()), (0, 0));
        assert!(d.next().await.is_none(), "nothing in flight: None at once");
    }

    #[tokio::test]
    async fn a_report_after_clear_is_dropped_and_a_cancelled_wait_loses_nothing() {
        let queue = ReportQueue::default();
        let mut d = Deliveries::new(queue.clone(), false);
        let old = ticket(false);
        d.push(old, entry(0), 10, None);
        d.clear();
        assert_eq!((d.len(), d.bytes()), (0, 0));
        let new = ticket(false);
        d.push(new, entry(1), 10, None);
        // A wait given up before any report arrives ...
        assert!(tokio::time::timeout(Duration::from_millis(20), d.next())
            .await
            .is_err());
        // ... then the aborted record's report and the new one's.
        queue.deliver(old, stored());
        queue.deliver(new, stored());
        let (_, _, p, _, _) = d.next().await.unwrap();
        assert_eq!(p, pos(1), "the cleared record's report is not handed out");
        assert!(d.next().await.is_none());
    }

    #[tokio::test]
    async fn reports_arriving_from_another_thread_wake_the_waiter() {
        let queue = ReportQueue::default();
        let mut d = Deliveries::new(queue.clone(), false);
        let tickets: Vec<Ticket> = (0..1000).map(|_| ticket(false)).collect();
        for (i, t) in tickets.iter().enumerate() {
            d.push(*t, entry(i as u32), 1, None);
        }
        let sender = {
            let (queue, tickets) = (queue.clone(), tickets.clone());
            std::thread::spawn(move || {
                for t in tickets.into_iter().rev() {
                    queue.deliver(t, stored());
                }
            })
        };
        let mut seen = 0;
        while tokio::time::timeout(Duration::from_secs(10), d.next())
            .await
            .expect("woken")
            .is_some()
        {
            seen += 1;
        }
        sender.join().unwrap();
        assert_eq!(seen, 1000);
    }

    fn failed(code: RDKafkaErrorCode, value: &str) -> Report {
        let msg = OwnedMessage::new(
            Some(value.as_bytes().to_vec()),
            Some(b"k".to_vec()),
            "t".to_owned(),
            Timestamp::CreateTime(7),
            0,
            -1,
            Some(OwnedHeaders::new()),
        );
        Report::Failed(KafkaError::MessageProduction(code), msg)
    }

    #[tokio::test]
    async fn records_purged_unsent_are_kept_in_send_order_only_on_a_shared_producer() {
        let queue = ReportQueue::default();
        let mut d = Deliveries::new(queue.clone(), true);
        let tickets: Vec<Ticket> = (0..4).map(|_| ticket(false)).collect();
        for (i, t) in tickets.iter().enumerate() {
            d.push(*t, entry(i as u32), 10, None);
        }
        // Purged out of order, then one stored.
        queue.deliver(tickets[3], failed(RDKafkaErrorCode::PurgeQueue, "three"));
        queue.deliver(tickets[1], failed(RDKafkaErrorCode::PurgeQueue, "one"));
        queue.deliver(tickets[0], stored());
        let (_, _, p, _, _) = d.next().await.unwrap();
        assert_eq!(p, pos(0), "the stored one is handed out");
        assert_eq!((d.len(), d.bytes()), (1, 10), "the purged ones left the count");
        assert!(d.has_purged());
        let purged = d.take_purged();
        let values: Vec<&[u8]> = purged.iter().map(|(_, r)| r.value_bytes()).collect();
        assert_eq!(values, [b"one".as_slice(), b"three"], "in send order");
        assert_eq!(purged[0].0.pos, pos(1));
        assert!(!d.has_purged());
        // A failure of its own is handed out, as is any purge on an own producer.
        queue.deliver(tickets[2], failed(RDKafkaErrorCode::RequestTimedOut, "two"));
        let (_, _, p, _, report) = d.next().await.unwrap();
        assert_eq!(p, pos(2));
        assert!(report.is_failure());
        let mut own = Deliveries::new(queue.clone(), false);
        let t = ticket(false);
        own.push(t, entry(9), 1, None);
        queue.deliver(t, failed(RDKafkaErrorCode::PurgeQueue, "x"));
        let (_, _, _, _, report) = own.next().await.unwrap();
        assert!(report.was_purged_unsent() && !report.is_failure());
    }

    #[tokio::test]
    async fn a_record_purged_again_after_it_was_sent_again_keeps_its_first_place() {
        let queue = ReportQueue::default();
        let mut d = Deliveries::new(queue.clone(), true);
        let tickets: Vec<Ticket> = (0..3).map(|_| ticket(false)).collect();
        for (i, t) in tickets.iter().enumerate() {
            d.push(*t, entry(i as u32), 10, None);
        }
        for (t, v) in tickets.iter().zip(["b", "c", "d"]) {
            queue.deliver(*t, failed(RDKafkaErrorCode::PurgeQueue, v));
        }
        assert!(d.next().await.is_none(), "nothing handed out: all purged");
        let mut purged = d.take_purged();
        // `b` goes again under a new (later) ticket; then the producer
        // purges once more before `c` and `d` go.
        let (b, _) = purged.pop_front().unwrap();
        let again = ticket(false);
        d.resent(again, b);
        d.keep_purged(purged);
        queue.deliver(again, failed(RDKafkaErrorCode::PurgeQueue, "b"));
        assert!(d.next().await.is_none());
        let order: Vec<RowPos> = d.take_purged().into_iter().map(|(e, _)| e.pos).collect();
        assert_eq!(order, [pos(0), pos(1), pos(2)], "b before c and d, as first sent");
    }
}
