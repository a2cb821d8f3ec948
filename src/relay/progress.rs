//! Which LSN is safe to confirm.
//!
//! PostgreSQL may discard WAL, and will never resend a transaction, once the
//! slot's `confirmed_flush_lsn` has passed that transaction's commit. So
//! outboxd may confirm a commit's end LSN only when every event of that
//! transaction **and of every earlier transaction** has been acknowledged
//! by Kafka (ENGINEERING.md §3, rules 1-2).
//!
//! Acknowledgements arrive out of order: events go to different partitions
//! and brokers. The tracker keeps the transactions in commit order, each
//! with a count of unacknowledged events. An acknowledgement decrements its
//! transaction's count; then, from the oldest transaction on, every
//! transaction that is committed and fully acknowledged is retired and
//! `flushed` moves to its end LSN. `flushed` only moves forward.
//!
//! When nothing is open or in flight, a keepalive's WAL end may be confirmed
//! (rule 5): the slot then keeps up with WAL written to other tables, so an
//! idle outbox does not pin WAL on the primary.

use std::collections::VecDeque;

use crate::lsn::Lsn;

/// A PostgreSQL transaction's commit record: where it starts (the Begin
/// message's final LSN), where it ends (the position to confirm), and its
/// commit time (microseconds since the Unix epoch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LastCommit {
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_time: i64,
}

/// Identifies a transaction inside one tracker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TxnId(u64);

impl TxnId {
    #[cfg(test)]
    pub(crate) fn for_tests(n: u64) -> TxnId {
        TxnId(n)
    }
}

#[derive(Debug)]
struct Txn {
    /// Set at commit; `None` while the transaction is still being read.
    end_lsn: Option<Lsn>,
    /// Where its commit record starts (set at commit).
    commit_lsn: Lsn,
    /// Events sent and not yet acknowledged.
    pending: usize,
    /// Caller's clock when the transaction began (for the oldest-unacked age).
    opened_at: i64,
    /// The transaction's commit time (for the commit-to-ack histogram).
    commit_time: i64,
    /// Whether any event of it was sent.
    had_events: bool,
}

/// Tracks unacknowledged events per transaction and the confirmable LSN.
#[derive(Debug)]
pub struct AckTracker {
    txns: VecDeque<Txn>,
    first_id: u64,
    flushed: Lsn,
    inflight: usize,
    /// Transactions retired since the last drain: commit time, and
    /// whether they had events.
    retired: Vec<(i64, bool)>,
    /// The last transaction retired (at or before `flushed`).
    last_commit: Option<LastCommit>,
}

impl AckTracker {
    /// Starts at the slot's confirmed position.
    pub fn new(start: Lsn) -> Self {
        AckTracker {
            txns: VecDeque::new(),
            first_id: 0,
            flushed: start,
            inflight: 0,
            retired: Vec::new(),
            last_commit: None,
        }
    }

    /// The highest LSN that is safe to confirm.
    pub fn flushed(&self) -> Lsn {
        self.flushed
    }

    /// The commit time (the caller's unit) of the last transaction
    /// retired: every transaction after `flushed` committed after it.
    pub fn last_commit_time(&self) -> Option<i64> {
        self.last_commit.map(|c| c.commit_time)
    }

    /// The last transaction retired: every transaction after `flushed`
    /// committed after it.
    pub fn last_commit(&self) -> Option<LastCommit> {
        self.last_commit
    }

    /// Events sent and not yet acknowledged.
    pub fn inflight(&self) -> usize {
        self.inflight
    }

    /// No transaction is open or waiting for acknowledgements.
    pub fn is_idle(&self) -> bool {
        self.txns.is_empty()
    }

    /// A transaction started at `opened_at` (any clock the caller likes).
    pub fn begin(&mut self, opened_at: i64) -> TxnId {
        self.txns.push_back(Txn {
            end_lsn: None,
            commit_lsn: Lsn::ZERO,
            pending: 0,
            opened_at,
            commit_time: 0,
            had_events: false,
        });
        TxnId(self.first_id + self.txns.len() as u64 - 1)
    }

    fn txn_mut(&mut self, id: TxnId) -> Option<&mut Txn> {
        let idx = id.0.checked_sub(self.first_id)?;
        self.txns.get_mut(usize::try_from(idx).ok()?)
    }

    /// An event of `id` was handed to the producer.
    pub fn sent(&mut self, id: TxnId) {
        if let Some(t) = self.txn_mut(id) {
            t.pending += 1;
            t.had_events = true;
            self.inflight += 1;
        }
    }

    /// The transaction's commit was read; its events are all sent.
    pub fn commit(&mut self, id: TxnId, c: LastCommit) {
        if let Some(t) = self.txn_mut(id) {
            t.end_lsn = Some(c.end_lsn);
            t.commit_lsn = c.commit_lsn;
            t.commit_time = c.commit_time;
        }
        self.retire();
    }

    /// Kafka acknowledged one event of `id`.
    pub fn acked(&mut self, id: TxnId) {
        if let Some(t) = self.txn_mut(id) {
            if t.pending > 0 {
                t.pending -= 1;
                self.inflight -= 1;
            }
        }
        self.retire();
    }

    /// Kafka made `n` events of `id` durable at once (a committed Kafka
    /// transaction).
    pub fn acked_many(&mut self, id: TxnId, n: usize) {
        if let Some(t) = self.txn_mut(id) {
            let n = n.min(t.pending);
            t.pending -= n;
            self.inflight -= n;
        }
        self.retire();
    }

