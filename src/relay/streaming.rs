//! The streaming loop of one session: intake, acknowledgements, status
//! updates, and the shutdown drain.
//!
//! Each round of the loop does one piece of work (a delivery report, an
//! event, a status tick, a commit's end, a watch that changed), then the
//! checks that follow any work (resend purged records, park, dead-letter,
//! commit, confirm). A biased select picks the piece; in a drain, building
//! and dropping its futures cost more than handling the event it returns.
//! So a round first takes a report or an event that is ready without
//! waiting (each polled once; both are cancel-safe), in the select's order,
//! and only while nothing that the select ranks higher has happened: no
//! shutdown, lease, guard or status tick, no Kafka commit under way or due.
//! At least every `QUICK_ROUNDS` rounds the select runs, and each such
//! round spends a unit of the task's cooperative budget (as the select's
//! futures did), so a draining source still yields the runtime's workers
//! to the other sources of its process. LSN progress is
//! untouched by it: acknowledgements are recorded by the same
//! `Session::delivered`, and confirmation by the same checks after each
//! round.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use super::commit::commit_outcome;
use super::resume::Passage;
use super::session::{now_micros, DeadLetterJob, Sent, Session, EAGER_CONFIRM, HEAR_OUT};
use super::{Relay, RelayError};
use crate::kafka::records::{build_record_into, dead_letter_stub, KafkaRecord, Poison};
use crate::kafka::sink::{KafkaSinkError, Refusal, SendOutcome};
use crate::lsn::Lsn;
use crate::ops::otel::PendingSpan;
use crate::postgres::error::PgError;
use crate::postgres::publication::{self, GuardState};
use crate::relay::exactly_once::{LastCommit, RowPos};
use crate::relay::progress::TxnId;
use crate::source::outbox::OutboxRow;
use crate::source::stream::{OutboxStream, StreamEvent};

/// Rounds of the streaming loop that may do ready work without the
/// select (see `stream_loop`): the timers and watches it skips are looked
/// at at least this often.
const QUICK_ROUNDS: u32 = 64;

/// Work the streaming loop can do without waiting.
enum Ready {
    /// A delivery report, in the order the select would take it (first);
    /// `None` as from `Deliveries::next`.
    Delivery(Option<super::session::Delivery>),
    /// An event, or the stream's end (`None`).
    Event(Option<StreamEvent>),
    Nothing,
}

/// What the select's delivery and event branches would take at once:
/// each future is polled once, and both are cancel-safe, so one that is
/// not ready is dropped with nothing lost.
fn ready_now(s: &mut Session, stream: &mut OutboxStream, intake: bool) -> Result<Ready, RelayError> {
    use futures::FutureExt;
    if !s.deliveries.is_empty() {
        if let Some(done) = s.deliveries.next().now_or_never() {
            return Ok(Ready::Delivery(done));
        }
    }
    if intake {
        if let Some(event) = stream.next_event().now_or_never() {
            return Ok(Ready::Event(event?));
        }
    }
    Ok(Ready::Nothing)
}

impl Relay {
    /// An event read from the stream: handled, or held while a Kafka
    /// commit is under way; `None`: the server ended the stream.
    async fn on_event(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        event: Option<StreamEvent>,
    ) -> Result<(), RelayError> {
        match event {
            Some(ev) if s.durability.accepting() => self.handle_event(stream, s, ev).await,
            // Read ahead while a Kafka commit is under way.
            Some(ev) => {
                if matches!(
                    ev,
                    StreamEvent::Keepalive {
                        reply_requested: true,
                        ..
                    }
                ) {
                    s.send_status(stream, false).await?;
                }
                s.durability.hold(ev);
                Ok(())
            }
            None => Err(RelayError::StreamEnded),
        }
    }

