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
//!    server to answer with a keepalive;
//! 4. **the next stream event**, read only while fewer than
//!    `kafka.max_inflight` events are unacknowledged (backpressure: memory
//!    stays bounded with any backlog):
//!    * Begin opens a transaction in the tracker;
//!    * each outbox Insert becomes a record and is enqueued at once
//!      (`send_result`, no waiting); a full librdkafka queue waits for an
//!      acknowledgement first;
//!    * Commit records the transaction's end LSN, which becomes confirmable
//!      when it and all earlier transactions are acknowledged;
//!    * a keepalive's WAL end is confirmable when nothing is open or in
//!      flight; a keepalive that asks for a reply gets a status update now.
//!
//! # Failures
//!
//! A failed delivery is never skipped. The session ends; records still
//! queued in librdkafka are purged so none lands after a replayed one; the
//! next session resumes from the slot's confirmed LSN, which never passed
//! the failed event. Duplicates are possible (bounded by what was in
//! flight), loss is not. Errors that a retry can fix (network, broker down,
//! server restart, slot busy) restart the session with exponential backoff;
//! the others (bad rows, missing topics that may not be created, bad
//! settings) stop outboxd with a message saying what to do.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use rdkafka::message::Message as _;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use crate::config::{Config, Validated};
use crate::health::Health;
use crate::kafka::{BrokerProbe, KafkaSink, KafkaSinkError, SendOutcome};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::OutboxRow;
use crate::pg::admin::{self, AdminError, SlotState};
use crate::pg::connection::{ReplicationConnection, StartOptions};
use crate::pg::error::PgError;
use crate::pg::outbox_stream::{OutboxStream, StreamError, StreamEvent};
use crate::progress::{AckTracker, TxnId};
use crate::routing::{build_record, RecordError};

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
    #[error("outbox row {id} at {lsn} cannot become a Kafka record: {source}; fix or delete the row's source and restart (the slot has not moved past it)")]
    Record {
        id: uuid::Uuid,
        lsn: Lsn,
        source: RecordError,
    },
    #[error("publication {0} does not exist and postgres.create_publication is false: create it with CREATE PUBLICATION ... FOR TABLE ... WITH (publish = 'insert')")]
    NoPublication(String),
    #[error("the server ended the replication stream")]
    StreamEnded,
    #[error("replication protocol out of order: {0}")]
    OutOfOrder(&'static str),
}

impl RelayError {
    /// A short, bounded label for `outboxd_publish_errors_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            RelayError::Admin(_) | RelayError::NoPublication(_) => "postgres_setup",
            RelayError::Pg(_) | RelayError::StreamEnded => "postgres_stream",
            RelayError::Stream(_) | RelayError::OutOfOrder(_) => "decode",
            RelayError::Kafka(e) => e.reason(),
            RelayError::Record { source, .. } => source.reason(),
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
            RelayError::StreamEnded | RelayError::OutOfOrder(_) => true,
            RelayError::Record { .. } | RelayError::NoPublication(_) => false,
        }
    }
}

/// What a delivery future resolves to, tagged with its transaction.
type Delivery = (
    TxnId,
    Result<rdkafka::producer::future_producer::OwnedDeliveryResult, futures::channel::oneshot::Canceled>,
);

/// The relay's shared state across sessions.
pub struct Relay {
    config: Config,
    validated: Validated,
    sink: KafkaSink,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
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
    deliveries: FuturesUnordered<futures::future::BoxFuture<'static, Delivery>>,
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

impl Session {
    /// Applies an acknowledgement, and times every transaction it retires.
    fn delivered(&mut self, metrics: &Metrics, (txn, result): Delivery) -> Result<(), RelayError> {
        match result {
            Ok(Ok(_delivery)) => {
                self.tracker.acked(txn);
                self.acked += 1;
                self.last_ack = Some(std::time::Instant::now());
                self.observe_retired(metrics);
                Ok(())
            }
            Ok(Err((source, msg))) => Err(KafkaSinkError::Delivery {
                topic: msg.topic().to_owned(),
                source,
            }
            .into()),
            Err(_) => Err(KafkaSinkError::Canceled.into()),
        }
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
        let sink = KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0)?;
        Ok(Relay {
            config,
            validated,
            sink,
            metrics,
            health,
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

    async fn connect(&self) -> Result<(OutboxStream, Lsn), RelayError> {
        let v = &self.validated;
        let client = admin::connect(&v.pg).await?;
        if self.config.postgres.create_publication {
            admin::ensure_publication(&client, &v.publication, &v.table).await?;
        } else {
            let exists = client
                .query_opt(
                    "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1",
                    &[&v.publication.as_str()],
                )
                .await
                .map_err(AdminError::from)?;
            if exists.is_none() {
                return Err(RelayError::NoPublication(v.publication.as_str().to_owned()));
            }
        }
        let mut repl = ReplicationConnection::connect(&v.pg).await?;
        let start = match admin::ensure_slot(&client, &mut repl, &v.slot, &v.pg.dbname).await? {
            SlotState::Created { consistent_point } => {
                tracing::info!(slot = v.slot.as_str(), %consistent_point, "created replication slot");
                consistent_point
            }
            SlotState::Existing(info) => info.confirmed_flush_lsn.unwrap_or(Lsn::ZERO),
        };
        let stream = repl
            .start_replication(&StartOptions {
                slot: v.slot.clone(),
                publication: v.publication.clone(),
                start_lsn: Lsn::ZERO,
                messages: false,
            })
            .await
            .inspect_err(|e| {
                if e.sqlstate() == Some("55006") {
                    tracing::warn!(
                        slot = v.slot.as_str(),
                        "replication slot is in use: is another outboxd running?"
                    );
                }
            })?;
        Ok((OutboxStream::new(stream, v.table.clone()), start))
    }

    async fn session(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        streamed: &mut bool,
    ) -> Result<SessionEnd, RelayError> {
        let (mut stream, start) = self.connect().await?;
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
            deliveries: FuturesUnordered::new(),
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
                // Never let a record queued before the failure land after
                // the replay: the next session re-sends from the slot.
                self.sink.purge_queued();
                // Confirm what is safely acknowledged, best effort.
                let _ = stream.send_status(s.received, s.tracker.flushed(), false).await;
                Err(e)
            }
        }
    }

