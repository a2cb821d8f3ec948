//! The relay: replication stream in, Kafka records out, LSNs confirmed
//! only behind Kafka's acknowledgements.
//!
//! # One session
//!
//! A session connects, makes sure the publication and slot exist, and
//! starts replication at `0/0`, which the server reads as "from the slot's
//! `confirmed_flush_lsn`". Then one `tokio::select!` loop runs, with these
//! priorities (`biased`):
//!
//! 1. **shutdown**: stop reading, drain acknowledgements, confirm, exit;
//! 2. **acknowledgements**: each finished delivery future is applied to the
//!    [`AckTracker`]; a failed delivery ends the session (see below);
//! 3. **status timer**: every `postgres.status_interval` a standby status
//!    update reports write = received LSN, flush = apply = the tracker's
//!    flushed LSN, even when the stream is busy; when idle it asks the
//!    server to answer with a keepalive. Between ticks, a status update also
//!    goes out (at most every 100 ms) as soon as acknowledgements move the
//!    flushed LSN, so confirmation lags Kafka by milliseconds, not seconds;
//! 4. **the next stream event**, read only while fewer than
//!    `kafka.max_inflight` events are unacknowledged (backpressure: memory
//!    stays bounded with any backlog):
//!    * Begin opens a transaction in the tracker;
//!    * each outbox Insert becomes a record and is enqueued at once
//!      (`send_result`, no waiting); a full librdkafka queue waits for an
//!      acknowledgement first, and a new topic for its creation. Such waits
//!      go through [`OutboxStream::keep_alive_while`], which keeps sending
//!      status updates, so no wait inside a step outlasts the server's
//!      `wal_sender_timeout` (the status interval is at most a third of it);
//!    * Commit records the transaction's end LSN, which becomes confirmable
//!      when it and all earlier transactions are acknowledged;
//!    * a keepalive's WAL end is confirmable when nothing is open or in
//!      flight; a keepalive that asks for a reply gets a status update now.
//!
//! # Failures
//!
//! A failed delivery is never skipped. The session ends; the producer is
//! replaced (dropping it purges what it still queued, so none of that lands
//! after a replayed record); the next session resumes from the slot's
//! confirmed LSN, which never passed the failed event. Duplicates are possible (bounded by what was in
//! flight), loss is not. Errors that a retry can fix (network, broker down,
//! server restart, slot busy) restart the session with exponential backoff;
//! the others (bad rows, missing topics that may not be created, bad
//! settings) stop outboxd with a message saying what to do.
//!
//! # Rows Kafka refuses
//!
//! A row that can never become a record (see `routing`) or cannot be read
//! (`Unreadable`) follows `routing.on_poison` at once: a dead letter in the
//! same transaction's place, or a stop naming the row. A record the broker
//! refuses is different: Kafka refuses whole batches (a batch larger than
//! the topic's `max.message.bytes`, one bad timestamp), so the refused
//! record may be innocent. The session then ends with `BatchRefused`, and
//! the sessions after it send one record per batch until the slot has
//! passed everything the failed session had read (`isolate_until`). In that
//! mode a refusal is the record's own, and only that record follows
//! `on_poison`. Once past, intake pauses until nothing is in flight and a
//! new batching producer takes over, so nothing queued is purged.
//! Authorization errors are never the record's fault: outboxd stops and
//! names the grant to add.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use crate::config::{Config, OnPoison, Validated};
use crate::health::Health;
use crate::kafka::{BrokerProbe, KafkaSink, KafkaSinkError, Refusal, SendOutcome};
use crate::leader::LeaderElection;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{OutboxRow, UnreadableRow};
use crate::pg::admin::{self, AdminError, SlotState};
use crate::pg::connection::{ReplicationConnection, StartOptions};
use crate::pg::error::PgError;
use crate::pg::outbox_stream::{OutboxStream, StreamError, StreamEvent};
use crate::pg::publication::{self, GuardState};
use crate::progress::{AckTracker, TxnId};
use crate::routing::{
    build_record, dead_letter_for_record, dead_letter_for_row, dead_letter_for_unreadable, dead_letter_stub,
    KafkaRecord, Poison,
};