    pub(super) async fn stream_loop(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut status = tokio::time::interval(s.status_every);
        status.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut lease = self.election.lease();
        if *shutdown.borrow_and_update() {
            return Ok(());
        }
        // The ready work done between select rounds (see QUICK_ROUNDS), and
        // when the status tick is due, so that it is not skipped past.
        let mut quick = 0;
        let mut status_due = Instant::now();
        loop {
            // A lease lost before this loop subscribed (its renewal failed
            // while the session was being set up) is never reported as a
            // change: read it each round, or the session would stand still
            // for good, reading nothing.
            if lease.borrow().lost() {
                return Err(RelayError::LeadershipLost);
            }
            // Backpressure counts records librdkafka holds (its memory),
            // not events waiting for a Kafka commit: a PostgreSQL
            // transaction larger than max_inflight must still be read to
            // its commit. The bytes in flight are bounded too: past about
            // what the broker acknowledges per round trip, more records
            // only wait in librdkafka's queue, where a batch that is ready
            // while a partition has its five requests in flight makes the
            // broker thread spin (see BENCHMARKS.md).
            // Fencing: nothing is read (so nothing sent) unless the leader
            // lease is fresh; a leader that was stopped finds it stale
            // before anything else (see crate::relay::leader).
            // One clock read a round: the lease and the deadlines below
            // are judged against it.
            let now = Instant::now();
            let leading = self.election.still_held_at(now);
            // A failed delivery waits for the rest of its transaction's
            // reports (see `Session::pending_failure`).
            if let Some((since, _)) = &s.pending_failure {
                if s.deliveries.is_empty() || since.elapsed() >= HEAR_OUT {
                    if let Some((_, e)) = s.pending_failure.take() {
                        return Err(s.heard_out(e));
                    }
                }
            }
            // The bounds grow with the partitions written to (see
            // `crate::config::kafka::budget`).
            let (max_inflight, max_inflight_bytes) =
                self.config.kafka.inflight_budget(self.sink.partitions_in_use());
            let (held_rows, held_bytes) = s.durability.held();
            // A sequence handed back by a redrive is published between two
            // PostgreSQL transactions, once nothing is in flight (see
            // `parking`'s "Handback").
            let handing_back = s.open.is_none() && self.handback_due();
            // Only a round that isolates a transaction may wait in
            // `end_isolation` (a producer swap: up to the commit timeout),
            // which makes `now` stale: such a round takes the select,
            // whose timers see the time that passed.
            let may_wait = s.isolating;
            let intake = s.pending_failure.is_none()
                && !handing_back
                && leading
                && s.deliveries.len() + held_rows < max_inflight
                && s.deliveries.bytes() + held_bytes < max_inflight_bytes
                && self.end_isolation(s).await?;
            let commit_at = s.durability.deadline();
            // Work that is ready now (a delivery report already taken from
            // librdkafka, an event already in the socket's buffer) is done
            // without a round of the select, which costs more than handling
            // one event, as long as nothing the select watches has
            // happened; every QUICK_ROUNDS rounds the select runs anyway.
            let quiet = quick < QUICK_ROUNDS
                && !may_wait
                && !shutdown.has_changed().unwrap_or(true)
                && !lease.has_changed().unwrap_or(true)
                && !s.guard.has_changed().unwrap_or(true)
                && s.durability.commit_handle().is_none()
                && now < status_due
                && commit_at.is_none_or(|at| at > now);
            let ready = if quiet {
                ready_now(s, stream, intake)?
            } else {
                Ready::Nothing
            };
            match ready {
                Ready::Delivery(done) => {
                    quick += 1;
                    if let Some(done) = done {
                        s.delivered(&self.metrics, done)?;
                    }
                    tokio::task::coop::consume_budget().await;
                }
                Ready::Event(event) => {
                    quick += 1;
                    self.on_event(stream, s, event).await?;
                    tokio::task::coop::consume_budget().await;
                }
                Ready::Nothing => {
                    quick = 0;
                    tokio::select! {
                        biased;
                        _ = shutdown.changed() => return Ok(()),
                        // `None`: what was left came back purged, to be sent
                        // again below.
                        done = s.deliveries.next(), if !s.deliveries.is_empty() => {
                            if let Some(done) = done {
                                s.delivered(&self.metrics, done)?;
                            }
                        }
                        // Exactly-once: the background Kafka commit is done.
                        outcome = commit_outcome(s.durability.commit_handle()) => {
                            self.commit_finished(s, outcome)?;
                        }
                        _ = status.tick() => {
                            status_due = Instant::now() + s.status_every;
                            // When idle, ask for a keepalive: its WAL end lets the
                            // slot follow writes to other tables (rule 5).
                            let idle = s.tracker.is_idle();
                            s.send_status(stream, idle).await?;
                            self.refresh_parked(stream, s).await?;
                            self.report(stream, s);
                            self.refused.forget_through(s.confirmable());
                            let confirmable = s.confirmable();
                            self.suspects.retain(|p| p.commit_lsn >= confirmable);
                        }
                        changed = s.guard.changed() => {
                            let state = s.guard.borrow_and_update().clone();
                            match (changed, state) {
                                (Err(_), state) => return Err(RelayError::GuardFailed(format!("the guard ended at {}", state.verified()))),
                                (_, GuardState::Changed { verified, reason }) => {
                                    return Err(RelayError::PublicationChanged { verified, reason })
                                }
                                (_, GuardState::Failed { reason, .. }) => return Err(RelayError::GuardFailed(reason)),
                                (_, GuardState::Restart { reason, .. }) => return Err(RelayError::Resubscribe(reason)),
                                (_, GuardState::Verified(_)) => {}
                            }
                        }
                        // The lease was renewed, or lost.
                        _ = lease.changed() => {
                            if lease.borrow_and_update().lost() {
                                return Err(RelayError::LeadershipLost);
                            }
                        }
                        // The open Kafka transaction's max_wait ran out: the check
                        // after the select commits it.
                        _ = tokio::time::sleep_until(commit_at.unwrap_or_else(Instant::now)), if commit_at.is_some() => {}
                        event = stream.next_event(), if intake => self.on_event(stream, s, event?).await?,
                    }
                }
            }
            // Nothing more goes into a Kafka transaction that failed.
            let failing = s.pending_failure.is_some();
            // The shared producer gave records back unsent: they go again,
            // in order, before anything new.
            if s.deliveries.has_purged() && !failing {
                self.resend_purged(stream, s).await?;
            }
            if !s.to_park.is_empty() && !failing {
                self.flush_parked(stream, s).await?;
            }
            if !s.dead_letters.is_empty() && !failing {
                self.flush_dead_letters(stream, s).await?;
            }
            if !failing && s.durability.commit_due() {
                self.advance_commit(stream, s).await?;
            }
            if !failing && s.durability.releasable() && leading {
                self.release_held(stream, s).await?;
            }
            if handing_back
                && !failing
                && s.open.is_none()
                && s.durability.settled()
                && super::nothing_in_flight(s)
                && s.to_park.is_empty()
            {
                self.hand_back(stream, s).await?;
            }
            // Confirm soon after acknowledgements move the flush position,
            // not only on the timer, but at most every EAGER_CONFIRM.
            if s.confirmable() > s.reported_flush && s.last_status.elapsed() >= EAGER_CONFIRM {
                s.send_status(stream, false).await?;
            }
        }
    }

