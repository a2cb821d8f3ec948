//! One replication session's state: what is in flight, what is
//! confirmable, and what to do with each delivery report.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use tokio::sync::watch;
use tokio::time::Instant;

use super::deliveries::Deliveries;
use super::durability::Durability;
use super::RelayError;
use crate::config::{KafkaConfig, OnPoison};
use crate::kafka::records::{
    dead_letter_for_record, dead_letter_for_row, dead_letter_for_unreadable, dead_letter_stub, KafkaRecord,
    Poison,
};
use crate::kafka::sink::{KafkaSinkError, Refusal, Report};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::postgres::error::PgError;
use crate::postgres::publication::GuardState;
use crate::relay::exactly_once::{Refused, RowPos};
use crate::relay::progress::{AckTracker, LastCommit, TxnId};
use crate::relay::slot_register::{self, SlotRecord};
use crate::source::outbox::{OutboxRow, UnreadableRow};
use crate::source::stream::OutboxStream;

/// A delivery report, tagged with its record's transaction, LSN,
/// position and kind.
pub(super) type Delivery = (TxnId, Lsn, RowPos, Sent, Report);

/// What a record in flight was sent as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sent {
    Event,
    /// The progress record of an exactly-once Kafka transaction.
    Progress,
    /// A dead letter, with its reason for the metric; `stub` once Kafka
    /// refused the full dead letter and only its stub is left to send.
    DeadLetter {
        reason: &'static str,
        stub: bool,
    },
}

/// A dead letter waiting to be sent.
#[derive(Debug)]
pub(super) struct DeadLetterJob {
    pub(super) txn: TxnId,
    pub(super) lsn: Lsn,
    pub(super) pos: RowPos,
    pub(super) record: KafkaRecord,
    /// The event is already counted in the tracker (its first send failed).
    pub(super) counted: bool,
    pub(super) reason: &'static str,
    /// This is the stub of a dead letter Kafka refused.
    pub(super) stub: bool,
}

/// A refusal inside a Kafka transaction: the session ends, and the replay
/// sets the record aside (its dead letter, or the stub of that).
fn refused_in_transaction(
    lsn: Lsn,
    pos: RowPos,
    reason: &'static str,
    e: &rdkafka::error::KafkaError,
    topic: String,
    omit_payload: bool,
    stub: bool,
) -> RelayError {
    RelayError::RefusedInTransaction {
        lsn,
        pos,
        refused: Refused::new(reason, e, topic, omit_payload, stub),
    }
}

/// A record-level refusal heard inside a Kafka transaction.
#[derive(Debug)]
pub(super) struct HeardRefusal {
    lsn: Lsn,
    pub(super) pos: RowPos,
    refused: Refused,
    source: rdkafka::error::KafkaError,
}

/// The record a broker refused, or a purge gave back unsent, rebuilt from
/// what librdkafka handed back. The partition librdkafka assigned is kept:
/// a record sent again after a purge must go where a `partition`
/// placement sent it (and where the partitioner put it when it was sent),
/// or it would land beside its aggregate's later events in another
/// partition. A record still waiting for its topic's metadata has none
/// (librdkafka's unassigned partition): the partitioner picks again, as
/// it would have.
pub(super) fn record_from_message(msg: &rdkafka::message::OwnedMessage) -> KafkaRecord {
    use rdkafka::message::{Headers, Message};
    KafkaRecord {
        topic: msg.topic().to_owned(),
        key: msg.key().unwrap_or_default().to_vec(),
        value: msg.payload().map(<[u8]>::to_vec),
        headers: msg
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned().into(), h.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default(),
        timestamp_ms: msg.timestamp().to_millis().unwrap_or(0),
        partition: Some(msg.partition()).filter(|p| *p >= 0),
    }
}

