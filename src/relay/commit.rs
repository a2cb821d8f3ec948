//! Exactly-once: committing the open Kafka transaction, with the progress
//! record inside it, and what a shutdown does with it.
//!
//! A commit goes in steps, driven by the streaming loop so that status
//! updates, delivery reports and read-ahead go on meanwhile:
//!
//! 1. a bound is reached at a PostgreSQL commit: the transaction closes
//!    (new stream events are held) and the progress record goes in;
//! 2. once every record in it has a delivery report and the previous
//!    commit is done, its commit starts in the background on its producer
//!    ([`Relay::advance_commit`]), the other producer becomes current, and
//!    the held events are handled ([`Relay::release_held`]), filling the
//!    next transaction;
//! 3. when the commit is done ([`Relay::commit_finished`]), the
//!    transaction's events count as acknowledged and the slot may move.

use std::time::Duration;

use tokio::time::Instant;

use super::session::{Sent, Session};
use super::{Relay, RelayError};
use crate::kafka::sink::KafkaSinkError;
use crate::relay::exactly_once::RowPos;
use crate::source::stream::OutboxStream;

/// Resolves when the background commit is done; never without one.
pub(super) async fn commit_outcome(
    handle: Option<&mut tokio::task::JoinHandle<Result<(), KafkaSinkError>>>,
) -> Result<(), KafkaSinkError> {
    match handle {
        Some(h) => h.await.unwrap_or(Err(KafkaSinkError::Canceled)),
        None => std::future::pending().await,
    }
}

impl Relay {
    /// Moves a closing transaction on: sends its progress record, and once
    /// every record has a delivery report, starts the commit.
    pub(super) async fn advance_commit(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        let Some(e) = s.durability.exactly_once() else {
            return Ok(());
        };
        if !e.t.closing || e.committing.is_some() {
            return Ok(());
        }
        if !e.t.progress_sent {
            let (Some(last), Some(txn), Some(progress)) = (
                e.t.group.last(),
                e.t.group.last_txn(),
                e.t.progress_record(chrono::Utc::now()),
            ) else {
                // Nothing was sent: nothing to commit.
                e.t.closing = false;
                return Ok(());
            };
            e.t.progress_sent = true;
            e.closing_since = Some(std::time::Instant::now());
            // Where the progress record lands in the transaction does not
            // matter, only that the commit holds it with the rest.
            self.send(
                stream,
                s,
                txn,
                last.commit_lsn,
                RowPos {
                    commit_lsn: last.commit_lsn,
                    index: u32::MAX,
                },
                &progress,
                Sent::Progress,
                false,
                None,
            )
            .await?;
        }
        if !s.deliveries.is_empty() || !s.dead_letters.is_empty() {
            return Ok(());
        }
        // One commit at a time: progress records land in commit order.
        if s.durability.commit_handle().is_some() {
            return Ok(());
        }
        // Every report is in, but librdkafka may not have let go of the
        // last one yet; its commit would then flush in 100 ms poll steps.
        let settle = Instant::now() + Duration::from_millis(20);
        while self.sink.in_flight() > 0 && Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let timeout = self.config.kafka.exactly_once.commit_timeout.0;
        let handle = self.sink.start_commit(timeout);
        if let Some(e) = s.durability.exactly_once() {
            e.committing = Some(handle);
            e.commit_started = Some(std::time::Instant::now());
            e.committing_group = std::mem::take(&mut e.t.group);
            e.committing_since = e.closing_since.take();
            e.t.closing = false;
            e.t.progress_sent = false;
        }
        Ok(())
    }