    pub(super) async fn handle_event(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        ev: StreamEvent,
    ) -> Result<(), RelayError> {
        if let Some(w) = &s.waypoint {
            match w.pass(&ev) {
                Passage::Before => {}
                Passage::Met => {
                    tracing::info!(source = w.source, commit_lsn = %w.commit.commit_lsn, "the stream met the transaction Kafka holds: this is the WAL history outboxd streamed");
                    s.waypoint = None;
                }
                Passage::Rewound(detail) => return Err(self.rewound(detail)),
            }
        }
        match ev {
            StreamEvent::Begin {
                commit_time,
                final_lsn,
                ..
            } => {
                if s.open.is_some() {
                    return Err(RelayError::OutOfOrder("Begin inside a transaction"));
                }
                s.open = Some(s.tracker.begin(now_micros()));
                s.open_commit = final_lsn;
                s.row_index = 0;
                s.open_commit_ms = commit_time.unix_micros().div_euclid(1000);
                s.skipping = !s.durability.admit(final_lsn);
                if !s.skipping {
                    s.durability.begin();
                }
            }
            StreamEvent::Insert { .. } | StreamEvent::Unreadable { .. } if s.skipping => {}
            StreamEvent::Insert { row, lsn } => {
                let txn = s
                    .open
                    .ok_or(RelayError::OutOfOrder("INSERT outside a transaction"))?;
                let pos = s.next_pos();
                self.publish(stream, s, txn, &row, lsn, pos).await?;
                if !s.to_park.is_empty() {
                    self.flush_parked(stream, s).await?;
                }
            }
            StreamEvent::Unreadable { row, lsn } => {
                let txn = s
                    .open
                    .ok_or(RelayError::OutOfOrder("INSERT outside a transaction"))?;
                let pos = s.next_pos();
                let behind = self.parks_unreadable(&row, pos);
                s.unreadable_row(txn, &row, lsn, pos, behind)?;
                if !s.to_park.is_empty() {
                    self.flush_parked(stream, s).await?;
                }
            }
            StreamEvent::Commit {
                end_lsn,
                commit_lsn,
                commit_time,
            } => {
                let txn = s
                    .open
                    .take()
                    .ok_or(RelayError::OutOfOrder("Commit without Begin"))?;
                let commit = LastCommit {
                    commit_lsn,
                    end_lsn,
                    commit_time: commit_time.unix_micros(),
                };
                if std::mem::take(&mut s.skipping) {
                    s.skipped += 1;
                } else {
                    s.durability.committed(commit);
                }
                s.tracker.commit(txn, commit);
                s.observe_retired(&self.metrics);
                s.received = s.received.max(end_lsn);
            }
            StreamEvent::Keepalive {
                wal_end,
                reply_requested,
            } => {
                s.received = s.received.max(wal_end);
                if s.open.is_none() {
                    s.tracker.idle_advance(wal_end);
                }
                if reply_requested {
                    s.send_status(stream, false).await?;
                }
            }
        }
        Ok(())
    }