/// Why the relay stopped or a session ended.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error(transparent)]
    Pg(#[from] PgError),
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    #[error("outbox row {id} at {lsn} can never be published: {error}; the slot has not moved past it. Fix the writer and restart after removing the cause, or set routing.on_poison = \"dead-letter\"")]
    Poison { id: String, lsn: Lsn, error: String },
    #[error("Kafka refused the batch holding the record at {lsn} for topic {topic:?}: {source}; re-sending the records from there one per batch, to set aside only the record Kafka refuses")]
    BatchRefused {
        lsn: Lsn,
        topic: String,
        source: rdkafka::error::KafkaError,
    },
    #[error("Kafka denied outboxd access to topic {topic:?}: {source}; grant the principal outboxd uses WRITE and DESCRIBE on the topic (and CREATE if kafka.create_topics is true), then restart. No event was set aside and the slot has not moved past it")]
    KafkaDenied {
        topic: String,
        source: rdkafka::error::KafkaError,
    },
    #[error("the dead-letter topic failed, so a poison row cannot be set aside: {0}; outboxd stops rather than skip it")]
    DeadLetterFailed(String),
    #[error("{reason}. The publication changed while outboxd streamed, so outbox rows committed after WAL {verified} may never have been sent; outboxd has not confirmed past {verified}. Fix the publication, then re-publish the outbox rows committed since then (consumers deduplicate by id) before you restart: a restart streams that WAL with the publication as it was, and would skip such rows again")]
    PublicationChanged { verified: Lsn, reason: String },
    #[error("cannot read the publication's state to prove delivery: {0}")]
    GuardFailed(String),
    #[error("the server ended the replication stream")]
    StreamEnded,
    #[error("replication protocol out of order: {0}")]
    OutOfOrder(&'static str),
    #[error("replication slot {0} was invalidated: PostgreSQL removed WAL it still needed (max_slot_wal_keep_size was exceeded), so events committed after its confirmed LSN can no longer be streamed. Recovery: stop outboxd; run SELECT pg_drop_replication_slot('{0}'); start outboxd (it creates a new slot at the current WAL position); then re-publish the gap from the outbox table, e.g. by re-inserting rows created after the last event your consumers saw (consumers deduplicate by id). See the README, \"Reliability\"")]
    SlotInvalidated(String),
    #[error(
        "lost the leader lock (its PostgreSQL session ended); stopping so that only one outboxd streams"
    )]
    LeadershipLost,
}

impl RelayError {
    /// A short, bounded label for `outboxd_publish_errors_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            RelayError::Admin(_) | RelayError::PublicationChanged { .. } | RelayError::SlotInvalidated(_) => {
                "postgres_setup"
            }
            RelayError::Pg(_)
            | RelayError::StreamEnded
            | RelayError::LeadershipLost
            | RelayError::GuardFailed(_) => "postgres_stream",
            RelayError::Stream(_) | RelayError::OutOfOrder(_) => "decode",
            RelayError::Kafka(e) => e.reason(),
            RelayError::Poison { .. } => "poison",
            RelayError::BatchRefused { .. } => "batch_refused",
            RelayError::KafkaDenied { .. } => "denied",
            RelayError::DeadLetterFailed(_) => "dead_letter",
        }
    }

    /// Whether a new session (after a backoff) may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            RelayError::Admin(AdminError::Connect { .. } | AdminError::Query(_)) => true,
            RelayError::Admin(AdminError::Replication(e)) | RelayError::Pg(e) => e.is_transient(),
            RelayError::Admin(_) => false,
            RelayError::Stream(e) => e.is_transient(),
            RelayError::Kafka(e) => e.is_transient(),
            RelayError::StreamEnded
            | RelayError::OutOfOrder(_)
            | RelayError::LeadershipLost
            | RelayError::BatchRefused { .. }
            | RelayError::GuardFailed(_) => true,
            RelayError::KafkaDenied { .. }
            | RelayError::Poison { .. }
            | RelayError::DeadLetterFailed(_)
            | RelayError::PublicationChanged { .. }
            | RelayError::SlotInvalidated(_) => false,
        }
    }
}

/// What a delivery future resolves to, tagged with its transaction.
type Delivery = (
    TxnId,
    Lsn,
    Sent,
    Result<rdkafka::producer::future_producer::OwnedDeliveryResult, futures::channel::oneshot::Canceled>,
);

/// What a delivery future was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sent {
    Event,
    /// A dead letter, with its reason for the metric; `stub` once Kafka
    /// refused the full dead letter and only its stub is left to send.
    DeadLetter {
        reason: &'static str,
        stub: bool,
    },
}

/// A dead letter waiting to be sent.
#[derive(Debug)]
struct DeadLetterJob {
    txn: TxnId,
    lsn: Lsn,
    record: KafkaRecord,
    /// The event is already counted in the tracker (its first send failed).
    counted: bool,
    reason: &'static str,
    /// This is the stub of a dead letter Kafka refused.
    stub: bool,
}