/// Per-session state of the streaming loop.
pub(super) struct Session {
    pub(super) tracker: AckTracker,
    pub(super) received: Lsn,
    pub(super) open: Option<TxnId>,
    /// The publication guard: nothing past its verified LSN is confirmed.
    pub(super) guard: watch::Receiver<GuardState>,
    /// The open transaction's commit time, in ms since the Unix epoch.
    pub(super) open_commit_ms: i64,
    /// This session's producer sends one record per batch (see
    /// [`Relay::isolate_until`]); once the slot passes the refused record,
    /// intake pauses until nothing is in flight, then batching resumes.
    pub(super) isolating: bool,
    /// This session sends on a producer of its own because a delivery
    /// failed on the shared one (see [`Relay::alone_until`]); once the
    /// slot passes what failed, it goes back to the shared producer.
    pub(super) own_producer: bool,
    pub(super) deliveries: Deliveries,
    /// Dead letters to send after the current step.
    pub(super) dead_letters: std::collections::VecDeque<DeadLetterJob>,
    pub(super) on_poison: OnPoison,
    pub(super) dead_letter_topic: String,
    /// The flush position last reported to PostgreSQL, and when.
    pub(super) reported_flush: Lsn,
    pub(super) last_status: Instant,
    /// How often status updates go out, also while a step waits.
    pub(super) status_every: Duration,
    /// Acknowledged events and retired transactions not yet added to the counters.
    pub(super) acked: u64,
    pub(super) retired: u64,
    pub(super) last_ack: Option<std::time::Instant>,
    /// How sent records become durable (the delivery mode).
    pub(super) durability: Durability,
    /// The open PostgreSQL transaction is in Kafka already (exactly-once,
    /// at or below the progress record): its rows are not sent again.
    pub(super) skipping: bool,
    /// PostgreSQL transactions skipped so, not yet added to the counter.
    pub(super) skipped: u64,
    /// Refreshes the slot register's record (`None`: not kept).
    pub(super) register: Option<RegisterRefresh>,
    /// Where the session began: the slot's confirmed LSN.
    pub(super) start: Lsn,
    /// A transaction the stream must meet before anything past `start` is
    /// confirmed (see `resume`).
    pub(super) waypoint: Option<super::resume::Waypoint>,
    /// Exactly-once: the first failed delivery of the open Kafka
    /// transaction that is not a refusal of its own, and when it came. The
    /// session reads nothing more, hears the remaining reports out (a
    /// refused record among them is the cause to name, and set aside), and
    /// then ends with it; at most [`HEAR_OUT`] after it came.
    pub(super) pending_failure: Option<(Instant, RelayError)>,
    /// Exactly-once: the records Kafka refused, while the reports are heard
    /// out, that were sent in batches: all of one refused batch. One alone
    /// is the cause; several are sent on their own by the next session
    /// (see [`Session::heard_out`]).
    pub(super) refusals: Vec<HeardRefusal>,
    /// Exactly-once: a record that shared a refused batch, sent on its own
    /// and awaiting its report: a refusal now is its own.
    pub(super) alone: Option<RowPos>,
    /// The open transaction's commit LSN (its Begin's final LSN), and its
    /// outbox rows and messages so far: the index of the next one in its
    /// [`RowPos`].
    pub(super) open_commit: Lsn,
    pub(super) row_index: u32,
    /// `routing.on_poison = "park"`: poison events to park after the
    /// current step, before any later event is published (see
    /// [`super::parking`]).
    pub(super) to_park: std::collections::VecDeque<super::parking::ParkJob>,
    /// Parking while isolating: the one row in flight, parked if Kafka
    /// refuses its record.
    pub(super) isolated_row: Option<(RowPos, OutboxRow)>,
    /// Shutdown's drain is under way: records the shared producer purged
    /// are not sent again (the slot keeps them for the next start).
    pub(super) draining: bool,
}

/// Keeps the slot register's record (see [`crate::relay::slot_register`]) near the
/// confirmed LSN: written at the session's first status tick, then at most
/// every [`slot_register::REFRESH`] while the LSN moves, in a task of its
/// own so that Kafka's answer never holds up streaming. A failed write is
/// logged and counted (`outboxd_publish_errors_total{reason="slot_register"}`)
/// and tried again at a later tick.
pub(super) struct RegisterRefresh {
    kafka: KafkaConfig,
    record: SlotRecord,
    metrics: Arc<Metrics>,
    /// The LSN and time of the last write (`None`: not written yet).
    written: Option<(Lsn, Instant)>,
    /// The latest transaction known to lie at or before the confirmed LSN.
    last_commit: Option<LastCommit>,
    pending: Option<tokio::task::JoinHandle<bool>>,
}

