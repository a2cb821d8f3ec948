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

use std::collections::{HashMap, VecDeque};

use super::session::{Delivery, Sent};
use crate::kafka::delivery::{Report, ReportQueue, Ticket};
use crate::lsn::Lsn;
use crate::ops::otel::PendingSpan;
use crate::relay::exactly_once::RowPos;
use crate::relay::progress::TxnId;

/// One record in flight.
struct InFlight {
    txn: TxnId,
    lsn: Lsn,
    pos: RowPos,
    sent: Sent,
    span: Option<Box<PendingSpan>>,
    /// Its key, value and headers.
    bytes: usize,
}

/// The session's records in flight and the reports not yet handled.
pub(super) struct Deliveries {
    queue: ReportQueue,
    in_flight: HashMap<Ticket, InFlight>,
    /// The bytes of the records in flight.
    bytes: usize,
    /// Reports taken from the queue, not yet handed out.
    ready: VecDeque<(Ticket, Report)>,
}

impl std::fmt::Debug for Deliveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deliveries")
            .field("in_flight", &self.in_flight.len())
            .field("ready", &self.ready.len())
            .finish()
    }
}

impl Deliveries {
    pub(super) fn new(queue: ReportQueue) -> Self {
        Deliveries {
            queue,
            in_flight: HashMap::new(),
            bytes: 0,
            ready: VecDeque::new(),
        }
    }

    /// Follows a new sink's queue. Only with nothing in flight: the old
    /// sink's reports would never come.
    pub(super) fn follow(&mut self, queue: ReportQueue) {
        debug_assert!(self.in_flight.is_empty());
        self.queue = queue;
        self.ready.clear();
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
        self.in_flight.insert(
            ticket,
            InFlight {
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
        let mut d = Deliveries::new(queue.clone());
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
        let mut d = Deliveries::new(queue.clone());
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
        let mut d = Deliveries::new(queue.clone());
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
}