/// The record a broker refused, rebuilt from what librdkafka handed back.
fn record_from_message(msg: &rdkafka::message::OwnedMessage) -> KafkaRecord {
    use rdkafka::message::{Headers, Message};
    KafkaRecord {
        topic: msg.topic().to_owned(),
        key: String::from_utf8_lossy(msg.key().unwrap_or_default()).into_owned(),
        value: msg.payload().unwrap_or_default().to_vec(),
        headers: msg
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default(),
        timestamp_ms: msg.timestamp().to_millis().unwrap_or(0),
    }
}

/// The relay's shared state across sessions.
pub struct Relay {
    config: Config,
    validated: Validated,
    sink: KafkaSink,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    election: LeaderElection,
    /// Set after Kafka refused a batch: the insert LSN of the refused
    /// record. Until the slot passes it, sessions send one record per batch.
    isolate_until: Option<Lsn>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("slot", &self.validated.slot)
            .finish()
    }
}

/// Exponential backoff with a cap and ±25% jitter.
#[derive(Debug)]
struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new(max: Duration) -> Self {
        Backoff {
            next: Duration::from_millis(500),
            max,
        }
    }

    fn step(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let jitter = f64::from(nanos % 500) / 1000.0 - 0.25; // -0.25 ..= 0.25
        base.mul_f64(1.0 + jitter).min(self.max)
    }

    fn reset(&mut self) {
        self.next = Duration::from_millis(500);
    }
}

/// How a session ended without error.
enum SessionEnd {
    Shutdown,
}

/// Per-session state of the streaming loop.
struct Session {
    tracker: AckTracker,
    received: Lsn,
    open: Option<TxnId>,
    /// The publication guard: nothing past its verified LSN is confirmed.
    guard: watch::Receiver<GuardState>,
    /// The open transaction's commit time, in ms since the Unix epoch.
    open_commit_ms: i64,
    /// This session's producer sends one record per batch (see
    /// [`Relay::isolate_until`]); once the slot passes the refused record,
    /// intake pauses until nothing is in flight, then batching resumes.
    isolating: bool,
    deliveries: FuturesUnordered<futures::future::BoxFuture<'static, Delivery>>,
    /// Dead letters to send after the current step.
    dead_letters: std::collections::VecDeque<DeadLetterJob>,
    on_poison: OnPoison,
    dead_letter_topic: String,
    /// The flush position last reported to PostgreSQL, and when.
    reported_flush: Lsn,
    last_status: Instant,
    /// How often status updates go out, also while a step waits.
    status_every: Duration,
    /// Acknowledged events and retired transactions not yet added to the counters.
    acked: u64,
    retired: u64,
    last_ack: Option<std::time::Instant>,
}

/// Microseconds since the Unix epoch.
fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// A session's replication stream, where it starts, its publication
/// guard, and how often it must report.
struct Connected {
    stream: OutboxStream,
    start: Lsn,
    guard: watch::Receiver<GuardState>,
    status_every: Duration,
}

/// What a session proves on its connection before streaming.
struct Proven {
    /// The server's `wal_sender_timeout`, if any.
    server_timeout: Option<Duration>,
    /// The publication delivers every INSERT on the table.
    verified: publication::Verified,
}

/// Reads `wal_sender_timeout` and proves (creating it first, if allowed and
/// missing) the publication, on the session's connection.
async fn prove(
    config: &Config,
    v: &Validated,
    client: &tokio_postgres::Client,
) -> Result<Proven, AdminError> {
    let server_timeout = admin::wal_sender_timeout(client).await?;
    let verified = if config.postgres.create_publication {
        admin::ensure_publication(client, &v.publication, &v.table).await?
    } else {
        publication::inspect(client, &v.publication, &v.table).await?
    };
    Ok(Proven {
        server_timeout,
        verified,
    })
}

/// The status interval: `postgres.status_interval`, but never more than a
/// third of the server's `wal_sender_timeout`, so that two updates can be
/// late before the server gives up on the session.
fn status_every(configured: Duration, wal_sender_timeout: Option<Duration>) -> Duration {
    let Some(server) = wal_sender_timeout else {
        return configured;
    };
    let most = (server / 3).max(Duration::from_millis(10));
    if configured > most {
        tracing::warn!(
            status_interval = ?configured,
            wal_sender_timeout = ?server,
            using = ?most,
            "postgres.status_interval is too long for the server's wal_sender_timeout; sending status updates more often"
        );
        return most;
    }
    configured
}

/// Shortest gap between status updates sent because the flush position moved.
const EAGER_CONFIRM: Duration = Duration::from_millis(100);

impl Session {
    /// What may be confirmed: acknowledged (the tracker) and proven to
    /// have reached outboxd if it was an outbox row (the guard).
    fn confirmable(&self) -> Lsn {
        self.tracker.flushed().min(self.guard.borrow().verified())
    }