impl RegisterRefresh {
    /// `record` names the slot and the publication's fingerprint;
    /// `previous`, the record found at the session's start, lends its last
    /// commit until this session confirms one of its own, so the recovery
    /// command of a lost slot never loses its start time to a restart.
    pub(super) fn new(
        kafka: KafkaConfig,
        record: SlotRecord,
        previous: Option<&SlotRecord>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let last_commit = previous
            .filter(|p| p.system_id == record.system_id && p.timeline == record.timeline)
            .and_then(SlotRecord::last_commit);
        RegisterRefresh {
            kafka,
            record,
            metrics,
            written: None,
            last_commit,
            pending: None,
        }
    }

    /// The record for the confirmed LSN, with the last commit known.
    fn record_at(&self, confirmed: Lsn) -> SlotRecord {
        SlotRecord::new(
            &self.record.slot,
            &self.record.database,
            &self.record.system_id,
            self.record.timeline,
            confirmed,
        )
        .with_last_commit(self.last_commit)
        .with_publication(self.record.publication.clone())
        .with_messages(self.record.messages.clone())
    }

    /// Before the first streaming of a slot the register does not know
    /// (a new slot, or one of another timeline): records it at `start`
    /// now, not at the first status tick, so that a slot lost in between
    /// is refused rather than recreated. A failure is logged and counted,
    /// as at a tick, and the next tick writes again.
    pub(super) async fn first_write(&mut self, start: Lsn) {
        let record = self.record_at(start);
        match slot_register::write(&self.kafka, &record, self.kafka.admin_timeout.0).await {
            Ok(()) => self.written = Some((start, Instant::now())),
            Err(e) => {
                self.metrics.error("slot_register");
                tracing::warn!(
                    topic = self.kafka.progress_topic(),
                    error = %e,
                    "cannot write the slot register before streaming: a lost slot cannot be detected until this works (grant write on the topic, or set kafka.slot_register = false); trying again at the next status tick"
                );
            }
        }
    }

    /// At a clean stop: records the final confirmed position (waiting for
    /// a write in flight first), so that a slot lost while outboxd is down
    /// is recovered from exactly where it stopped. Bounded by `deadline`.
    pub(super) async fn final_write(
        &mut self,
        confirmed: Lsn,
        last_commit: Option<LastCommit>,
        deadline: tokio::time::Instant,
    ) {
        if let Some(p) = self.pending.take() {
            let _ = tokio::time::timeout_at(deadline, p).await;
        }
        if last_commit.is_some() {
            self.last_commit = last_commit;
        }
        let record = self.record_at(confirmed);
        let write = slot_register::write(&self.kafka, &record, self.kafka.admin_timeout.0);
        match tokio::time::timeout_at(deadline, write).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                self.metrics.error("slot_register");
                tracing::warn!(error = %e, "cannot record the final position in the slot register; it keeps the last one written");
            }
            Err(_) => tracing::warn!("the final slot register write did not finish within shutdown.drain_timeout; it keeps the last one written"),
        }
    }

    /// Called on each status tick with the LSN confirmed to PostgreSQL
    /// and, when known, the commit time of the last transaction at or
    /// before it.
    pub(super) fn tick(&mut self, confirmed: Lsn, last_commit: Option<LastCommit>) {
        if last_commit.is_some() {
            self.last_commit = last_commit;
        }
        if let Some(p) = &self.pending {
            if !p.is_finished() {
                return;
            }
        }
        if let Some(p) = self.pending.take() {
            // A failed write is written again at the next tick.
            if p.now_or_never().and_then(Result::ok) != Some(true) {
                self.written = None;
            }
        }
        if let Some((lsn, at)) = self.written {
            if confirmed <= lsn || at.elapsed() < slot_register::REFRESH {
                return;
            }
        }
        let record = self.record_at(confirmed);
        let (kafka, metrics) = (self.kafka.clone(), self.metrics.clone());
        self.written = Some((confirmed, Instant::now()));
        self.pending = Some(tokio::spawn(async move {
            match slot_register::write(&kafka, &record, kafka.admin_timeout.0).await {
                Ok(()) => true,
                Err(e) => {
                    metrics.error("slot_register");
                    tracing::warn!(
                        topic = kafka.progress_topic(),
                        error = %e,
                        "cannot write the slot register: a lost slot cannot be detected until this works (grant write on the topic, or set kafka.slot_register = false); trying again"
                    );
                    false
                }
            }
        }));
    }
}