    pub(super) async fn publish(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        txn: TxnId,
        row: &OutboxRow,
        lsn: Lsn,
        pos: RowPos,
    ) -> Result<(), RelayError> {
        // Kafka refused this record inside an earlier Kafka transaction,
        // which was aborted: it is set aside in this one.
        if let Some(r) = self.refused.get(pos) {
            let poison = Poison {
                reason: r.reason,
                error: r.error.clone(),
                lsn,
                intended_topic: Some(r.topic.clone()),
                omit_payload: r.omit_payload,
            };
            return s.poison_row(txn, row, pos, poison);
        }
        // Its sequence is parked: it goes behind the head.
        if self.park_behind(stream, s, row, pos).await? {
            return Ok(());
        }
        // Built into the buffers of the record sent before; they go back
        // to `self.scratch` once this record is sent (a row that fails
        // leaves it empty, and the next builds anew).
        let mut record = std::mem::take(&mut self.scratch);
        let mut built = build_record_into(
            row,
            &self.validated.topic,
            &self.validated.value,
            s.open_commit_ms,
            &mut record,
        )
        .map(|()| record);
        if let (Some(registry), Ok(record)) = (self.registry.as_mut(), built.as_mut()) {
            if !registry.ready(row, &record.topic) {
                let (received, flushed, every) = s.beat();
                stream
                    .keep_alive_while(received, flushed, every, registry.resolve(row, &record.topic))
                    .await??;
            }
            let mut misfit = registry.try_encode(record, row)?;
            // A mismatch against a `latest` schema may be a newer version
            // the cache has not seen yet: look once more before calling the
            // row poison.
            if misfit.is_some() && registry.recheck_after_mismatch(row, &record.topic, s.open_commit_ms) {
                let (received, flushed, every) = s.beat();
                stream
                    .keep_alive_while(received, flushed, every, registry.resolve(row, &record.topic))
                    .await??;
                misfit = registry.try_encode(record, row)?;
            }
            if let Some(e) = misfit {
                registry.count_mismatch();
                built = Err(e);
            }
        }
        let record = match built {
            Ok(r) => r,
            Err(e) => {
                let poison = Poison {
                    reason: e.reason(),
                    error: e.to_string(),
                    lsn,
                    intended_topic: None,
                    omit_payload: false,
                };
                return s.poison_row(txn, row, pos, poison);
            }
        };
        self.ensure_topic(stream, s.beat(), &record.topic).await??;
        let span = self
            .otel
            .as_ref()
            .and_then(|t| t.pending(&record, s.open_commit_ms));
        // It shared a batch Kafka refused: it goes on its own, with nothing
        // else in flight, so that a refusal now is its own.
        let alone = self.suspects.contains(&pos);
        // Parking while isolating: one record in flight, so that a refusal
        // is known before a later record of its sequence is sent.
        if s.isolating && s.on_poison == crate::config::OnPoison::Park && !s.durability.in_transaction() {
            self.settle(stream, s).await?;
            if !s.to_park.is_empty() {
                self.flush_parked(stream, s).await?;
                if self.park_behind(stream, s, row, pos).await? {
                    return Ok(());
                }
            }
            s.isolated_row = Some((pos, row.clone()));
        }
        if alone {
            self.settle(stream, s).await?;
            if s.pending_failure.is_some() {
                return Ok(());
            }
            s.alone = Some(pos);
        }
        let sent = self
            .send(stream, s, txn, lsn, pos, &record, Sent::Event, true, span)
            .await;
        self.scratch = record.recycled();
        if alone && sent.is_ok() {
            self.settle(stream, s).await?;
            s.alone = None;
        }
        match sent {
            // Refused before it was sent (librdkafka's own checks, such as
            // message.max.bytes): this record alone is the cause.
            Err(RelayError::Kafka(KafkaSinkError::Produce { source, topic })) => match Refusal::of(&source) {
                Refusal::Record { reason, omit_payload } => {
                    let poison = Poison {
                        reason,
                        error: source.to_string(),
                        lsn,
                        intended_topic: Some(topic),
                        omit_payload,
                    };
                    s.poison_row(txn, row, pos, poison)
                }
                Refusal::Denied => Err(RelayError::KafkaDenied { topic, source }),
                // A Kafka transaction that failed refuses every later send
                // at once (an erroneous state), while the report naming the
                // cause may still be on its way: hear the reports out.
                Refusal::Transient if s.durability.in_transaction() => {
                    s.pending_failure
                        .get_or_insert((Instant::now(), KafkaSinkError::Produce { source, topic }.into()));
                    Ok(())
                }
                Refusal::Transient => Err(KafkaSinkError::Produce { source, topic }.into()),
            },
            other => other,
        }
    }

