//! The relay's view of the parked sequences: which (topic, key) have a
//! head, where, and the totals the limits bound.

use std::collections::HashMap;

use super::store::SequenceHead;
pub use crate::config::ParkLimits as Limits;
use crate::lsn::RowPos;

/// Which limit parking one more event would pass.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("parking one more event would pass routing.park.{limit} = {max} ({now} now): redrive or discard parked sequences (`outboxd parked list`), or raise the limit; nothing is dropped meanwhile, and the slot holds the event")]
pub struct LimitReached {
    pub limit: &'static str,
    pub max: u64,
    pub now: u64,
}

/// The parked sequences of a slot, as the relay last knew them.
#[derive(Clone, Debug, Default)]
pub struct ParkedSet {
    heads: HashMap<(String, String), RowPos>,
    /// Totals over every sequence.
    events: u64,
    bytes: u64,
    /// When the oldest sequence was parked (Unix seconds).
    oldest: Option<i64>,
    /// Sequences a redrive handed back to the relay (see
    /// [`crate::park::SequenceHead::handback`]), oldest first.
    handback: Vec<(String, String)>,
    limits: Limits,
}

impl ParkedSet {
    pub fn new(limits: Limits) -> Self {
        ParkedSet {
            limits,
            ..Default::default()
        }
    }

    /// Replaces the view with the table's.
    pub fn load(&mut self, heads: &[SequenceHead]) {
        self.heads = heads
            .iter()
            .map(|h| ((h.topic.clone(), h.key.clone()), h.head))
            .collect();
        self.events = heads.iter().map(|h| u64::try_from(h.events).unwrap_or(0)).sum();
        self.bytes = heads.iter().map(|h| u64::try_from(h.bytes).unwrap_or(0)).sum();
        self.oldest = heads.iter().map(|h| h.parked_at.timestamp()).min();
        self.handback = heads
            .iter()
            .filter(|h| h.handback)
            .map(|h| (h.topic.clone(), h.key.clone()))
            .collect();
    }

    /// Handed-back sequences the relay did not publish now stay parked,
    /// and are due again when the sequences are next read.
    pub fn defer_handbacks(&mut self) {
        self.handback.clear();
    }

    /// The sequences handed back to the relay, for it to publish.
    pub fn handed_back(&self) -> &[(String, String)] {
        &self.handback
    }

    /// No sequence is parked: nothing to look up per event.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// The head of the sequence, if it is parked.
    pub fn head(&self, topic: &str, key: &str) -> Option<RowPos> {
        // The map is keyed by owned pairs; sequences are few.
        self.heads.get(&(topic.to_owned(), key.to_owned())).copied()
    }

    /// Whether an event at `pos` of the sequence is parked: the head
    /// itself (replayed after a crash, it parks again onto its own row,
    /// even if it would be published today) and every event after it.
    /// Its predecessors replayed after a crash are published as before.
    pub fn parks(&self, topic: &str, key: &str, pos: RowPos) -> bool {
        !self.heads.is_empty() && self.head(topic, key).is_some_and(|h| pos >= h)
    }

    /// Checks that one more event of `bytes` (opening a sequence, if
    /// `opens`) stays within the limits.
    pub fn room(&self, bytes: usize, opens: bool) -> Result<(), LimitReached> {
        let l = &self.limits;
        let sequences = self.heads.len() as u64;
        if opens && sequences >= l.max_sequences {
            return Err(LimitReached {
                limit: "max_sequences",
                max: l.max_sequences,
                now: sequences,
            });
        }
        if self.events >= l.max_events {
            return Err(LimitReached {
                limit: "max_events",
                max: l.max_events,
                now: self.events,
            });
        }
        let bytes = bytes as u64;
        if self.bytes.saturating_add(bytes) > l.max_bytes {
            return Err(LimitReached {
                limit: "max_bytes",
                max: l.max_bytes,
                now: self.bytes,
            });
        }
        Ok(())
    }

    /// A sequence was opened with its head at `head`.
    pub fn opened(&mut self, topic: &str, key: &str, head: RowPos) {
        if self
            .heads
            .insert((topic.to_owned(), key.to_owned()), head)
            .is_none()
            && self.oldest.is_none()
        {
            self.oldest = Some(chrono::Utc::now().timestamp());
        }
    }

    /// An event of `bytes` was written to the table.
    pub fn added(&mut self, bytes: usize) {
        self.events += 1;
        self.bytes += bytes as u64;
    }

    /// The sequence was released (its header is gone).
    pub fn released(&mut self, topic: &str, key: &str) {
        self.heads.remove(&(topic.to_owned(), key.to_owned()));
        self.handback.retain(|(t, k)| t != topic || k != key);
    }

    /// Parked sequences, events and bytes, and the oldest sequence's
    /// parking time (Unix seconds).
    pub fn totals(&self) -> (u64, u64, u64, Option<i64>) {
        (self.heads.len() as u64, self.events, self.bytes, self.oldest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;

    fn pos(lsn: u64, index: u32) -> RowPos {
        RowPos {
            commit_lsn: Lsn(lsn),
            index,
        }
    }

    #[test]
    fn only_events_after_the_head_are_parked() {
        let mut s = ParkedSet::new(Limits::default());
        s.opened("order.events", "A", pos(100, 2));
        assert!(!s.parks("order.events", "A", pos(100, 1)));
        assert!(s.parks("order.events", "A", pos(100, 2)));
        assert!(s.parks("order.events", "A", pos(100, 3)));
        assert!(s.parks("order.events", "A", pos(200, 0)));
        assert!(!s.parks("order.events", "B", pos(200, 0)));
        assert!(!s.parks("customer.events", "A", pos(200, 0)));
        s.released("order.events", "A");
        assert!(!s.parks("order.events", "A", pos(200, 0)));
    }

    #[test]
    fn limits_refuse_before_they_are_passed() {
        let mut s = ParkedSet::new(Limits {
            max_sequences: 1,
            max_events: 2,
            max_bytes: 100,
        });
        assert!(s.room(10, true).is_ok());
        s.opened("t", "A", pos(1, 0));
        s.added(10);
        assert_eq!(s.room(10, true).unwrap_err().limit, "max_sequences");
        assert!(s.room(10, false).is_ok());
        assert_eq!(s.room(91, false).unwrap_err().limit, "max_bytes");
        s.added(10);
        assert_eq!(s.room(1, false).unwrap_err().limit, "max_events");
    }
}