    /// The background commit is done: on success its events are durable.
    pub(super) fn commit_finished(
        &mut self,
        s: &mut Session,
        outcome: Result<(), KafkaSinkError>,
    ) -> Result<(), RelayError> {
        let Some(e) = s.durability.exactly_once() else {
            return Ok(());
        };
        e.committing = None;
        let mut group = std::mem::take(&mut e.committing_group);
        if let Err(err) = outcome {
            self.metrics
                .kafka_transactions
                .with_label_values(&["aborted"])
                .inc();
            self.health.kafka_transaction_aborted();
            return Err(err.into());
        }
        let took = e.commit_started.take().map(|t| t.elapsed()).unwrap_or_default();
        let closing = e.committing_since.take().map(|t| t.elapsed()).unwrap_or_default();
        let last = group.last();
        tracing::debug!(
            events = group.events(),
            transactions = group.transactions(),
            ?closing,
            ?took,
            "Kafka transaction committed"
        );
        let m = &self.metrics;
        m.kafka_commit_seconds.observe(closing.as_secs_f64());
        m.kafka_transactions.with_label_values(&["committed"]).inc();
        if let Some(last) = last {
            e.committed_through = Some(last.commit_lsn);
            m.progress_lsn
                .set(i64::try_from(last.commit_lsn.0).unwrap_or(i64::MAX));
            self.health.kafka_transaction_committed(last.commit_lsn.0);
        }
        for (txn, events) in group.take() {
            s.tracker.acked_many(txn, events);
            s.acked += events as u64;
        }
        s.observe_retired(&self.metrics);
        Ok(())
    }

    /// Handles the events read ahead during a commit, until they run out
    /// or the next transaction closes.
    pub(super) async fn release_held(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        while let Some(ev) = s.durability.release() {
            self.handle_event(stream, s, ev).await?;
            if !s.dead_letters.is_empty() {
                self.flush_dead_letters(stream, s).await?;
            }
            if s.durability.commit_due() {
                self.advance_commit(stream, s).await?;
            }
        }
        Ok(())
    }

    /// Aborts the open Kafka transaction, if any, best effort: the next
    /// producer's `init_transactions` aborts it anyway (or the broker's
    /// `transaction.timeout.ms`).
    pub(super) async fn abort_open_transaction(&mut self) {
        if !self.sink.in_transaction() {
            return;
        }
        self.metrics
            .kafka_transactions
            .with_label_values(&["aborted"])
            .inc();
        self.health.kafka_transaction_aborted();
        if let Err(err) = self.sink.abort_transaction(Duration::from_secs(5)).await {
            tracing::debug!(error = %err, "abort failed; the next producer's init_transactions aborts the transaction");
        }
    }

    /// Drives the commit under way and the closing transaction, if any,
    /// to their ends, inline (at shutdown).
    async fn commit_inline(&mut self, stream: &mut OutboxStream, s: &mut Session) -> Result<(), RelayError> {
        loop {
            self.advance_commit(stream, s).await?;
            let (received, flushed, every) = s.beat();
            if let Some(handle) = s.durability.commit_handle() {
                let outcome = stream
                    .keep_alive_while(received, flushed, every, commit_outcome(Some(handle)))
                    .await?;
                self.commit_finished(s, outcome)?;
                continue;
            }
            if s.durability.accepting() {
                return Ok(());
            }
            match stream
                .keep_alive_while(received, flushed, every, s.deliveries.next())
                .await?
            {
                Some(done) => s.delivered(&self.metrics, done)?,
                None => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    }

    /// Shutdown with Kafka transactions open: the one committing finishes;
    /// the open one commits if it ends at a PostgreSQL commit, and is
    /// aborted if a PostgreSQL transaction is half in it (the next start
    /// replays that part from the progress record). Events read ahead are
    /// dropped: they were never sent nor confirmed. Bounded by `deadline`
    /// (the drain timeout).
    pub(super) async fn finish_kafka_transaction(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        deadline: Instant,
    ) {
        let Some(e) = s.durability.exactly_once() else {
            return;
        };
        e.drop_held();
        if !e.t.group.is_empty() && !e.t.group.mid_transaction() {
            e.t.closing = true;
        }
        match tokio::time::timeout_at(deadline, self.commit_inline(stream, s)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "the last Kafka transaction failed at shutdown; it is replayed after restart")
            }
            Err(_) => tracing::warn!(
                "the last Kafka transaction did not commit within shutdown.drain_timeout; it is replayed after restart"
            ),
        }
        self.abort_open_transaction().await;
        // The aborted records' reports are purge errors: nothing to wait for.
        s.deliveries.clear();
        s.dead_letters.clear();
    }
}