    /// Waits until nothing this session sent is in flight, handling each
    /// report, or until a report starts hearing a failure out.
    async fn settle(&mut self, stream: &mut OutboxStream, s: &mut Session) -> Result<(), RelayError> {
        while !s.deliveries.is_empty() && s.pending_failure.is_none() {
            let next = stream
                .keep_alive_while(s.received, s.reported_flush, s.status_every, s.deliveries.next())
                .await?;
            if let Some(done) = next {
                s.delivered(&self.metrics, done)?;
            }
        }
        Ok(())
    }

    /// Makes sure `topic` exists and is served, keeping the session alive
    /// while that waits (creation, the readiness check).
    pub(super) async fn ensure_topic(
        &mut self,
        stream: &mut OutboxStream,
        (received, flushed, every): (Lsn, Lsn, Duration),
        topic: &str,
    ) -> Result<Result<(), KafkaSinkError>, PgError> {
        // Every record asks; only a topic new to the session waits.
        if self.sink.knows_topic(topic) {
            return Ok(Ok(()));
        }
        stream
            .keep_alive_while(received, flushed, every, self.sink.ensure_topic(topic))
            .await
    }

    /// Enqueues one record, waiting for acknowledgements while the queue
    /// is full; `count` says whether the tracker gains an event for it,
    /// and `span` is recorded when Kafka answers (see [`crate::ops::otel`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn send(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        txn: TxnId,
        lsn: Lsn,
        pos: RowPos,
        record: &KafkaRecord,
        sent: Sent,
        count: bool,
        mut span: Option<Box<PendingSpan>>,
    ) -> Result<(), RelayError> {
        loop {
            // No record goes to Kafka without a fresh leader lease.
            if !self.election.still_held() {
                return Err(RelayError::LeadershipLost);
            }
            let outcome = match self.sink.send_reported(record) {
                // The shared producer purged since this session last
                // caught up: first send again what it gave back. Not while
                // draining at shutdown: what came back stays unconfirmed,
                // for the next start to send.
                Err(KafkaSinkError::Purged) if !s.draining => {
                    self.resend_purged(stream, s).await?;
                    continue;
                }
                other => other?,
            };
            match outcome {
                SendOutcome::Sent(ticket) => {
                    if count {
                        s.tracker.sent(txn);
                        s.durability.sent(txn, record.size());
                    }
                    s.deliveries
                        .push(ticket, (txn, lsn, pos, sent), record.size(), span.take());
                    return Ok(());
                }
                SendOutcome::QueueFull => match stream
                    .keep_alive_while(s.received, s.reported_flush, s.status_every, s.deliveries.next())
                    .await?
                {
                    Some(done) => s.delivered(&self.metrics, done)?,
                    None => tokio::time::sleep(Duration::from_millis(1)).await,
                },
            }
        }
    }

    /// Sends again, in their order, the records the shared producer purged
    /// unsent after a delivery failed (see [`crate::kafka::delivery`]), and
    /// takes the producer's new generation. First every report of what the
    /// session sent before is heard (a failure of its own ends the session
    /// as usual): each partition then holds a prefix of the session's
    /// records, and the purged rest follows it. A purge while this runs
    /// starts it over.
    pub(super) async fn resend_purged(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        loop {
            let generation = stream
                .keep_alive_while(
                    s.received,
                    s.reported_flush,
                    s.status_every,
                    self.sink.quiet_generation(),
                )
                .await?;
            while !s.deliveries.is_empty() {
                let next = stream
                    .keep_alive_while(s.received, s.reported_flush, s.status_every, s.deliveries.next())
                    .await?;
                if let Some(done) = next {
                    s.delivered(&self.metrics, done)?;
                }
            }
            self.sink.adopt(generation);
            let mut purged = s.deliveries.take_purged();
            if !purged.is_empty() {
                tracing::debug!(
                    records = purged.len(),
                    "sending again the records the shared producer purged"
                );
            }
            let mut stale = false;
            while let Some((entry, record)) = purged.pop_front() {
                if !self.election.still_held() {
                    return Err(RelayError::LeadershipLost);
                }
                match self.sink.send_reported(&record) {
                    Ok(SendOutcome::Sent(ticket)) => {
                        self.metrics.resent_records.inc();
                        s.deliveries.resent(ticket, entry);
                    }
                    Ok(SendOutcome::QueueFull) => {
                        purged.push_front((entry, record));
                        match stream
                            .keep_alive_while(
                                s.received,
                                s.reported_flush,
                                s.status_every,
                                s.deliveries.next(),
                            )
                            .await?
                        {
                            Some(done) => s.delivered(&self.metrics, done)?,
                            None => tokio::time::sleep(Duration::from_millis(1)).await,
                        }
                    }
                    Err(KafkaSinkError::Purged) => {
                        purged.push_front((entry, record));
                        stale = true;
                        break;
                    }
                    // librdkafka refused the record it gave back for good
                    // (its partition is gone: the topic was made again
                    // with fewer, or a placement's partition never existed
                    // and the record waited for the topic's metadata). The
                    // next session sends the rows from the slot one per
                    // batch, where a bad row is set aside by
                    // routing.on_poison.
                    Err(KafkaSinkError::Produce { topic, source })
                        if matches!(Refusal::of(&source), Refusal::Record { .. }) =>
                    {
                        return Err(RelayError::BatchRefused {
                            lsn: entry.lsn(),
                            topic,
                            source,
                        })
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if !stale && !s.deliveries.has_purged() {
                return Ok(());
            }
            // Purged again meanwhile: what is left goes after what the new
            // purge gives back, in send order.
            s.deliveries.keep_purged(purged);
        }
    }

    /// Sends the dead letters queued by the last step. A transient failure
    /// ends the session like any other (the replay sets the row aside
    /// again); any other failure stops outboxd: a poison row is never dropped.
    pub(super) async fn flush_dead_letters(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        let definite = |e: RelayError| match e {
            RelayError::Kafka(k) if !k.is_transient() => RelayError::DeadLetterFailed(k.to_string()),
            other => other,
        };
        while let Some(mut job) = s.dead_letters.pop_front() {
            // Kafka refused this dead letter in an aborted transaction.
            if let Some(r) = self.refused.get(job.pos).filter(|r| r.stub && !job.stub) {
                job.record = dead_letter_stub(&job.record, &r.error);
                job.stub = true;
            }
            self.ensure_topic(stream, s.beat(), &job.record.topic)
                .await?
                .map_err(|e| definite(e.into()))?;
            let sent = Sent::DeadLetter {
                reason: job.reason,
                stub: job.stub,
            };
            match self
                .send(
                    stream,
                    s,
                    job.txn,
                    job.lsn,
                    job.pos,
                    &job.record,
                    sent,
                    !job.counted,
                    None,
                )
                .await
            {
                // librdkafka refused it before sending (message.max.bytes):
                // its stub goes instead.
                Err(RelayError::Kafka(KafkaSinkError::Produce { source, .. }))
                    if !job.stub && matches!(Refusal::of(&source), Refusal::Record { .. }) =>
                {
                    tracing::warn!(lsn = %job.lsn, error = %source, "Kafka refused a dead letter; sending its stub (id, reason, sizes) instead");
                    s.dead_letters.push_front(DeadLetterJob {
                        record: dead_letter_stub(&job.record, &source.to_string()),
                        stub: true,
                        ..job
                    });
                }
                other => other.map_err(definite)?,
            }
        }
        Ok(())
    }

    /// Publishes the session's progress to the metrics and the health
    /// state: once per status tick, never per event.
    pub(super) fn report(&self, stream: &OutboxStream, s: &mut Session) {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let m = &self.metrics;
        m.events_published.inc_by(std::mem::take(&mut s.acked));
        m.transactions.inc_by(std::mem::take(&mut s.retired));
        m.skipped_transactions.inc_by(std::mem::take(&mut s.skipped));
        let flushed = s.confirmable();
        // The server's WAL end: the stream reports the decoded position,
        // the poller pg_current_wal_lsn(); the WAL end only grows.
        let wal_end = stream
            .server_wal_end()
            .max(s.received)
            .max(Lsn(self.health.server_wal_end()));
        let lag = wal_end.bytes_since(flushed);
        let inflight = s.tracker.inflight() as u64;
        m.received_lsn.set(gauge(s.received.0));
        m.confirmed_lsn.set(gauge(flushed.0));
        m.replication_lag_bytes.set(gauge(lag));
        m.inflight_events.set(gauge(inflight));
        if let Some(at) = s.last_ack {
            let unix = SystemTime::now()
                .checked_sub(at.elapsed())
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0.0, |d| d.as_secs_f64());
            m.last_ack_timestamp_seconds.set(unix);
            self.health.acked_at(at);
        }
        let oldest = s
            .tracker
            .oldest_opened_at()
            .filter(|_| inflight > 0)
            .and_then(|opened| {
                let age = u64::try_from(now_micros().saturating_sub(opened)).unwrap_or(0);
                std::time::Instant::now().checked_sub(Duration::from_micros(age))
            });
        self.health.set_inflight(inflight, oldest);
        self.health.status_sent(s.received.0, flushed.0, lag);
        // A leader woken from a freeze past its lease writes no register:
        // the one that leads now keeps it.
        if let Some(register) = s.register.as_mut().filter(|_| self.election.still_held()) {
            // The last retired commit lies at or before `flushed` only when
            // nothing (the guard) holds the confirmed position back.
            let last_commit = s.tracker.last_commit().filter(|_| flushed == s.tracker.flushed());
            register.tick(flushed, last_commit);
        }
        m.ready.set(i64::from(self.health.not_ready_reasons().is_empty()));
    }

    /// After shutdown was asked for: wait (bounded) for acknowledgements,
    /// then confirm what they cover.
    pub(super) async fn drain(&mut self, stream: &mut OutboxStream, s: &mut Session) {
        let deadline = Instant::now() + self.config.shutdown.drain_timeout.0;
        s.draining = true;
        self.finish_kafka_transaction(stream, s, deadline).await;
        while !s.deliveries.is_empty() || !s.dead_letters.is_empty() {
            if let Err(e) = self.flush_dead_letters(stream, s).await {
                tracing::error!(error = %e, "dead letter failed during shutdown; the row will be handled again after restart");
                break;
            }
            let (received, flushed, every) = s.beat();
            let next = stream.keep_alive_while(received, flushed, every, async {
                tokio::time::timeout_at(deadline, s.deliveries.next()).await
            });
            let next = match next.await {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(error = %e, "the replication connection failed during shutdown; unacknowledged events will be re-sent after restart");
                    break;
                }
            };
            match next {
                Ok(Some(done)) => {
                    if let Err(e) = s.delivered(&self.metrics, done) {
                        tracing::error!(error = %e, "delivery failed during shutdown; the event will be re-sent after restart");
                        break;
                    }
                }
                Ok(None) => {}
                Err(_) => {
                    tracing::warn!(
                        unacknowledged = s.tracker.inflight(),
                        "drain timeout: these events will be re-sent after restart"
                    );
                    break;
                }
            }
        }
        // The guard proves WAL one round behind: give it the moment it
        // needs to cover what was acknowledged, so a clean stop replays
        // nothing.
        let proof_deadline = deadline.min(Instant::now() + 4 * publication::GUARD_INTERVAL);
        while s.confirmable() < s.tracker.flushed() && matches!(*s.guard.borrow(), GuardState::Verified(_)) {
            // Stop waiting at the deadline, or when the guard has ended.
            if !matches!(
                tokio::time::timeout_at(proof_deadline, s.guard.changed()).await,
                Ok(Ok(()))
            ) {
                break;
            }
        }
        if let Err(e) = s.send_status(stream, false).await {
            tracing::warn!(error = %e, "could not send the final status update");
        }
        self.report(stream, s);
        let confirmed = s.confirmable();
        let last_commit = s
            .tracker
            .last_commit()
            .filter(|_| confirmed == s.tracker.flushed());
        if let Some(register) = &mut s.register {
            let end = deadline.max(Instant::now() + self.config.kafka.admin_timeout.0);
            register.final_write(confirmed, last_commit, end).await;
        }
        tracing::info!(confirmed = %s.confirmable(), "stopped streaming");
    }
}