    /// What a status update sent during a wait reports, and how often.
    fn beat(&self) -> (Lsn, Lsn, Duration) {
        (self.received, self.confirmable(), self.status_every)
    }

    /// Reports write = received and flush = apply = the confirmable LSN.
    async fn send_status(&mut self, stream: &mut OutboxStream, reply_requested: bool) -> Result<(), PgError> {
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
    fn delivered(&mut self, metrics: &Metrics, (txn, lsn, sent, result): Delivery) -> Result<(), RelayError> {
        let (e, msg) = match result {
            Ok(Ok(_delivery)) => {
                if let Sent::DeadLetter { reason, .. } = sent {
                    metrics.dead_letters.with_label_values(&[reason]).inc();
                }
                if self.last_ack.is_none() {
                    tracing::debug!(%lsn, "first acknowledgement of the session");
                }
                self.tracker.acked(txn);
                self.acked += 1;
                self.last_ack = Some(std::time::Instant::now());
                self.observe_retired(metrics);
                return Ok(());
            }
            Ok(Err(failed)) => failed,
            Err(_) => return Err(KafkaSinkError::Canceled.into()),
        };
        let topic = rdkafka::message::Message::topic(&msg).to_owned();
        match (sent, Refusal::of(&e)) {
            (_, Refusal::Transient) => Err(KafkaSinkError::Delivery { topic, source: e }.into()),
            (_, Refusal::Denied) => Err(RelayError::KafkaDenied { topic, source: e }),
            (Sent::DeadLetter { stub: true, .. }, Refusal::Record { .. }) => {
                Err(RelayError::DeadLetterFailed(e.to_string()))
            }
            // Even the dead letter is too much for Kafka (a huge key or
            // headers): send its stub, which names the row and the reason.
            (Sent::DeadLetter { reason, stub: false }, Refusal::Record { .. }) => {
                tracing::warn!(%lsn, error = %e, "Kafka refused a dead letter; sending its stub (id, reason, sizes) instead");
                self.dead_letters.push_back(DeadLetterJob {
                    txn,
                    lsn,
                    record: dead_letter_stub(&record_from_message(&msg), &e.to_string()),
                    counted: true,
                    reason,
                    stub: true,
                });
                Ok(())
            }
            // Kafka refuses whole batches: the record may only have shared
            // one with the record Kafka refuses. Find out, one per batch.
            (Sent::Event, Refusal::Record { .. }) if !self.isolating => Err(RelayError::BatchRefused {
                lsn,
                topic,
                source: e,
            }),
            (Sent::Event, Refusal::Record { reason, omit_payload }) => {
                let record = record_from_message(&msg);
                if self.on_poison == OnPoison::Stop {
                    let id = record.header_text(crate::routing::header::ID);
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
                    record,
                    counted: true,
                    reason,
                    stub: false,
                });
                Ok(())
            }
        }
    }