    /// When the oldest unfinished transaction began, if there is one.
    pub fn oldest_opened_at(&self) -> Option<i64> {
        self.txns.front().map(|t| t.opened_at)
    }

    /// The transactions retired since the last call: commit time, and
    /// whether they had events.
    pub fn drain_retired(&mut self) -> std::vec::Drain<'_, (i64, bool)> {
        self.retired.drain(..)
    }

    /// A keepalive reported `wal_end`: confirm it if nothing is pending.
    pub fn idle_advance(&mut self, wal_end: Lsn) {
        if self.txns.is_empty() && wal_end > self.flushed {
            self.flushed = wal_end;
        }
    }

    fn retire(&mut self) {
        while let Some(front) = self.txns.front() {
            match front.end_lsn {
                Some(end) if front.pending == 0 => {
                    if end > self.flushed {
                        self.flushed = end;
                    }
                    self.retired.push((front.commit_time, front.had_events));
                    self.last_commit = Some(LastCommit {
                        commit_lsn: front.commit_lsn,
                        end_lsn: end,
                        commit_time: front.commit_time,
                    });
                    self.txns.pop_front();
                    self.first_id += 1;
                }
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(end_lsn: Lsn, commit_time: i64) -> LastCommit {
        LastCommit {
            commit_lsn: Lsn(end_lsn.0.saturating_sub(8)),
            end_lsn,
            commit_time,
        }
    }

    #[test]
    fn waits_for_earlier_transactions() {
        let mut t = AckTracker::new(Lsn(10));
        let a = t.begin(0);
        t.sent(a);
        t.sent(a);
        t.commit(a, at(Lsn(100), 1));
        let b = t.begin(0);
        t.sent(b);
        t.commit(b, at(Lsn(200), 2));
        assert_eq!(t.inflight(), 3);
        t.acked(b);
        assert_eq!(t.flushed(), Lsn(10), "b is done but a is not");
        t.acked(a);
        assert_eq!(t.flushed(), Lsn(10));
        t.acked(a);
        assert_eq!(t.flushed(), Lsn(200));
        assert!(t.is_idle());
        assert_eq!(
            t.drain_retired().collect::<Vec<_>>(),
            vec![(1, true), (2, true)],
            "in commit order"
        );
        assert_eq!(t.drain_retired().count(), 0);
        assert_eq!(t.inflight(), 0);
    }

    #[test]
    fn empty_transactions_and_idle_keepalives() {
        let mut t = AckTracker::new(Lsn::ZERO);
        let a = t.begin(0);
        t.idle_advance(Lsn(50));
        assert_eq!(
            t.flushed(),
            Lsn::ZERO,
            "an open transaction blocks keepalive confirmation"
        );
        t.commit(a, at(Lsn(60), 0));
        assert_eq!(t.flushed(), Lsn(60), "an empty transaction retires at commit");
        t.idle_advance(Lsn(90));
        assert_eq!(t.flushed(), Lsn(90));
        t.idle_advance(Lsn(80));
        assert_eq!(t.flushed(), Lsn(90), "never backwards");
    }

    #[test]
    fn an_open_transaction_is_never_confirmed() {
        let mut t = AckTracker::new(Lsn::ZERO);
        let a = t.begin(0);
        t.sent(a);
        t.acked(a);
        assert_eq!(t.flushed(), Lsn::ZERO, "acked but its commit was not read yet");
        t.commit(a, at(Lsn(5), 0));
        assert_eq!(t.flushed(), Lsn(5));
    }

    proptest! {
        /// Random transaction sizes, random interleaving of acks: the
        /// flushed LSN never passes a transaction with an unacknowledged
        /// event, never goes back, and ends at the last commit.
        #[test]
        fn random_ack_orders(sizes in proptest::collection::vec(0usize..6, 1..40), seed in any::<u64>()) {
            let mut t = AckTracker::new(Lsn::ZERO);
            let mut outstanding: Vec<(TxnId, usize)> = Vec::new(); // (txn, index in sizes)
            let mut remaining = sizes.clone();
            let ends: Vec<Lsn> = (0..sizes.len()).map(|i| Lsn(100 * (i as u64 + 1))).collect();
            for (i, &n) in sizes.iter().enumerate() {
                let id = t.begin(0);
                for _ in 0..n {
                    t.sent(id);
                    outstanding.push((id, i));
                }
                t.commit(id, at(ends[i], i as i64));
            }
            let mut rng = seed;
            let mut last = t.flushed();
            while !outstanding.is_empty() {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let pick = (rng >> 33) as usize % outstanding.len();
                let (id, i) = outstanding.swap_remove(pick);
                t.acked(id);
                remaining[i] -= 1;
                let f = t.flushed();
                prop_assert!(f >= last);
                last = f;
                // No transaction with pending events ends at or before f.
                for (j, &left) in remaining.iter().enumerate() {
                    if left > 0 {
                        prop_assert!(f < ends[j], "flushed {} passed txn {} with {} unacked", f, j, left);
                    }
                }
                prop_assert_eq!(t.inflight(), remaining.iter().sum::<usize>());
            }
            prop_assert_eq!(t.flushed(), *ends.last().unwrap());
            prop_assert!(t.is_idle());
        }
    }
}