    async fn stream_loop(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut status = tokio::time::interval(self.config.postgres.status_interval.0);
        status.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let max_inflight = self.config.kafka.max_inflight;
        if *shutdown.borrow_and_update() {
            return Ok(());
        }
        loop {
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
                    stream.send_status(s.received, s.tracker.flushed(), idle).await?;
                    self.report(stream, s);
                }
                event = stream.next_event(), if s.tracker.inflight() < max_inflight => {
                    match event? {
                        Some(ev) => self.handle_event(stream, s, ev).await?,
                        None => return Err(RelayError::StreamEnded),
                    }
                }
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
            StreamEvent::Begin { .. } => {
                if s.open.is_some() {
                    return Err(RelayError::OutOfOrder("Begin inside a transaction"));
                }
                s.open = Some(s.tracker.begin(now_micros()));
            }
            StreamEvent::Insert { row, lsn } => {
                let txn = s
                    .open
                    .ok_or(RelayError::OutOfOrder("INSERT outside a transaction"))?;
                self.publish(s, txn, &row, lsn).await?;
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
                    stream.send_status(s.received, s.tracker.flushed(), false).await?;
                }
            }
        }
        Ok(())
    }

    async fn publish(
        &mut self,
        s: &mut Session,
        txn: TxnId,
        row: &OutboxRow,
        lsn: Lsn,
    ) -> Result<(), RelayError> {
        let record =
            build_record(row, &self.validated.topic, self.config.routing.value).map_err(|source| {
                RelayError::Record {
                    id: row.id,
                    lsn,
                    source,
                }
            })?;
        self.sink.ensure_topic(&record.topic).await?;
        loop {
            match self.sink.send(&record)? {
                SendOutcome::Sent(fut) => {
                    s.tracker.sent(txn);
                    s.deliveries.push(Box::pin(async move { (txn, fut.await) }));
                    return Ok(());
                }
                SendOutcome::QueueFull => match s.deliveries.next().await {
                    Some(done) => s.delivered(&self.metrics, done)?,
                    None => tokio::time::sleep(Duration::from_millis(1)).await,
                },
            }
        }
    }

    /// Publishes the session's progress to the metrics and the health
    /// state: once per status tick, never per event.
    fn report(&self, stream: &OutboxStream, s: &mut Session) {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let m = &self.metrics;
        m.events_published.inc_by(std::mem::take(&mut s.acked));
        m.transactions.inc_by(std::mem::take(&mut s.retired));
        let flushed = s.tracker.flushed();
        let lag = stream.server_wal_end().max(s.received).bytes_since(flushed);
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
        while !s.deliveries.is_empty() {
            tokio::select! {
                Some(done) = s.deliveries.next() => {
                    if let Err(e) = s.delivered(&self.metrics, done) {
                        tracing::error!(error = %e, "delivery failed during shutdown; the event will be re-sent after restart");
                        break;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(unacknowledged = s.tracker.inflight(), "drain timeout: these events will be re-sent after restart");
                    break;
                }
            }
        }
        if let Err(e) = stream.send_status(s.received, s.tracker.flushed(), false).await {
            tracing::warn!(error = %e, "could not send the final status update");
        }
        self.report(stream, s);
        tracing::info!(confirmed = %s.tracker.flushed(), "stopped streaming");
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
                    "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint, wal_status
                       FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                    &[&v.slot.as_str()],
                )
                .await;
            match row {
                Ok(Some(row)) => {
                    let retained = row.get::<_, Option<i64>>(0).unwrap_or(0).max(0);
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