    /// A row that cannot be read as an event: a dead letter, or a stop.
    fn unreadable_row(&mut self, txn: TxnId, row: &UnreadableRow, lsn: Lsn) -> Result<(), RelayError> {
        if self.on_poison == OnPoison::Stop {
            return Err(RelayError::Poison {
                id: row.id.clone(),
                lsn,
                error: row.error.to_string(),
            });
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
            record: dead_letter_for_unreadable(row, &poison, &self.dead_letter_topic),
            counted: false,
            reason: poison.reason,
            stub: false,
        });
        Ok(())
    }

    /// A row that can never be published: a dead letter, or a stop.
    fn poison_row(&mut self, txn: TxnId, row: &OutboxRow, poison: Poison) -> Result<(), RelayError> {
        if self.on_poison == OnPoison::Stop {
            return Err(RelayError::Poison {
                id: row.id.to_string(),
                lsn: poison.lsn,
                error: poison.error,
            });
        }
        tracing::warn!(id = %row.id, lsn = %poison.lsn, reason = poison.reason, error = %poison.error,
            "outbox row can never be published; sending it to the dead-letter topic");
        let record = dead_letter_for_row(row, &poison, &self.dead_letter_topic);
        self.dead_letters.push_back(DeadLetterJob {
            txn,
            lsn: poison.lsn,
            record,
            counted: false,
            reason: poison.reason,
            stub: false,
        });
        Ok(())
    }

    fn observe_retired(&mut self, metrics: &Metrics) {
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

impl Relay {
    pub fn new(
        config: Config,
        validated: Validated,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Result<Self, RelayError> {
        let t = Instant::now();
        let sink = KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0)?;
        tracing::debug!(took = ?t.elapsed(), "Kafka clients created");
        let election = LeaderElection::new(validated.pg.clone(), validated.slot.clone());
        Ok(Relay {
            config,
            validated,
            sink,
            metrics,
            health,
            election,
            isolate_until: None,
        })
    }

    /// Runs sessions until shutdown or a definite error.
    pub async fn run(&mut self, shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
        let poller = tokio::spawn(poll_slot_and_brokers(
            self.validated.clone(),
            self.sink.probe(),
            self.config.health.poll_interval.0,
            self.config.health.max_retained_wal_bytes,
            self.metrics.clone(),
            self.health.clone(),
        ));
        let result = self.sessions(shutdown).await;
        poller.abort();
        self.health.set_streaming(None);
        result
    }

    async fn sessions(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
        let mut backoff = Backoff::new(self.config.postgres.reconnect_backoff_max.0);
        loop {
            let mut streamed = false;
            let result = self.session(&mut shutdown, &mut streamed).await;
            self.health.set_streaming(None);
            match result {
                Ok(SessionEnd::Shutdown) => return Ok(()),
                Err(e) if e.is_transient() => {
                    self.metrics.reconnects.inc();
                    self.metrics.error(e.reason());
                    if streamed {
                        backoff.reset();
                    }
                    let wait = backoff.step();
                    tracing::warn!(error = %e, retry_in = ?wait, "replication session ended; reconnecting");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.changed() => return Ok(()),
                    }
                    self.health.beat();
                }
                Err(e) => {
                    self.metrics.error(e.reason());
                    return Err(e);
                }
            }
            if *shutdown.borrow() {
                return Ok(());
            }
        }
    }

    /// Becomes the slot's leader, waiting as a hot standby while another
    /// outboxd leads; `false` when shutdown came first.
    async fn lead(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<bool, RelayError> {
        let mut announced = false;
        loop {
            if self.election.try_lead().await? {
                if announced {
                    tracing::info!(
                        slot = self.validated.slot.as_str(),
                        "the leader is gone; taking over"
                    );
                }
                self.health.set_standby(false);
                return Ok(true);
            }
            if !announced {
                tracing::info!(
                    slot = self.validated.slot.as_str(),
                    "another outboxd leads this slot; waiting as a hot standby"
                );
                announced = true;
            }
            self.health.set_standby(true);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = shutdown.changed() => return Ok(false),
            }
        }
    }

    /// Sets the session up on `client` (the publication proven on it) and
    /// `repl`: the slot, then streaming.
    async fn connect(
        &self,
        client: tokio_postgres::Client,
        proven: Proven,
        mut repl: ReplicationConnection,
    ) -> Result<Connected, RelayError> {
        let v = &self.validated;
        let Proven {
            server_timeout,
            verified,
        } = proven;
        let status_every = status_every(self.config.postgres.status_interval.0, server_timeout);
        let start = match admin::ensure_slot(&client, &mut repl, &v.slot, &v.pg.dbname).await? {
            SlotState::Created { consistent_point } => {
                tracing::info!(slot = v.slot.as_str(), %consistent_point, "created replication slot");
                consistent_point
            }
            SlotState::Existing(info) if info.wal_status.as_deref() == Some("lost") => {
                return Err(RelayError::SlotInvalidated(v.slot.as_str().to_owned()));
            }
            SlotState::Existing(info) => info.confirmed_flush_lsn.unwrap_or(Lsn::ZERO),
        };
        tracing::debug!("slot ready");
        let stream = repl
            .start_replication(&StartOptions {
                slot: v.slot.clone(),
                publication: v.publication.clone(),
                start_lsn: Lsn::ZERO,
                messages: false,
            })
            .await
            .map_err(|e| match e.sqlstate() {
                Some("55006") => {
                    tracing::warn!(
                        slot = v.slot.as_str(),
                        "replication slot is in use by another process: is another outboxd or a pg_recvlogical running? retrying"
                    );
                    RelayError::Pg(e)
                }
                // "can no longer get changes from replication slot": invalidated.
                Some("55000") if e.to_string().contains("can no longer get changes") => {
                    RelayError::SlotInvalidated(v.slot.as_str().to_owned())
                }
                _ => RelayError::Pg(e),
            })?;
        let table_oid = verified.table_oid;
        let guard = publication::spawn_guard(client, v.publication.clone(), v.table.clone(), verified, start);
        Ok(Connected {
            stream: OutboxStream::new(stream, v.table.clone(), table_oid),
            start,
            guard,
            status_every,
        })
    }

    async fn session(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        streamed: &mut bool,
    ) -> Result<SessionEnd, RelayError> {
        // Kafka's metadata, the leader lock, the session's connection with
        // the publication's proof, and the replication connection are asked
        // for at once: each costs a backend start or round trips, and the
        // time to the first event is their sum otherwise.
        self.sink.forget_topics();
        let pg = self.validated.pg.clone();
        let t = Instant::now();
        let proven_on_new_connection = async {
            let client = admin::connect(&pg).await?;
            let proven = prove(&self.config, &self.validated, &client).await;
            Ok::<_, AdminError>((client, proven))
        };
        let (first_try, session, repl) = tokio::join!(
            self.election.try_lead(),
            proven_on_new_connection,
            ReplicationConnection::connect(&pg)
        );
        tracing::debug!(took = ?t.elapsed(), "leader lock, publication proven, replication connection open");
        let (client, proven, repl) = if first_try? {
            self.health.set_standby(false);
            let (client, proven) = session?;
            (client, proven?, repl?)
        } else {
            // Another outboxd leads: wait as a hot standby, without holding
            // a walsender the leader may need, and prove the publication
            // again once leading (it may have changed during the wait).
            drop((session, repl));
            if !self.lead(shutdown).await? {
                return Ok(SessionEnd::Shutdown);
            }
            let client = admin::connect(&pg).await?;
            let (proven, repl) = tokio::join!(
                prove(&self.config, &self.validated, &client),
                ReplicationConnection::connect(&pg)
            );
            (client, proven?, repl?)
        };
        let Connected {
            mut stream,
            start,
            guard,
            status_every,
        } = self.connect(client, proven, repl).await?;
        *streamed = true;
        tracing::info!(
            slot = self.validated.slot.as_str(),
            %start,
            walsender_pid = stream.backend_pid(),
            "streaming"
        );
        self.health.set_streaming(Some(stream.backend_pid()));
        let mut s = Session {
            tracker: AckTracker::new(start),
            received: start,
            open: None,
            guard,
            open_commit_ms: 0,
            isolating: self.isolate_until.is_some(),
            deliveries: FuturesUnordered::new(),
            dead_letters: std::collections::VecDeque::new(),
            on_poison: self.config.routing.on_poison,
            dead_letter_topic: self.config.routing.dead_letter_topic.clone(),
            reported_flush: start,
            last_status: Instant::now(),
            status_every,
            acked: 0,
            retired: 0,
            last_ack: None,
        };
        let result = self.stream_loop(&mut stream, &mut s, shutdown).await;
        match result {
            Ok(()) => {
                self.drain(&mut stream, &mut s).await;
                stream.stop(Duration::from_secs(5)).await?;
                Ok(SessionEnd::Shutdown)
            }
            Err(e) => {
                // Whatever this session read may have shared a batch with
                // the refused record: re-send all of it one per batch.
                if let RelayError::BatchRefused { lsn, .. } = &e {
                    let until = self.isolate_until.unwrap_or(Lsn::ZERO).max(*lsn).max(s.received);
                    self.isolate_until = Some(until);
                }
                // Never let a record queued before the failure land after
                // the replay: drop the producer (which purges its queue)
                // and start the next session with a new one.
                self.sink = self.new_sink()?;
                // Confirm what is safely acknowledged, best effort.
                let _ = s.send_status(&mut stream, false).await;
                Err(e)
            }
        }
    }

    /// A fresh sink: one record per batch while a refusal is being isolated.
    fn new_sink(&self) -> Result<KafkaSink, KafkaSinkError> {
        let (cfg, timeout) = (&self.config.kafka, self.config.kafka.admin_timeout.0);
        match self.isolate_until {
            Some(_) => KafkaSink::one_per_batch(cfg, timeout),
            None => KafkaSink::new(cfg, timeout),
        }
    }

    /// Ends isolation once the slot is past the refused record: intake
    /// waits (`false`) until nothing is in flight, then batching resumes
    /// with a new producer, which purges nothing because nothing is queued.
    fn end_isolation(&mut self, s: &mut Session) -> Result<bool, RelayError> {
        let passed = self.isolate_until.is_none_or(|until| s.tracker.flushed() > until);
        if !s.isolating || !passed {
            return Ok(true);
        }
        if s.tracker.inflight() > 0 || !s.deliveries.is_empty() || !s.dead_letters.is_empty() {
            return Ok(false);
        }
        self.isolate_until = None;
        self.sink = self.new_sink()?;
        s.isolating = false;
        tracing::info!("past the record Kafka refused; sending in batches again");
        Ok(true)
    }

    async fn stream_loop(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut status = tokio::time::interval(s.status_every);
        status.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut leader_check = tokio::time::interval(Duration::from_secs(2));
        leader_check.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let max_inflight = self.config.kafka.max_inflight;
        if *shutdown.borrow_and_update() {
            return Ok(());
        }
        loop {
            let intake = s.tracker.inflight() < max_inflight && self.end_isolation(s)?;
            tokio::select! {
                biased;
                _ = shutdown.changed() => return Ok(()),
                Some(done) = s.deliveries.next(), if !s.deliveries.is_empty() => {
                    s.delivered(&self.metrics, done)?;
                }
                _ = status.tick() => {
                    // When idle, ask for a keepalive: its WAL end lets the
                    // slot follow writes to other tables (rule 5).
                    let idle = s.tracker.is_idle();
                    s.send_status(stream, idle).await?;
                    self.report(stream, s);
                }
                changed = s.guard.changed() => {
                    let state = s.guard.borrow_and_update().clone();
                    match (changed, state) {
                        (Err(_), state) => return Err(RelayError::GuardFailed(format!("the guard ended at {}", state.verified()))),
                        (_, GuardState::Changed { verified, reason }) => {
                            return Err(RelayError::PublicationChanged { verified, reason })
                        }
                        (_, GuardState::Failed { reason, .. }) => return Err(RelayError::GuardFailed(reason)),
                        (_, GuardState::Verified(_)) => {}
                    }
                }
                _ = leader_check.tick() => {
                    let (received, flushed, every) = s.beat();
                    let held = stream
                        .keep_alive_while(received, flushed, every, self.election.still_held())
                        .await?;
                    if !held {
                        return Err(RelayError::LeadershipLost);
                    }
                }
                event = stream.next_event(), if intake => {
                    match event? {
                        Some(ev) => self.handle_event(stream, s, ev).await?,
                        None => return Err(RelayError::StreamEnded),
                    }
                }
            }
            if !s.dead_letters.is_empty() {
                self.flush_dead_letters(stream, s).await?;
            }
            // Confirm soon after acknowledgements move the flush position,
            // not only on the timer, but at most every EAGER_CONFIRM.
            if s.confirmable() > s.reported_flush && s.last_status.elapsed() >= EAGER_CONFIRM {
                s.send_status(stream, false).await?;
            }
        }
    }

    async fn handle_event(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        ev: StreamEvent,
    ) -> Result<(), RelayError> {
        match ev {
            StreamEvent::Begin { commit_time, .. } => {
                if s.open.is_some() {
                    return Err(RelayError::OutOfOrder("Begin inside a transaction"));
                }
                s.open = Some(s.tracker.begin(now_micros()));
                s.open_commit_ms = commit_time.unix_micros().div_euclid(1000);
            }
            StreamEvent::Insert { row, lsn } => {
                let txn = s
                    .open
                    .ok_or(RelayError::OutOfOrder("INSERT outside a transaction"))?;
                self.publish(stream, s, txn, &row, lsn).await?;
            }
            StreamEvent::Unreadable { row, lsn } => {
                let txn = s
                    .open
                    .ok_or(RelayError::OutOfOrder("INSERT outside a transaction"))?;
                s.unreadable_row(txn, &row, lsn)?;
            }
            StreamEvent::Commit {
                end_lsn, commit_time, ..
            } => {
                let txn = s
                    .open
                    .take()
                    .ok_or(RelayError::OutOfOrder("Commit without Begin"))?;
                s.tracker.commit(txn, end_lsn, commit_time.unix_micros());
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

    async fn publish(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        txn: TxnId,
        row: &OutboxRow,
        lsn: Lsn,
    ) -> Result<(), RelayError> {
        let record = match build_record(
            row,
            &self.validated.topic,
            self.config.routing.value,
            s.open_commit_ms,
        ) {
            Ok(r) => r,
            Err(e) => {
                let poison = Poison {
                    reason: e.reason(),
                    error: e.to_string(),
                    lsn,
                    intended_topic: None,
                    omit_payload: false,
                };
                return s.poison_row(txn, row, poison);
            }
        };
        self.ensure_topic(stream, s.beat(), &record.topic).await??;
        match self.send(stream, s, txn, lsn, &record, Sent::Event, true).await {
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
                    s.poison_row(txn, row, poison)
                }
                Refusal::Denied => Err(RelayError::KafkaDenied { topic, source }),
                Refusal::Transient => Err(KafkaSinkError::Produce { source, topic }.into()),
            },
            other => other,
        }
    }

    /// Makes sure `topic` exists and is served, keeping the session alive
    /// while that waits (creation, the readiness check).
    async fn ensure_topic(
        &mut self,
        stream: &mut OutboxStream,
        (received, flushed, every): (Lsn, Lsn, Duration),
        topic: &str,
    ) -> Result<Result<(), KafkaSinkError>, PgError> {
        stream
            .keep_alive_while(received, flushed, every, self.sink.ensure_topic(topic))
            .await
    }

    /// Enqueues one record, waiting for acknowledgements while the queue
    /// is full; `count` says whether the tracker gains an event for it.
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        txn: TxnId,
        lsn: Lsn,
        record: &KafkaRecord,
        sent: Sent,
        count: bool,
    ) -> Result<(), RelayError> {
        loop {
            match self.sink.send(record)? {
                SendOutcome::Sent(fut) => {
                    if count {
                        s.tracker.sent(txn);
                    }
                    s.deliveries
                        .push(Box::pin(async move { (txn, lsn, sent, fut.await) }));
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

    /// Sends the dead letters queued by the last step. A transient failure
    /// ends the session like any other (the replay sets the row aside
    /// again); any other failure stops outboxd: a poison row is never dropped.
    async fn flush_dead_letters(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        let definite = |e: RelayError| match e {
            RelayError::Kafka(k) if !k.is_transient() => RelayError::DeadLetterFailed(k.to_string()),
            other => other,
        };
        while let Some(job) = s.dead_letters.pop_front() {
            self.ensure_topic(stream, s.beat(), &job.record.topic)
                .await?
                .map_err(|e| definite(e.into()))?;
            let sent = Sent::DeadLetter {
                reason: job.reason,
                stub: job.stub,
            };
            match self
                .send(stream, s, job.txn, job.lsn, &job.record, sent, !job.counted)
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
    fn report(&self, stream: &OutboxStream, s: &mut Session) {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let m = &self.metrics;
        m.events_published.inc_by(std::mem::take(&mut s.acked));
        m.transactions.inc_by(std::mem::take(&mut s.retired));
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
        m.ready.set(i64::from(self.health.not_ready_reasons().is_empty()));
    }

    /// After shutdown was asked for: wait (bounded) for acknowledgements,
    /// then confirm what they cover.
    async fn drain(&mut self, stream: &mut OutboxStream, s: &mut Session) {
        let deadline = Instant::now() + self.config.shutdown.drain_timeout.0;
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
        tracing::info!(confirmed = %s.confirmable(), "stopped streaming");
    }
}

/// Every `health.poll_interval`: the slot's retained WAL (and the guard on
/// it) from `pg_replication_slots`, and a broker probe.
async fn poll_slot_and_brokers(
    v: Validated,
    probe: BrokerProbe,
    interval: Duration,
    max_retained: Option<u64>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = admin::connect(&v.pg).await.ok();
        }
        if let Some(c) = &client {
            let row = c
                .query_opt(
                    "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint, wal_status, pg_current_wal_lsn()::text
                       FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                    &[&v.slot.as_str()],
                )
                .await;
            match row {
                Ok(Some(row)) => {
                    let retained = row.get::<_, Option<i64>>(0).unwrap_or(0).max(0);
                    if let Some(end) = row
                        .get::<_, Option<String>>(2)
                        .and_then(|l| l.parse::<Lsn>().ok())
                    {
                        health.set_server_wal_end(end.0);
                    }
                    metrics.slot_retained_wal_bytes.set(retained);
                    health.set_retained_wal(retained as u64);
                    if max_retained.is_some_and(|max| retained as u64 > max) {
                        tracing::error!(
                            slot = v.slot.as_str(),
                            retained_bytes = retained,
                            "the slot retains more WAL than health.max_retained_wal_bytes: the primary's disk is at risk; check why outboxd cannot confirm (Kafka down? lag?)"
                        );
                    }
                    if row.get::<_, Option<String>>(1).as_deref() == Some("lost") {
                        tracing::error!(
                            slot = v.slot.as_str(),
                            "the replication slot was invalidated (max_slot_wal_keep_size exceeded); see the README for recovery"
                        );
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "slot poll failed");
                    client = None;
                }
            }
        }
        let reachable = probe.check().await.is_ok();
        if !reachable {
            tracing::warn!("Kafka brokers are unreachable");
        }
        health.set_kafka_reachable(reachable);
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_interval_stays_under_a_third_of_wal_sender_timeout() {
        let ms = Duration::from_millis;
        assert_eq!(status_every(ms(1000), None), ms(1000), "timeout disabled");
        assert_eq!(status_every(ms(1000), Some(ms(60_000))), ms(1000));
        assert_eq!(status_every(ms(30_000), Some(ms(60_000))), ms(20_000));
        assert_eq!(status_every(ms(500), Some(ms(900))), ms(300));
        assert_eq!(status_every(ms(500), Some(ms(1))), ms(10), "never a busy loop");
    }
}
