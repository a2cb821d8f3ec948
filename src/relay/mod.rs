//! The relay: replication stream in, Kafka records out, LSNs confirmed
//! only behind Kafka's acknowledgements.
//!
//! # One session
//!
//! A session connects (to the first writable server of `postgres.url`, so
//! that it follows a promotion), makes sure the publication and slot
//! exist, and starts replication at `0/0`, which the server reads as "from
//! the slot's `confirmed_flush_lsn`". Setting the slot up:
//!
//! * a missing slot that the slot register knows was streamed on this
//!   PostgreSQL system was lost (a promotion before it was synced, a
//!   drop): the session stops with the recovery instead of creating one
//!   that would skip events ([`crate::relay::slot_register`]);
//! * on PostgreSQL 17+ the slot is a failover slot (`postgres.failover_slot`),
//!   so a standby that syncs slots keeps a copy; the poller reports whether
//!   that copy exists ([`crate::postgres::failover`]);
//! * an invalidated slot stops the session with PostgreSQL's reason.
//!
//! Then one `tokio::select!` loop runs, with these priorities (`biased`):
//!
//! 1. **shutdown**: stop reading, drain acknowledgements, confirm, exit;
//! 2. **acknowledgements**: each delivery report is applied to the
//!    [`AckTracker`]; a failed delivery ends the session (see below).
//!    Reports arrive in batches, and the loop is woken once per batch
//!    ([`crate::kafka::delivery`], `deliveries`);
//! 3. **status timer**: every `postgres.status_interval` a standby status
//!    update reports write = received LSN, flush = apply = the tracker's
//!    flushed LSN, even when the stream is busy; when idle it asks the
//!    server to answer with a keepalive. Between ticks, a status update also
//!    goes out (at most every 100 ms) as soon as acknowledgements move the
//!    flushed LSN, so confirmation lags Kafka by milliseconds, not seconds;
//! 4. **the next stream event**, read only while fewer than
//!    `kafka.max_inflight` events and `kafka.max_inflight_bytes` bytes are
//!    unacknowledged (backpressure: memory stays bounded with any backlog,
//!    and librdkafka is not fed more than the broker acknowledges per
//!    round trip, where the surplus only costs CPU; unset, both grow with
//!    the partitions the session writes to, see
//!    [`crate::config::kafka::budget`]):
//!    * Begin opens a transaction in the tracker;
//!    * each outbox Insert becomes a record and is enqueued at once
//!      (`send_reported`, no waiting); a full librdkafka queue waits for an
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
//! A failed delivery is never skipped. The session ends, and nothing it
//! still had queued may land after a replayed record: a producer of the
//! relay's own is replaced (dropping it purges its queue); the producer the
//! at-least-once sources of a process share purged its queue the moment the
//! delivery failed ([`crate::kafka::delivery`]). The next session resumes
//! from the slot's confirmed LSN, which never passed the failed event.
//! Duplicates are possible (bounded by what was in flight), loss is not.
//! Errors that a retry can fix (network, broker down, server restart, slot
//! busy) restart the session with exponential backoff; the others (bad
//! rows, missing topics that may not be created, bad settings) stop
//! outboxd with a message saying what to do.
//!
//! # Another source's failure
//!
//! On the shared producer, a session also gets back, purged unsent, records
//! of its own that another delivery's failure took out of the queue. That
//! is no failure of this session: it hears every report of what it sent
//! before, then sends those records again in their order, and only then
//! anything new (`Relay::resend_purged`; a send before that is refused by
//! the producer's generation). Its stream, slot and confirmed LSN go on as
//! if nothing happened; `outboxd_resent_records_total` counts them.
//!
//! A session whose own delivery fails on the shared producer purges the
//! others' queues once. The sessions after it send on a producer of their
//! own (`Relay::alone_until`) until the slot is past everything the failed
//! session read and `ALONE_QUIET` has passed without another failure:
//! a source that keeps failing (a topic whose partitions have no leader, a
//! stream of refused rows) costs the other sources one purge, however long
//! the fault lasts.
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

mod commit;
mod deliveries;
mod durability;
pub mod exactly_once;
pub mod leader;
pub mod parked_publisher;
mod parking;
pub(crate) mod poller;
pub mod polling;
pub mod progress;
pub(crate) mod resume;
mod session;
pub mod slot_register;
mod streaming;

use std::sync::Arc;
use std::time::Duration;