/// Microseconds since the Unix epoch.
pub(super) fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// How long a session with a failed delivery in its Kafka transaction
/// waits for the transaction's other reports before it ends.
pub(super) const HEAR_OUT: Duration = Duration::from_secs(10);

/// Shortest gap between status updates sent because the flush position moved.
pub(super) const EAGER_CONFIRM: Duration = Duration::from_millis(100);

impl Session {
    /// What may be confirmed: acknowledged (the tracker) and proven to
    /// have reached outboxd if it was an outbox row (the guard).
    pub(super) fn confirmable(&self) -> Lsn {
        let proven = self.tracker.flushed().min(self.guard.borrow().verified());
        // Behind a waypoint not yet met, the history is not yet shown to
        // be the one streamed: nothing past the start is confirmed.
        if self.waypoint.is_some() {
            return proven.min(self.start);
        }
        proven
    }

    /// The place of the open transaction's next row.
    pub(super) fn next_pos(&mut self) -> RowPos {
        let pos = RowPos {
            commit_lsn: self.open_commit,
            index: self.row_index,
        };
        self.row_index += 1;
        pos
    }

    /// What a status update sent during a wait reports, and how often.
    pub(super) fn beat(&self) -> (Lsn, Lsn, Duration) {
        (self.received, self.confirmable(), self.status_every)
    }

    /// Reports write = received and flush = apply = the confirmable LSN.
    pub(super) async fn send_status(
        &mut self,
        stream: &mut OutboxStream,
        reply_requested: bool,
    ) -> Result<(), PgError> {
        let flushed = self.confirmable();
        stream
            .send_status(self.received, flushed, reply_requested)
            .await?;
        self.reported_flush = flushed;
        self.last_status = Instant::now();
        Ok(())
    }

