//! Exactly-once: committing the open Kafka transaction, with the progress
//! record inside it, and what a shutdown does with it.

use std::time::Duration;

use futures::StreamExt;
use tokio::time::Instant;

use super::session::{Sent, Session};
use super::{Relay, RelayError};
use crate::pg::outbox_stream::OutboxStream;

impl Relay {
    /// Waits, keeping the replication session alive, until every record
    /// sent so far has a delivery report.
    async fn await_deliveries(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        while !s.deliveries.is_empty() {
            let (received, flushed, every) = s.beat();
            match stream
                .keep_alive_while(received, flushed, every, s.deliveries.next())
                .await?
            {
                Some(done) => s.delivered(&self.metrics, done)?,
                None => break,
            }
        }
        Ok(())
    }

    /// Commits the open Kafka transaction: once every record in it is
    /// reported, the progress record (the last PostgreSQL transaction's
    /// commit LSN) goes in, then the commit. Only a successful commit makes
    /// its events count as acknowledged, and so lets the slot move.
    pub(super) async fn commit_kafka_transaction(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        let Some(t) = s.durability.transactions() else {
            return Ok(());
        };
        let (Some(last), Some(txn), Some(progress)) = (
            t.group.last(),
            t.group.last_txn(),
            t.progress_record(chrono::Utc::now()),
        ) else {
            // Nothing was sent: nothing to commit.
            t.closing = false;
            return Ok(());
        };
        self.await_deliveries(stream, s).await?;
        self.send(stream, s, txn, last.commit_lsn, &progress, Sent::Progress, false)
            .await?;
        self.await_deliveries(stream, s).await?;

        let started = Instant::now();
        let timeout = self.config.kafka.exactly_once.commit_timeout.0;
        let (received, flushed, every) = s.beat();
        let committed = stream
            .keep_alive_while(received, flushed, every, self.sink.commit_transaction(timeout))
            .await?;
        if let Err(e) = committed {
            self.metrics
                .kafka_transactions
                .with_label_values(&["aborted"])
                .inc();
            self.health.kafka_transaction_aborted();
            return Err(e.into());
        }
        self.metrics
            .kafka_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics
            .kafka_transactions
            .with_label_values(&["committed"])
            .inc();
        self.metrics
            .progress_lsn
            .set(i64::try_from(last.commit_lsn.0).unwrap_or(i64::MAX));
        self.health.kafka_transaction_committed(last.commit_lsn.0);
        let Some(t) = s.durability.transactions() else {
            return Ok(());
        };
        t.closing = false;
        t.progress_lsn = Some(last.commit_lsn);
        for (txn, events) in t.group.take() {
            s.tracker.acked_many(txn, events);
            s.acked += events as u64;
        }
        s.observe_retired(&self.metrics);
        Ok(())
    }

    /// Shutdown with a Kafka transaction open: commit it if it ends at a
    /// PostgreSQL commit; abort it if a PostgreSQL transaction is half in
    /// it (the next start replays that part from the progress record).
    /// Bounded by `deadline` (the drain timeout).
    pub(super) async fn finish_kafka_transaction(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        deadline: Instant,
    ) {
        let Some(t) = s.durability.transactions() else {
            return;
        };
        if t.group.is_empty() {
            return;
        }
        if !t.group.mid_transaction() {
            t.closing = true;
            match tokio::time::timeout_at(deadline, self.commit_kafka_transaction(stream, s)).await {
                Ok(Ok(())) => return,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "the last Kafka transaction failed at shutdown; it is replayed after restart")
                }
                Err(_) => tracing::warn!(
                    "the last Kafka transaction did not commit within shutdown.drain_timeout; it is replayed after restart"
                ),
            }
        }
        if self.sink.in_transaction() {
            self.metrics
                .kafka_transactions
                .with_label_values(&["aborted"])
                .inc();
            self.health.kafka_transaction_aborted();
        }
        if let Err(e) = self.sink.abort_transaction(Duration::from_secs(5)).await {
            tracing::debug!(error = %e, "abort at shutdown failed; the next start's init_transactions aborts the transaction");
        }
        // The aborted records' reports are purge errors: nothing to wait for.
        s.deliveries.clear();
        s.dead_letters.clear();
    }
}