use deliveries::Deliveries;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::{Config, Validated};
use crate::kafka::clients::KafkaClients;
use crate::kafka::sink::{KafkaSink, KafkaSinkError, Retention, SinkKind};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::ops::health::Health;
use crate::ops::otel::PublishTracer;
use crate::postgres::admin::{self, AdminError, SlotState};
use crate::postgres::connection::{ReplicationConnection, StartOptions, SystemIdentity};
use crate::postgres::error::PgError;
use crate::postgres::publication::{self, GuardState};
use crate::relay::exactly_once::{
    read_progress, ForeignProgress, Identity, ProgressError, Refused, RefusedRecords, Resume, RowPos,
    Transactions,
};
use crate::relay::leader::LeaderElection;
use crate::relay::progress::{AckTracker, LastCommit};
use crate::source::outbox::OutboxColumns;
use crate::source::stream::{OutboxStream, StreamError};
use durability::{Durability, ExactlyOnce};
use poller::poll_slot_and_brokers;
use resume::Waypoint;
use session::RegisterRefresh;
use session::Session;
use slot_register::{SlotLost, SlotRecord};

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
    #[error(transparent)]
    Otel(#[from] crate::ops::otel::OtelError),
    #[error(transparent)]
    Park(#[from] crate::park::ParkError),
    #[error(transparent)]
    ParkLimit(#[from] crate::park::set::LimitReached),
    #[error("outbox row {id} at {lsn} can never be published: {error}; the slot has not moved past it. Fix the writer and restart after removing the cause, or set routing.on_poison = \"dead-letter\"")]
    Poison { id: String, lsn: Lsn, error: String },
    #[error("Kafka refused the batch holding the record at {lsn} for topic {topic:?}: {source}; re-sending the records that may have shared it on their own, to set aside only the record Kafka refuses")]
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
    #[error("Kafka refused the record at {lsn} for topic {topic:?} inside a Kafka transaction ({error}); the transaction is aborted and the replay sets the record aside", topic = refused.topic, error = refused.error)]
    RefusedInTransaction { lsn: Lsn, pos: RowPos, refused: Refused },
    #[error("a Kafka transaction was open for {age:?}, longer than transaction.timeout.ms ({timeout:?}), so the broker aborted it ({source}); it is replayed from the progress record. If one PostgreSQL transaction takes that long to send (millions of rows), every replay ends the same way: raise kafka.options.\"transaction.timeout.ms\" (up to the broker's transaction.max.timeout.ms) or split the transaction")]
    TransactionTimedOut {
        age: Duration,
        timeout: Duration,
        source: Box<KafkaSinkError>,
    },
    #[error(transparent)]
    Progress(#[from] ProgressError),
    #[error(transparent)]
    ForeignProgress(#[from] ForeignProgress),
    #[error(transparent)]
    SlotLost(Box<SlotLost>),
    #[error("the dead-letter topic failed, so a poison row cannot be set aside: {0}; outboxd stops rather than skip it")]
    DeadLetterFailed(String),
    #[error("{reason}. The publication changed while outboxd streamed, so outbox rows committed after WAL {verified} may never have been sent; outboxd has not confirmed past {verified}. Fix the publication, re-publish the outbox rows committed since then with `outboxd replay --since <the commit time of WAL {verified}>` (consumers deduplicate by id), run `outboxd progress --accept-publication`, then restart: a restart streams that WAL with the publication as it was, and would skip such rows again. See docs/recovery.md")]
    PublicationChanged { verified: Lsn, reason: String },
    #[error("cannot read the publication's state to prove delivery: {0}")]
    GuardFailed(String),
    #[error("{0}; a new session starts from the last proven position")]
    Resubscribe(String),
    #[error("the server ended the replication stream")]
    StreamEnded,
    #[error("replication protocol out of order: {0}")]
    OutOfOrder(&'static str),
    #[error("replication slot {slot} was invalidated ({reason}: {}), so events committed after its confirmed LSN can no longer be streamed. Recovery: stop outboxd; run SELECT pg_drop_replication_slot('{slot}'); run `outboxd progress --reset --create-slot` (the slot register remembers the slot and would refuse a new one; this acknowledges the gap and creates the slot at the current WAL position); re-publish the gap from the outbox table: `{replay}` (consumers deduplicate by id); then start outboxd. See docs/recovery.md", admin::explain_invalidation(.reason))]
    SlotInvalidated {
        slot: String,
        reason: String,
        /// The `outboxd replay` command that closes the gap.
        replay: String,
    },
    #[error(
        "lost the leader lock (its PostgreSQL session ended); stopping so that only one outboxd streams"
    )]
    LeadershipLost,
    #[error("{detail}. The WAL history of this PostgreSQL system went back (a disk snapshot or a base backup restored with the same system identifier and timeline): its LSNs are being used again by other transactions, so outboxd streams nothing and skips nothing by what it remembered. If this server is the one to publish from now on, run `outboxd progress --reset --config <file>` (it forgets what Kafka remembers of slot {slot}) and start outboxd: it then publishes every transaction after the slot's position, duplicates possible (consumers deduplicate by id). Kafka may still hold events of transactions this server no longer has")]
    HistoryRewound { slot: String, detail: String },
    #[error("{detail}, and slot {slot} does not exist on this server. The WAL history of this PostgreSQL system went back (a base backup or disk snapshot restored with the same system identifier and timeline; pg_basebackup does not copy slots): the slot was never in the backup. Kafka holds events of transactions this server no longer has (committed on the old server after the backup): consumers may hold events whose rows do not exist here, and outboxd cannot take them back. If this server is the one to publish from now on: 1. run `outboxd progress --reset --create-slot --config <file>` (it forgets what Kafka remembers of slot {slot} and creates the slot at the current WAL position); 2. re-publish the outbox rows written on this server since it was restored: `{replay}` (consumers deduplicate by id); 3. start outboxd. See docs/recovery.md")]
    RewoundWithoutSlot {
        slot: String,
        detail: String,
        /// The `outboxd replay` command, its `--since` to be set.
        replay: String,
    },
    #[error("outboxd cannot show that publication {publication} delivered every outbox INSERT while no session streamed: the slot resumes at {since}, and {because}. Outbox rows written while the publication did not carry the table were never sent, and streaming that WAL again would skip them again. Recovery: 1. re-publish the outbox rows committed since then: `{replay}` (consumers deduplicate by id); 2. run `outboxd progress --accept-publication --config <file>` to record the publication as it is now; 3. start outboxd")]
    PublicationUnproven {
        publication: String,
        since: Lsn,
        because: &'static str,
        replay: String,
    },
    #[error("{0}")]
    ProgressTopicRetention(String),
    #[error("{0}; the slot has not moved past the event waiting for it")]
    Schema(#[from] crate::schema::SchemaError),
    #[error("schema_registry: {0}")]
    RegistrySetup(String),
    #[error("{0}; outboxd reads nothing until the [columns] settings fit the table")]
    Mapping(#[from] crate::source::outbox::MappingError),
}

impl RelayError {
    /// A short, bounded label for `outboxd_publish_errors_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            RelayError::Admin(_)
            | RelayError::PublicationChanged { .. }
            | RelayError::PublicationUnproven { .. }
            | RelayError::HistoryRewound { .. }
            | RelayError::RewoundWithoutSlot { .. }
            | RelayError::SlotInvalidated { .. }
            | RelayError::SlotLost(_) => "postgres_setup",
            RelayError::Pg(_)
            | RelayError::StreamEnded
            | RelayError::LeadershipLost
            | RelayError::Resubscribe(_)
            | RelayError::GuardFailed(_) => "postgres_stream",
            RelayError::Stream(_) | RelayError::OutOfOrder(_) => "decode",
            RelayError::Kafka(e) => e.reason(),
            RelayError::Poison { .. } => "poison",
            RelayError::BatchRefused { .. } | RelayError::RefusedInTransaction { .. } => "batch_refused",
            RelayError::Progress(_) | RelayError::ForeignProgress(_) => "progress",
            RelayError::ProgressTopicRetention(_) => "slot_register",
            RelayError::TransactionTimedOut { .. } => "transaction",
            RelayError::KafkaDenied { .. } => "denied",
            RelayError::DeadLetterFailed(_) => "dead_letter",
            RelayError::Otel(_) | RelayError::RegistrySetup(_) | RelayError::Mapping(_) => "config",
            RelayError::Park(_) | RelayError::ParkLimit(_) => "poison",
            RelayError::Schema(_) => "schema_registry",
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
            | RelayError::RefusedInTransaction { .. }
            | RelayError::TransactionTimedOut { .. }
            | RelayError::Resubscribe(_)
            | RelayError::GuardFailed(_) => true,
            RelayError::Schema(e) => e.is_transient(),
            RelayError::Progress(e) => e.is_transient(),
            RelayError::Park(e) => e.is_transient(),
            RelayError::ParkLimit(_) => false,
            RelayError::ForeignProgress(_) => false,
            RelayError::KafkaDenied { .. }
            | RelayError::Poison { .. }
            | RelayError::DeadLetterFailed(_)
            | RelayError::PublicationChanged { .. }
            | RelayError::PublicationUnproven { .. }
            | RelayError::HistoryRewound { .. }
            | RelayError::RewoundWithoutSlot { .. }
            | RelayError::SlotInvalidated { .. }
            | RelayError::SlotLost(_)
            | RelayError::ProgressTopicRetention(_)
            | RelayError::RegistrySetup(_)
            | RelayError::Mapping(_)
            | RelayError::Otel(_) => false,
        }
    }
}

/// Nothing of the session waits for Kafka: producers may be swapped.
fn nothing_in_flight(s: &Session) -> bool {
    s.tracker.inflight() == 0 && s.deliveries.is_empty() && s.dead_letters.is_empty()
}

/// How long a source whose delivery failed on the shared producer keeps
/// a producer of its own after its last failure (and after passing what
/// failed): a minute of an idle producer's threads against a purge of
/// every other source's queue at each retry.
pub(crate) const ALONE_QUIET: Duration = Duration::from_secs(60);

/// Why the slot the register remembers is missing: the history went back
/// (the register lies past the server's WAL, so the slot was never in the
/// restored backup), or the slot was lost (dropped, or not synced before a
/// promotion).
pub(crate) fn slot_missing(
    record: &SlotRecord,
    timeline: u32,
    wal_end: Lsn,
    topic: &str,
    config_args: &str,
) -> RelayError {
    match resume::register_beyond_wal(Some(record), timeline, wal_end) {
        Some(detail) => RelayError::RewoundWithoutSlot {
            slot: record.slot.clone(),
            detail,
            replay: format!(
                "outboxd replay {config_args} --since <the time this server started taking writes>"
            ),
        },
        None => RelayError::SlotLost(Box::new(SlotLost::new(record, timeline, topic, config_args))),
    }
}

/// The relay's shared state across sessions.
pub struct Relay {
    config: Config,
    validated: Validated,
    /// The process's Kafka clients: the producer at-least-once sources
    /// share, and the admin client.
    clients: Arc<KafkaClients>,
    sink: KafkaSink,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    election: LeaderElection,
    /// Set after Kafka refused a batch: the insert LSN of the refused
    /// record. Until the slot passes it, sessions send one record per batch.
    isolate_until: Option<Lsn>,
    /// Set after a delivery of this source failed on the shared producer
    /// (which purged every source's queue): the last LSN the failed session
    /// had read. Until the slot passes it, sessions send on a producer of
    /// their own, so a source whose deliveries keep failing (a topic whose
    /// `min.insync.replicas` cannot be met, say) costs the other sources
    /// one purge, not one per retry.
    alone_until: Option<Lsn>,
    /// When a delivery of this source last failed while [`alone_until`]
    /// was set: it stays on its own producer until [`ALONE_QUIET`] has
    /// passed without one, so that refusals a few seconds apart (each
    /// passed before the next) cost the other sources one purge too.
    ///
    /// [`alone_until`]: Relay::alone_until
    last_failure: Option<Instant>,
    /// Exactly-once: records Kafka refused inside a transaction, which the
    /// replay sets aside.
    refused: RefusedRecords,
    /// Exactly-once: records that shared a batch Kafka refused, which the
    /// replay sends each on its own (the rest in batches, so that a large
    /// transaction still fits in transaction.timeout.ms).
    suspects: std::collections::BTreeSet<RowPos>,
    /// The record sent last, whose buffers the next row's record is built
    /// into (see [`crate::kafka::records::build_record_into`]).
    scratch: crate::kafka::records::KafkaRecord,
    /// The producer's `batch.size` cap, once a topic refused a batch for
    /// its size (see `SinkKind::batch_bytes`).
    batch_bytes: Option<usize>,
    /// `outboxd.publish` spans (`None`: tracing is off).
    otel: Option<Arc<PublishTracer>>,
    /// A session of this process read logical decoding messages: later
    /// ones go on reading them (see `publication::Receiving::read_before`).
    read_messages: bool,
    /// The Schema Registry of `routing.value` = `avro`, `protobuf` or
    /// `json-schema` (`None` for the JSON formats).
    registry: Option<crate::schema::Registry>,
    /// `routing.on_poison = "park"`: the parked-event store and set.
    parking: Option<parking::Parking>,
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

/// A session's replication stream, where it starts, its publication
/// guard, and how often it must report.
struct Connected {
    durability: Durability,
    register: Option<RegisterRefresh>,
    stream: OutboxStream,
    start: Lsn,
    guard: watch::Receiver<GuardState>,
    status_every: Duration,
    /// The transaction the stream must meet before anything past `start`
    /// is confirmed (see [`resume`]).
    waypoint: Option<Waypoint>,
}

/// What a session proves on its connection before streaming.
struct Proven {
    /// The server's `wal_sender_timeout`, if any.
    server_timeout: Option<Duration>,
    /// `server_version_num`.
    server_version: i32,
    /// What is proven: the publication, the table, and what is received.
    subject: publication::Subject,
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
    let server_version = publication::server_version(client).await?;
    let subject = crate::postgres::publication::Subject::new(config, v, server_version);
    let verified = if config.postgres.create_publication {
        admin::ensure_publication(client, &subject).await?
    } else {
        publication::inspect(client, &subject).await?
    };
    Ok(Proven {
        server_timeout,
        server_version,
        subject,
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

/// A background task aborted when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Relay {
    /// A relay with Kafka clients of its own.
    pub fn new(
        config: Config,
        validated: Validated,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Result<Self, RelayError> {
        Self::with_clients(config, validated, metrics, health, KafkaClients::new())
    }

    /// A relay on the process's shared Kafka `clients`.
    pub fn with_clients(
        config: Config,
        validated: Validated,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        clients: Arc<KafkaClients>,
    ) -> Result<Self, RelayError> {
        let t = Instant::now();
        let kind = SinkKind {
            one_per_batch: false,
            own_producer: false,
            transactional_id: validated.transactional_id.clone(),
            fenced_by_lease: Some(config.postgres.leader_timeout.0),
            batch_bytes: None,
        };
        let sink = clients.sink(&config.kafka, config.kafka.admin_timeout.0, &kind)?;
        tracing::debug!(took = ?t.elapsed(), "Kafka clients created");
        let election = LeaderElection::new(
            validated.pg.clone(),
            LeaderElection::slot_key(validated.slot.as_str()),
            config.postgres.leader_timeout.0,
        );
        let otel = PublishTracer::new(&config.opentelemetry)?.map(Arc::new);
        let registry = crate::schema::Registry::from_config(&config, Some((*metrics).clone()))
            .map_err(RelayError::RegistrySetup)?;
        if let Some(r) = &registry {
            health.show_schemas(r.board());
        }
        let parking = (config.routing.on_poison == crate::config::OnPoison::Park)
            .then(|| parking::Parking::new(config.routing.park));
        Ok(Relay {
            parking,
            registry,
            config,
            validated,
            clients,
            sink,
            metrics,
            health,
            election,
            isolate_until: None,
            alone_until: None,
            last_failure: None,
            refused: RefusedRecords::default(),
            suspects: Default::default(),
            scratch: Default::default(),
            batch_bytes: None,
            otel,
            read_messages: false,
        })
    }

    /// Runs sessions until shutdown or a definite error.
    pub async fn run(&mut self, shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
        if let Some(registry) = &mut self.registry {
            registry.stop_on(shutdown.clone());
            registry.check_at_start().await?;
        }
        // Aborted however `run` ends: returned, aborted by the supervisor,
        // or unwound by a panic.
        let poller = AbortOnDrop(tokio::spawn(poll_slot_and_brokers(
            self.validated.clone(),
            Some(self.sink.probe()),
            self.config.health.poll_interval.0,
            self.config.health.max_retained_wal_bytes,
            self.metrics.clone(),
            self.health.clone(),
        )));
        let result = self.sessions(shutdown).await;
        drop(poller);
        self.health.set_streaming(None);
        if let Some(otel) = self.otel.clone() {
            // Blocks until the queued spans are exported (or time out).
            let _ = tokio::task::spawn_blocking(move || otel.shutdown()).await;
        }
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
                    // Not known to stand by (the lock may not have been
                    // asked): the next session says again.
                    self.health.set_standby(false);
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
        &mut self,
        client: tokio_postgres::Client,
        proven: Proven,
        mut repl: ReplicationConnection,
    ) -> Result<Connected, RelayError> {
        let Proven {
            server_timeout,
            server_version,
            mut subject,
            mut verified,
        } = proven;
        let status_every = status_every(self.config.postgres.status_interval.0, server_timeout);
        let failover = (server_version >= 170_000).then_some(self.config.postgres.failover_slot);
        let system = repl.identify_system().await?;
        // What Kafka remembers of the slot, read at every start and never
        // read as "nothing" when Kafka cannot answer (see slot_register).
        let record = if self.config.kafka.keeps_slot_register() {
            let kafka = &self.config.kafka;
            let slot = self.validated.slot.as_str();
            slot_register::read(kafka, &system.system_id, slot, kafka.admin_timeout.0).await?
        } else {
            None
        };
        // Before the slot: a server whose WAL ends before the position
        // Kafka remembers went back in time, with or without its slot.
        let wal_end = admin::wal_insert_lsn(&client).await?;
        if let Some(r) = &record {
            self.refuse_lost_slot(&client, &system, r, wal_end).await?;
        }
        if let Some(detail) = resume::register_beyond_wal(record.as_ref(), system.timeline, wal_end) {
            return Err(self.rewound(detail));
        }
        // The table-less outbox (crate::source::emitted), when it is
        // received. Once a session on this slot read its messages, the
        // next ones go on reading them with outbox_emit dropped: events it
        // wrote before the drop may still be in the WAL the slot has not
        // confirmed.
        if !subject.receiving.read_before
            && (self.read_messages || record.as_ref().is_some_and(|r| r.messages.is_some()))
        {
            subject.receiving.read_before = true;
            if verified.message_prefix.is_none() {
                verified = publication::inspect(&client, &subject).await?;
                if verified.message_prefix.is_some() {
                    tracing::info!(slot = self.validated.slot.as_str(), "reading the table-less outbox's messages although outbox_emit is not installed: an earlier session on this slot read them, and their events may still be in the WAL the slot has not confirmed (postgres.messages = false turns this off)");
                }
            }
        }
        let message_prefix = verified.message_prefix.clone();
        if message_prefix.is_some() {
            self.read_messages = true;
            subject.receiving.read_before = true;
        }
        // The column map must fit the table before anything is streamed:
        // a row read otherwise could only be refused.
        let catalog = crate::source::outbox::read_table(&client, &self.validated.table).await?;
        OutboxColumns::from_catalog(
            &self.validated.table.to_string(),
            &catalog,
            &self.validated.columns,
        )?;
        let v = &self.validated;
        let (start, created) = match admin::ensure_slot(&client, &mut repl, &v.slot, &v.pg.dbname, failover)
            .await?
        {
            SlotState::Created { consistent_point } => {
                tracing::info!(slot = v.slot.as_str(), %consistent_point, failover = failover == Some(true), "created replication slot");
                (consistent_point, None)
            }
            SlotState::Existing(info) => {
                if let Some(reason) = info.invalidated() {
                    return Err(self.invalidated(&system, reason).await);
                }
                (info.confirmed_flush_lsn.unwrap_or(Lsn::ZERO), Some(info))
            }
        };
        tracing::debug!("slot ready");
        // An existing slot resumes from WAL written while no session
        // streamed: the publication must be shown unchanged for it.
        if let Some(info) = &created {
            self.prove_unchanged(&verified, info, record.as_ref(), start)?;
        }
        let mut register = self.register_slot(&system, record.as_ref(), &verified).await?;
        // A slot the register does not know yet is recorded before it is
        // streamed: lost after this, it is refused, not recreated.
        let known = record
            .as_ref()
            .is_some_and(|r| r.system_id == system.system_id && r.timeline == system.timeline);
        if let (Some(register), false) = (register.as_mut(), known) {
            register.first_write(start).await;
        }
        let (durability, eo_waypoint) = self.durability(&mut repl, &system, wal_end).await?;
        let waypoint = match eo_waypoint {
            Some(w) => Some(w),
            None if self.validated.transactional_id.is_none() => {
                resume::register_waypoint(record.as_ref(), system.timeline)
            }
            None => None,
        }
        .filter(|w| created.is_some() && w.ahead_of_slot(start));
        if let Some(w) = &waypoint {
            tracing::info!(source = w.source, commit_lsn = %w.commit.commit_lsn, "the slot resumes behind a transaction Kafka holds: confirming nothing past the slot's position until the stream meets it");
        }
        let v = &self.validated;
        // A walsender still holding the slot belongs to a leader that
        // lost the lock (stopped, or cut off): end it, or its session would
        // hold the slot until wal_sender_timeout.
        if created.as_ref().is_some_and(|i| i.active) {
            admin::end_stale_walsender(&client, &v.slot, &v.pg.application_name).await?;
        }
        let stream = repl
            .start_replication(&StartOptions {
                slot: v.slot.clone(),
                publication: v.publication.clone(),
                start_lsn: Lsn::ZERO,
                messages: message_prefix.is_some(),
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
                _ => RelayError::Pg(e),
            });
        let stream = match stream {
            // "can no longer get changes from replication slot": invalidated.
            Err(RelayError::Pg(e))
                if e.sqlstate() == Some("55000") && e.to_string().contains("can no longer get changes") =>
            {
                return Err(self.invalidated(&system, "wal_removed".to_owned()).await);
            }
            other => other?,
        };
        let table_oid = verified.table_oid;
        let guard = publication::spawn_guard(client, subject, verified, start);
        Ok(Connected {
            stream: OutboxStream::new(stream, v.table.clone(), table_oid, v.columns.clone(), catalog)
                .with_messages(message_prefix),
            start,
            guard,
            status_every,
            durability,
            register,
            waypoint,
        })
    }

    /// The rewound-history error for this slot (its slot still there).
    fn rewound(&self, detail: String) -> RelayError {
        RelayError::HistoryRewound {
            slot: self.validated.slot.as_str().to_owned(),
            detail,
        }
    }

    /// Shows that the publication delivered every INSERT on the table for
    /// all WAL from `start` on (see [`resume`]), or stops with the replay
    /// command for the window. Without the slot register only the catalog
    /// can tell, and an unproven window is reported, not refused: nothing
    /// could ever record that the operator handled it.
    fn prove_unchanged(
        &self,
        verified: &publication::Verified,
        slot: &admin::SlotInfo,
        record: Option<&SlotRecord>,
        start: Lsn,
    ) -> Result<(), RelayError> {
        let proof = resume::publication_proof(verified, slot.catalog_xmin, record);
        tracing::debug!(?proof, "publication since the slot's position");
        let resume::PublicationProof::Unproven(why) = proof else {
            return Ok(());
        };
        let replay = slot_register::replay_command(&self.validated.config_args(), record);
        // A slot outboxd never streamed (no record: a first start on a slot
        // made by hand or by Debezium, or after `progress --reset`): there
        // is no earlier session whose proof could carry over, as before
        // this check existed. It is said, not refused.
        if record.is_none() && self.config.kafka.keeps_slot_register() {
            tracing::warn!(slot = self.validated.slot.as_str(), %start, "first start on a slot outboxd has not streamed: the publication cannot be shown unchanged since the slot's position (its catalog rows are newer than the slot's catalog_xmin); if it did not carry the table at some point since then, re-publish that window with outboxd replay");
            return Ok(());
        }
        if !self.config.kafka.keeps_slot_register() {
            self.metrics.error("publication_unproven");
            tracing::error!(slot = self.validated.slot.as_str(), %start, replay, "cannot show that the publication delivered every outbox INSERT while no session streamed (its catalog rows were written after the slot's catalog_xmin, and kafka.slot_register is off): rows written while it did not carry the table were never sent; re-publish them with the replay command if the publication changed");
            return Ok(());
        }
        Err(RelayError::PublicationUnproven {
            publication: self.validated.publication.as_str().to_owned(),
            since: start,
            because: why.because(),
            replay,
        })
    }

    /// The invalidated-slot error, with the replay command that closes the
    /// gap from the slot register's record (when it is kept and readable).
    async fn invalidated(&self, system: &SystemIdentity, reason: String) -> RelayError {
        let kafka = &self.config.kafka;
        let slot = self.validated.slot.as_str();
        let record = if kafka.keeps_slot_register() {
            slot_register::read(kafka, &system.system_id, slot, kafka.admin_timeout.0)
                .await
                .ok()
                .flatten()
        } else {
            None
        };
        RelayError::SlotInvalidated {
            slot: slot.to_owned(),
            reason,
            replay: slot_register::replay_command(&self.validated.config_args(), record.as_ref()),
        }
    }

    /// The slot register's rule (see [`crate::relay::slot_register`]): a missing
    /// slot that outboxd streamed on this system before was lost, and is not
    /// silently recreated.
    async fn refuse_lost_slot(
        &mut self,
        client: &tokio_postgres::Client,
        system: &SystemIdentity,
        record: &SlotRecord,
        wal_end: Lsn,
    ) -> Result<(), RelayError> {
        if admin::slot_info(client, &self.validated.slot).await?.is_some() {
            return Ok(());
        }
        Err(slot_missing(
            record,
            system.timeline,
            wal_end,
            self.config.kafka.progress_topic(),
            &self.validated.config_args(),
        ))
    }

    /// The progress topic's retention, asked again while a topic outboxd
    /// has just made is not yet described by the broker answering.
    async fn progress_topic_retention(&self, topic: &str) -> Result<Retention, String> {
        let mut answer = self.sink.progress_topic_retention(topic).await;
        for _ in 0..10 {
            if answer != Ok(Retention::Missing) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            answer = self.sink.progress_topic_retention(topic).await;
        }
        answer
    }

    /// What the session needs to keep the slot register's record (once the
    /// slot exists): the first status tick writes it, in the background.
    /// A progress topic that cannot be made is logged and counted, not
    /// fatal: outboxd's own work goes on, only a lost slot could then not
    /// be told from a first start (the warning and
    /// `outboxd_publish_errors_total{reason="slot_register"}` say so).
    async fn register_slot(
        &mut self,
        system: &SystemIdentity,
        previous: Option<&SlotRecord>,
        verified: &publication::Verified,
    ) -> Result<Option<RegisterRefresh>, RelayError> {
        let kafka = &self.config.kafka;
        if !kafka.keeps_slot_register() {
            return Ok(None);
        }
        let topic = kafka.progress_topic();
        match self.sink.ensure_progress_topic(topic).await {
            Err(e) => {
                self.metrics.error("slot_register");
                tracing::warn!(
                    topic,
                    error = %e,
                    "cannot make the progress topic for the slot register: a lost slot cannot be detected until this is fixed (or set kafka.slot_register = false)"
                );
            }
            // A topic that deletes old records would lose the register of
            // an idle slot: refused, as a register that cannot be read is.
            Ok(()) => match self.progress_topic_retention(topic).await {
                Ok(Retention::Kept) => {}
                Ok(Retention::Deletes(problem)) => return Err(RelayError::ProgressTopicRetention(problem)),
                Ok(Retention::Missing) => {
                    tracing::warn!(topic, "the progress topic outboxd just made is not described yet: its cleanup.policy is not verified (it was created compact)")
                }
                Err(e) => {
                    tracing::warn!(topic, error = %e, "cannot read the progress topic's cleanup.policy (DescribeConfigs on the topic): it must be compact, or the slot register of an idle slot may be deleted")
                }
            },
        }
        let record = SlotRecord::new(
            self.validated.slot.as_str(),
            &self.validated.pg.dbname,
            &system.system_id,
            system.timeline,
            Lsn::ZERO,
        )
        .with_publication(Some(verified.fingerprint.clone()))
        .with_messages(verified.messages_fingerprint.clone());
        Ok(Some(RegisterRefresh::new(
            kafka.clone(),
            record,
            previous,
            self.metrics.clone(),
        )))
    }

    /// The session's delivery mode. Exactly-once first fences older
    /// producers with the same `transactional.id` (which completes any
    /// transaction they left), then reads the progress record, so that it
    /// sees everything they committed.
    async fn durability(
        &mut self,
        repl: &mut ReplicationConnection,
        system: &SystemIdentity,
        wal_end: Lsn,
    ) -> Result<(Durability, Option<Waypoint>), RelayError> {
        if self.validated.transactional_id.is_none() {
            return Ok((Durability::AtLeastOnce, None));
        }
        let eo = &self.config.kafka.exactly_once;
        let slot = self.validated.slot.as_str().to_owned();
        let timeout = eo.commit_timeout.0;
        let started = Instant::now();
        let system = system.clone();
        let server_timeline = system.timeline;
        self.sink.init_transactions(timeout).await?;
        let topic = self.config.kafka.progress_topic().to_owned();
        self.sink.ensure_progress_topic(&topic).await?;
        let record = read_progress(&self.config.kafka, &topic, &slot, timeout).await?;
        let identity = Identity {
            writer: crate::relay::exactly_once::writer_name(),
            slot: slot.clone(),
            database: self.validated.pg.dbname.clone(),
            system_id: system.system_id,
            timeline: system.timeline,
        };
        let mut t = Transactions::new(eo, topic, identity);
        if let Some(r) = &record {
            t.check_owner(r)?;
        }
        // A record of an earlier timeline (written before a promotion)
        // still holds if it lies before that timeline's switch point.
        let history = match &record {
            Some(r) if r.timeline < server_timeline => match repl.timeline_history(server_timeline).await {
                Ok(h) => Some(h),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the timeline history; the progress record of the earlier timeline is not used to skip");
                    None
                }
            },
            _ => None,
        };
        let resume = t.resume(record.as_ref(), history.as_ref())?;
        // A record of this timeline names a transaction in this WAL, which
        // a rewound history no longer has (see `resume`).
        let waypoint = match (&resume, &record) {
            (Resume::SkipThrough(_), Some(r)) => Some(Waypoint::new(
                LastCommit {
                    commit_lsn: r.commit_lsn()?,
                    end_lsn: r.end_lsn()?,
                    commit_time: r.commit_time_micros()?,
                },
                "the progress record",
            )),
            _ => None,
        };
        if let Some(detail) = waypoint.as_ref().and_then(|w| w.beyond_wal(wal_end)) {
            return Err(self.rewound(detail));
        }
        match resume {
            Resume::FromSlot => tracing::info!(slot, "no progress record: starting at the slot"),
            Resume::SkipThrough(lsn) => {
                self.metrics.progress_lsn.set(i64::try_from(lsn.0).unwrap_or(i64::MAX));
                self.health.set_progress_lsn(lsn.0);
                tracing::info!(slot, progress = %lsn, took = ?started.elapsed(), "transactions up to the progress record are in Kafka; skipping them")
            }
            Resume::SkipThroughAncestor { lsn, record, switch } => {
                self.metrics.progress_lsn.set(i64::try_from(lsn.0).unwrap_or(i64::MAX));
                self.health.set_progress_lsn(lsn.0);
                tracing::info!(slot, progress = %lsn, record_timeline = record, %switch, "the progress record was written on an earlier timeline, before its switch point: that WAL is the same here, so transactions up to it are skipped")
            }
            Resume::OtherTimeline { record, server } => tracing::warn!(
                slot,
                record_timeline = record,
                server_timeline = server,
                "the progress record was written on another timeline (a promotion or a point-in-time recovery): starting at the slot, so events confirmed-but-not-yet-acknowledged to the old primary may be published twice"
            ),
        }
        Ok((Durability::ExactlyOnce(Box::new(ExactlyOnce::new(t))), waypoint))
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
            durability,
            register,
            waypoint,
        } = match self.connect(client, proven, repl).await {
            Ok(c) => c,
            Err(e) => {
                // A transactional producer that failed to start (or was
                // fenced) cannot be started again: begin anew.
                if self.validated.transactional_id.is_some() {
                    self.sink = self.new_sink()?;
                }
                return Err(e);
            }
        };
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
            own_producer: self.alone_until.is_some() && !self.sink.shares_producer(),
            deliveries: Deliveries::new(self.sink.reports(), self.sink.shares_producer()),
            dead_letters: std::collections::VecDeque::new(),
            on_poison: self.config.routing.on_poison,
            dead_letter_topic: self.config.routing.dead_letter_topic.clone(),
            reported_flush: start,
            last_status: Instant::now(),
            status_every,
            acked: 0,
            retired: 0,
            last_ack: None,
            durability,
            skipping: false,
            skipped: 0,
            register,
            start,
            waypoint,
            open_commit: Lsn::ZERO,
            row_index: 0,
            pending_failure: None,
            refusals: Vec::new(),
            alone: None,
            to_park: std::collections::VecDeque::new(),
            isolated_row: None,
            draining: false,
        };
        self.start_parking(stream.backend_pid()).await?;
        let result = self.stream_loop(&mut stream, &mut s, shutdown).await;
        match result {
            Ok(()) => {
                self.drain(&mut stream, &mut s).await;
                stream.stop(Duration::from_secs(5)).await?;
                Ok(SessionEnd::Shutdown)
            }
            Err(e) => {
                // A producer with a fatal error (fenced, most often) fails
                // every record with a purge: name the cause instead.
                let e = match self.sink.fatal_error() {
                    Some(fatal) if matches!(e, RelayError::Kafka(_)) => RelayError::Kafka(fatal),
                    _ => e,
                };
                // A Kafka transaction older than transaction.timeout.ms was
                // aborted by the broker, which then refuses its producer:
                // that, not another outboxd, is the cause to name.
                let timeout = self.config.kafka.transaction_timeout();
                let e = match (e, s.durability.oldest_transaction_age()) {
                    (RelayError::Kafka(source), Some(age)) if age >= timeout => {
                        RelayError::TransactionTimedOut {
                            age,
                            timeout,
                            source: Box::new(source),
                        }
                    }
                    (e, _) => e,
                };
                // Whatever this session read may have shared a batch with
                // the refused record: re-send all of it one per batch.
                // Exactly-once: every record of the refused batch, each to
                // be sent on its own; at-least-once re-sends all it read
                // one per batch.
                // A batch too large for its topic: later batches are no
                // larger than the topic takes.
                if let RelayError::BatchRefused { topic, source, .. } = &e {
                    if source.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::MessageSizeTooLarge)
                    {
                        if let Some(limit) = self.sink.topic_max_message_bytes(topic).await {
                            // Room for librdkafka's own framing.
                            let limit = limit - limit / 20;
                            if self.batch_bytes.is_none_or(|b| b > limit) {
                                tracing::info!(topic, batch_size = limit, "a batch was too large for its topic: sending batches within its max.message.bytes");
                                self.batch_bytes = Some(limit);
                            }
                        }
                    }
                }
                match &e {
                    RelayError::BatchRefused { .. } if !s.refusals.is_empty() => {
                        self.suspects.extend(s.refusals.iter().map(|r| r.pos));
                    }
                    RelayError::BatchRefused { lsn, .. } => {
                        let until = self.isolate_until.unwrap_or(Lsn::ZERO).max(*lsn).max(s.received);
                        self.isolate_until = Some(until);
                    }
                    _ => {}
                }
                if let RelayError::RefusedInTransaction { pos, refused, .. } = &e {
                    self.refused.insert(*pos, refused.clone());
                }
                // A delivery that failed on the shared producer purged the
                // other sources' queues: the sessions after it send on a
                // producer of their own until past what this one read.
                let delivery_failed = matches!(
                    e,
                    RelayError::Kafka(_) | RelayError::BatchRefused { .. } | RelayError::DeadLetterFailed(_)
                );
                // Records of this session already sent on the shared
                // producer may still be stored (librdkafka retries them): a
                // producer of its own sends the replay only once each of
                // them is reported, or the replay could land ahead of them.
                if delivery_failed && (self.sink.shares_producer() || self.alone_until.is_some()) {
                    let heard = !self.sink.shares_producer() || self.hear_out(&mut s).await;
                    let until = self.alone_until.unwrap_or(Lsn::ZERO).max(s.received);
                    if !heard {
                        tracing::warn!("records sent before the failure are still unreported: this source stays on the shared producer, behind them");
                    } else {
                        if self.alone_until.is_none() {
                            tracing::warn!(until = %until, "a delivery failed on the producer the sources share: this source sends on a producer of its own until it is past what failed, so that further failures cost the other sources nothing");
                        }
                        self.alone_until = Some(until);
                        self.last_failure = Some(Instant::now());
                    }
                }
                // Exactly-once: nothing of the open Kafka transaction may
                // become visible.
                self.abort_open_transaction().await;
                // Never let a record queued before a failed delivery land
                // after the replay: a producer of its own is dropped (which
                // purges its queue) for a new one; a shared one purged its
                // queue when the delivery failed, and the next session
                // sends on a new lane behind what it already transmitted.
                self.sink = self.new_sink()?;
                // Confirm what is safely acknowledged, best effort.
                let _ = s.send_status(&mut stream, false).await;
                Err(e)
            }
        }
    }

    /// A fresh sink: one record per batch while a refusal is being
    /// isolated (a producer of its own then; else the shared one, on a new
    /// lane).
    fn new_sink(&self) -> Result<KafkaSink, KafkaSinkError> {
        let (cfg, timeout) = (&self.config.kafka, self.config.kafka.admin_timeout.0);
        let kind = SinkKind {
            one_per_batch: self.isolate_until.is_some(),
            own_producer: self.alone_until.is_some(),
            transactional_id: self.validated.transactional_id.clone(),
            fenced_by_lease: Some(self.config.postgres.leader_timeout.0),
            batch_bytes: self.batch_bytes,
        };
        self.clients.sink(cfg, timeout, &kind)
    }

    /// Ends isolation once the slot is past the refused record: intake
    /// waits (`false`) until nothing is in flight, then batching resumes
    /// with a new producer, which purges nothing because nothing is queued.
    /// Exactly-once: nothing waits for a Kafka commit either, and the new
    /// producer registers its transactional.id first.
    async fn end_isolation(&mut self, s: &mut Session) -> Result<bool, RelayError> {
        if s.own_producer && !s.isolating {
            return self.end_own_producer(s);
        }
        let passed = self.isolate_until.is_none_or(|until| s.tracker.flushed() > until);
        if !s.isolating || !passed {
            return Ok(true);
        }
        // A Kafka transaction is open: keep reading to its commit, and
        // swap producers right after it.
        if !s.durability.settled() {
            return Ok(true);
        }
        if !nothing_in_flight(s) {
            return Ok(false);
        }
        self.isolate_until = None;
        self.swap_sink(s)?;
        if self.validated.transactional_id.is_some() {
            self.sink
                .init_transactions(self.config.kafka.exactly_once.commit_timeout.0)
                .await?;
        }
        s.isolating = false;
        s.own_producer = self.alone_until.is_some() && !self.sink.shares_producer();
        tracing::info!("past the record Kafka refused; sending in batches again");
        Ok(true)
    }

    /// A new sink of the kind the relay's state asks for, its reports
    /// followed by the session (call with nothing in flight).
    fn swap_sink(&mut self, s: &mut Session) -> Result<(), RelayError> {
        self.sink = self.new_sink()?;
        s.deliveries
            .follow(self.sink.reports(), self.sink.shares_producer());
        Ok(())
    }

    /// Waits for the report of every record the session sent (each ends
    /// stored or failed within `message.timeout.ms`); whether all came.
    async fn hear_out(&self, s: &mut Session) -> bool {
        let timeout = self
            .config
            .kafka
            .options
            .get("message.timeout.ms")
            .and_then(|ms| ms.parse::<u64>().ok())
            .map_or(self.config.postgres.leader_timeout.0, Duration::from_millis);
        let all = async { while s.deliveries.next().await.is_some() {} };
        tokio::time::timeout(timeout + Duration::from_secs(5), all)
            .await
            .is_ok()
    }

    /// Back to the shared producer once the slot is past what failed on
    /// it ([`Relay::alone_until`]): intake waits (`false`) until nothing is
    /// in flight, so nothing queued on the own producer is dropped.
    fn end_own_producer(&mut self, s: &mut Session) -> Result<bool, RelayError> {
        let quiet = self.last_failure.is_none_or(|t| t.elapsed() >= ALONE_QUIET);
        if !quiet || self.alone_until.is_some_and(|until| s.tracker.flushed() <= until) {
            return Ok(true);
        }
        if !nothing_in_flight(s) {
            return Ok(false);
        }
        self.alone_until = None;
        self.swap_sink(s)?;
        s.own_producer = false;
        tracing::info!("past what failed on the shared producer; sending on it again");
        Ok(true)
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