    /// Applies an acknowledgement, and times every transaction it retires.
    /// Applies an acknowledgement, and times every transaction it retires.
    /// A record the broker refuses for good becomes a dead letter (or
    /// stops the relay, per `routing.on_poison`).
    pub(super) fn delivered(
        &mut self,
        metrics: &Metrics,
        (txn, lsn, pos, sent, result): Delivery,
    ) -> Result<(), RelayError> {
        let (e, msg) = match result {
            Report::Stored { .. } => {
                if let Sent::DeadLetter { reason, .. } = sent {
                    metrics.dead_letters.with_label_values(&[reason]).inc();
                }
                if self.last_ack.is_none() {
                    tracing::debug!(%lsn, "first acknowledgement of the session");
                }
                self.last_ack = Some(std::time::Instant::now());
                if sent == Sent::Progress {
                    return Ok(());
                }
                self.acked += self.durability.acked(&mut self.tracker, txn);
                self.observe_retired(metrics);
                return Ok(());
            }
            Report::Failed(e, msg) => (e, msg),
            Report::Unproven { partition } => return Err(KafkaSinkError::NotStored { partition }.into()),
            Report::Canceled => return Err(KafkaSinkError::Canceled.into()),
        };
        let topic = rdkafka::message::Message::topic(&msg).to_owned();
        let in_transaction = !matches!(self.durability, Durability::AtLeastOnce);
        match (sent, Refusal::of(&e)) {
            // Inside a Kafka transaction, one record Kafka refuses makes
            // librdkafka purge the transaction's queued records, whose
            // reports may come first: hear the rest of the transaction's
            // reports out before naming the cause (see `pending_failure`).
            (_, Refusal::Transient) | (Sent::Progress, _) if in_transaction => {
                self.pending_failure.get_or_insert((
                    Instant::now(),
                    KafkaSinkError::Delivery { topic, source: e }.into(),
                ));
                Ok(())
            }
            (_, Refusal::Transient) | (Sent::Progress, _) => {
                Err(KafkaSinkError::Delivery { topic, source: e }.into())
            }
            (_, Refusal::Denied) => Err(RelayError::KafkaDenied { topic, source: e }),
            (Sent::DeadLetter { stub: true, .. }, Refusal::Record { .. }) => {
                Err(RelayError::DeadLetterFailed(e.to_string()))
            }
            // Inside a Kafka transaction a refusal dooms the whole
            // transaction: it is aborted, and the replay sets the record
            // aside (see `exactly_once::Refused`).
            (Sent::DeadLetter { reason, .. }, Refusal::Record { .. }) if in_transaction => {
                Err(refused_in_transaction(lsn, pos, reason, &e, topic, false, true))
            }
            (Sent::Event, Refusal::Record { reason, omit_payload })
                if in_transaction && (self.isolating || self.alone == Some(pos)) =>
            {
                Err(refused_in_transaction(
                    lsn,
                    pos,
                    reason,
                    &e,
                    topic,
                    omit_payload,
                    false,
                ))
            }
            // Even the dead letter is too much for Kafka (a huge key or
            // headers): send its stub, which names the row and the reason.
            (Sent::DeadLetter { reason, stub: false }, Refusal::Record { .. }) => {
                tracing::warn!(%lsn, error = %e, "Kafka refused a dead letter; sending its stub (id, reason, sizes) instead");
                self.dead_letters.push_back(DeadLetterJob {
                    txn,
                    lsn,
                    pos,
                    record: dead_letter_stub(&record_from_message(&msg), &e.to_string()),
                    counted: true,
                    reason,
                    stub: true,
                });
                Ok(())
            }
            // Kafka refuses whole batches: the record may only have shared
            // one with the record Kafka refuses. Inside a Kafka transaction,
            // every record of the refused batch reports the refusal: hear
            // them all, so that the next session sends only those on their
            // own (see `heard_out`).
            (Sent::Event, Refusal::Record { reason, omit_payload }) if in_transaction => {
                let since = self
                    .pending_failure
                    .as_ref()
                    .map_or_else(Instant::now, |(t, _)| *t);
                self.pending_failure = Some((
                    since,
                    RelayError::BatchRefused {
                        lsn,
                        topic: topic.clone(),
                        source: e.clone(),
                    },
                ));
                self.refusals.push(HeardRefusal {
                    lsn,
                    pos,
                    refused: Refused::new(reason, &e, topic, omit_payload, false),
                    source: e,
                });
                Ok(())
            }
            // At-least-once: find out, one per batch.
            (Sent::Event, Refusal::Record { .. }) if !self.isolating => Err(RelayError::BatchRefused {
                lsn,
                topic,
                source: e,
            }),
            (Sent::Event, Refusal::Record { reason, omit_payload }) => {
                let record = record_from_message(&msg);
                if self.on_poison == OnPoison::Park {
                    let id = record.header_text(crate::kafka::records::header::ID);
                    let error = format!("Kafka refused it for topic {topic:?}: {e}");
                    let Some((_, row)) = self.isolated_row.take().filter(|(p, _)| *p == pos) else {
                        return Err(RelayError::Poison { id, lsn, error });
                    };
                    tracing::warn!(%lsn, %id, error = %e, "Kafka refused a record for good; parking it");
                    self.queue_park(
                        super::parking::ParkJob {
                            txn,
                            pos,
                            row: crate::park::ParkedRow::Row(row),
                            reason,
                            error,
                        },
                        true,
                    );
                    return Ok(());
                }
                if self.on_poison == OnPoison::Stop {
                    let id = record.header_text(crate::kafka::records::header::ID);
                    return Err(RelayError::Poison {
                        id,
                        lsn,
                        error: format!("Kafka refused it for topic {topic:?}: {e}"),
                    });
                }
                let poison = Poison {
                    reason,
                    error: e.to_string(),
                    lsn,
                    intended_topic: Some(topic),
                    omit_payload,
                };
                tracing::warn!(%lsn, error = %e, "Kafka refused a record for good; sending it to the dead-letter topic");
                let record = dead_letter_for_record(record, &poison, &self.dead_letter_topic);
                self.dead_letters.push_back(DeadLetterJob {
                    txn,
                    lsn,
                    pos,
                    record,
                    counted: true,
                    reason,
                    stub: false,
                });
                Ok(())
            }
        }
    }

    /// The failure a session that heard its Kafka transaction's reports
    /// out ends with. One record refused in batches, with every report
    /// heard, was alone in its batch: the refusal is its own, and the
    /// replay sets it aside. Several shared the refused batch: the next
    /// session sends each of them on its own, and the rest in batches.
    pub(super) fn heard_out(&mut self, pending: RelayError) -> RelayError {
        let all_heard = self.deliveries.is_empty();
        match self.refusals.len() {
            0 => pending,
            1 if all_heard => {
                let HeardRefusal {
                    lsn, pos, refused, ..
                } = self.refusals.remove(0);
                RelayError::RefusedInTransaction { lsn, pos, refused }
            }
            // The session's end takes `refusals` as the records to send
            // on their own.
            _ => {
                let first = &self.refusals[0];
                RelayError::BatchRefused {
                    lsn: first.lsn,
                    topic: first.refused.topic.clone(),
                    source: first.source.clone(),
                }
            }
        }
    }

    /// A row that cannot be read as an event: parked (under `park`, or
    /// `behind` a parked sequence of its aggregate), a dead letter, or a
    /// stop.
    pub(super) fn unreadable_row(
        &mut self,
        txn: TxnId,
        row: &UnreadableRow,
        lsn: Lsn,
        pos: RowPos,
        behind: bool,
    ) -> Result<(), RelayError> {
        if self.on_poison == OnPoison::Stop && !behind {
            return Err(RelayError::Poison {
                id: row.id.clone(),
                lsn,
                error: row.error.to_string(),
            });
        }
        if self.on_poison == OnPoison::Park || behind {
            tracing::warn!(id = %row.id, %lsn, error = %row.error, "outbox row cannot be read as an event; parking it");
            let job = super::parking::ParkJob {
                txn,
                pos,
                row: super::parking::unreadable(row),
                reason: "unreadable",
                error: row.error.to_string(),
            };
            self.queue_park(job, false);
            return Ok(());
        }
        let poison = Poison {
            reason: "unreadable",
            error: row.error.to_string(),
            lsn,
            intended_topic: None,
            omit_payload: false,
        };
        tracing::warn!(id = %row.id, %lsn, error = %row.error,
            "outbox row cannot be read as an event; sending it to the dead-letter topic");
        self.dead_letters.push_back(DeadLetterJob {
            txn,
            lsn,
            pos,
            record: dead_letter_for_unreadable(row, &poison, &self.dead_letter_topic),
            counted: false,
            reason: poison.reason,
            stub: false,
        });
        Ok(())
    }

    /// A row that can never be published: a dead letter, or a stop.
    pub(super) fn poison_row(
        &mut self,
        txn: TxnId,
        row: &OutboxRow,
        pos: RowPos,
        poison: Poison,
    ) -> Result<(), RelayError> {
        if self.on_poison == OnPoison::Stop {
            return Err(RelayError::Poison {
                id: row.id.to_string(),
                lsn: poison.lsn,
                error: poison.error,
            });
        }
        if self.on_poison == OnPoison::Park {
            tracing::warn!(id = %row.id, lsn = %poison.lsn, reason = poison.reason, error = %poison.error,
                "outbox row cannot be published; parking it");
            let job = super::parking::ParkJob {
                txn,
                pos,
                row: crate::park::ParkedRow::Row(row.clone()),
                reason: poison.reason,
                error: poison.error,
            };
            self.queue_park(job, false);
            return Ok(());
        }
        tracing::warn!(id = %row.id, lsn = %poison.lsn, reason = poison.reason, error = %poison.error,
            "outbox row can never be published; sending it to the dead-letter topic");
        let record = dead_letter_for_row(row, &poison, &self.dead_letter_topic);
        self.dead_letters.push_back(DeadLetterJob {
            txn,
            lsn: poison.lsn,
            pos,
            record,
            counted: false,
            reason: poison.reason,
            stub: false,
        });
        Ok(())
    }

    pub(super) fn observe_retired(&mut self, metrics: &Metrics) {
        let mut now = None;
        for (commit_time, had_events) in self.tracker.drain_retired() {
            self.retired += 1;
            if had_events {
                let now = *now.get_or_insert_with(now_micros);
                metrics
                    .commit_to_ack_seconds
                    .observe(now.saturating_sub(commit_time).max(0) as f64 / 1e6);
            }
        }
    }
}
