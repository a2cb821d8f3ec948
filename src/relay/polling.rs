//! Polling mode (`mode = "polling"`): seed 000's relay, for databases where
//! logical replication is not available.
//!
//! # One poller, in write order
//!
//! Polling instances elect a leader as CDC sessions do ([`crate::relay::leader`],
//! keyed by the table): one polls, the others wait as hot standbys. Two
//! pollers would take different slices of one aggregate and publish them
//! through different producers, in any order.
//!
//! Rows are published in `created_at` order, which migration 0008 makes the
//! insert time (`clock_timestamp()`), then by `ctid` within a timestamp. A
//! writer that waits for another one (a row lock on the aggregate, a
//! version check) inserts after that one committed, so each aggregate's
//! events keep the order they were written in.
//!
//! A transaction still in flight may hold rows with an earlier `created_at`
//! than rows already visible; publishing those first would pass it over.
//! So each round reads only rows older than a **watermark**: the poller
//! samples, every round, the server clock and the next transaction id
//! (`pg_current_snapshot()`), and the watermark is the time of the latest
//! sample whose next id lies at or below the oldest transaction still
//! running. Every running transaction got its id after that sample, and
//! inserted after it, so none can still add a row below the watermark. A
//! long write transaction holds the watermark (and publishing) back until
//! it ends; `outboxd_oldest_unpublished_seconds` shows it. Rows written with
//! an explicit `created_at` are ordered by that value instead, and may be
//! passed over.
//!
//! # A round, in one transaction
//!
//! 1. `SELECT … WHERE published_at IS NULL AND created_at < watermark ORDER
//!    BY created_at, ctid LIMIT n FOR UPDATE`;
//! 2. every row becomes a record exactly as in CDC mode and is enqueued at
//!    once;
//! 3. acknowledgements are taken in row order; the round stops at its first
//!    failure, so no later event of an aggregate is marked ahead of an
//!    earlier one (the seed's rule). An acknowledgement without an offset is
//!    a failure ([`crate::kafka::sink::Report`]);
//! 4. `UPDATE … SET published_at = now()` for the acknowledged prefix, and
//!    commit. The rest is picked up again next round.
//!
//! # Rows Kafka refuses
//!
//! Kafka refuses whole batches, so a refused row may only have shared a
//! batch with the culprit. The round stops there; the next round sends its
//! rows one at a time, each waiting for its answer, up to that row, so a
//! refusal is the row's own. Such a row follows `routing.on_poison` as in
//! CDC mode: its dead letter (marked published once acknowledged), or a
//! stop that names it. Rows that can never become a record are set aside
//! the same way.
//!
//! # A shared producer
//!
//! In a process with several sources, polling sources send through the
//! producer the at-least-once sources share ([`crate::kafka::clients`]).
//! When another delivery fails, it purges its unsent records
//! ([`crate::kafka::delivery`]): a row of this round that comes back purged
//! ends the round like any failure (the acknowledged prefix is marked), and
//! the next round starts at once, on the same connection, and sends the
//! rest again in order. Every round hears all its reports before it ends,
//! so a new round may take the producer's new generation.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tokio_postgres::{Client, GenericClient};

use crate::config::columns::Role;
use crate::config::{Config, Validated};
use crate::kafka::clients::KafkaClients;
use crate::kafka::enqueue::{enqueue_row, set_aside, set_aside_as_stub, EnqueueError, Enqueued};
use crate::kafka::records::build_record;
use crate::kafka::sink::{KafkaSink, KafkaSinkError, Refusal, Report, SinkKind};
use crate::metrics::Metrics;
use crate::ops::health::Health;
use crate::postgres::admin::{self, AdminError};
use crate::relay::leader::LeaderElection;
use crate::source::outbox::{OutboxColumns, OutboxRow};

/// Why polling stopped or a round failed.
#[derive(Debug, thiserror::Error)]
pub enum PollingError {
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    #[error(transparent)]
    Poison(EnqueueError),
    #[error("{0}; the row stays unpublished")]
    Schema(crate::schema::SchemaError),
    #[error("schema_registry: {0}")]
    RegistrySetup(String),
    #[error("an outbox row cannot be read: {0}")]
    Row(crate::source::outbox::RowError),
    #[error("{0}; outboxd reads nothing until the [columns] settings fit the table")]
    Mapping(#[from] crate::source::outbox::MappingError),
    #[error("the polling lease lapsed in the middle of a round (this process was stopped or starved longer than postgres.leader_timeout); the rest of the round is left to whichever instance leads now")]
    LeadershipLost,
    #[error("Kafka refused the batch holding outbox row {id} ({source}); sending the rows from there one at a time, to set aside only the row Kafka refuses")]
    BatchRefused {
        id: String,
        source: rdkafka::error::KafkaError,
    },
}

impl From<EnqueueError> for PollingError {
    fn from(e: EnqueueError) -> Self {
        match e {
            EnqueueError::Kafka(k) => PollingError::Kafka(k),
            poison @ EnqueueError::Poison { .. } => PollingError::Poison(poison),
        }
    }
}

impl PollingError {
    /// A record of the round came back purged unsent by the shared producer
    /// (another delivery failed), or a send was refused until the round
    /// heard its reports: nothing of this source failed.
    fn is_purge(&self) -> bool {
        match self {
            PollingError::Kafka(KafkaSinkError::Purged) => true,
            PollingError::Kafka(KafkaSinkError::Delivery { source, .. }) => {
                source.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::PurgeQueue)
            }
            _ => false,
        }
    }

    fn is_transient(&self) -> bool {
        match self {
            PollingError::Admin(AdminError::Connect { .. } | AdminError::Query(_)) => true,
            PollingError::Admin(_) => false,
            PollingError::Kafka(e) => e.is_transient(),
            PollingError::Schema(e) => e.is_transient(),
            PollingError::Poison(_)
            | PollingError::RegistrySetup(_)
            | PollingError::Row(_)
            | PollingError::Mapping(_) => false,
            PollingError::BatchRefused { .. } | PollingError::LeadershipLost => true,
        }
    }
}

impl From<tokio_postgres::Error> for PollingError {
    fn from(e: tokio_postgres::Error) -> Self {
        PollingError::Admin(AdminError::Query(e))
    }
}

/// The samples behind the watermark: (server time, next transaction id).
#[derive(Debug, Default)]
struct Watermark {
    samples: VecDeque<(DateTime<Utc>, i64)>,
}

/// Samples kept while a long transaction holds the watermark back.
const MAX_SAMPLES: usize = 4096;

impl Watermark {
    /// Takes in a sample (`now`, the snapshot's `xmax`) and the oldest
    /// running transaction id (`xmin`); returns the watermark, if any
    /// sample qualifies yet.
    fn observe(&mut self, now: DateTime<Utc>, xmax: i64, xmin: i64) -> Option<DateTime<Utc>> {
        self.samples.push_back((now, xmax));
        // The latest sample at or below xmin is the watermark; older ones
        // are no longer needed (xmin only grows).
        let latest = self.samples.iter().rposition(|(_, next)| *next <= xmin);
        if let Some(i) = latest {
            self.samples.drain(..i);
        }
        if self.samples.len() > MAX_SAMPLES {
            // Thin out the newest half: a coarser history only lowers the
            // watermark, never raises it past a running transaction.
            let keep_from = self.samples.len() / 2;
            let newest = self.samples.pop_back();
            self.samples.truncate(keep_from);
            self.samples.extend(newest);
        }
        latest.map(|_| self.samples[0].0)
    }
}

/// The polling relay.
pub struct PollingRelay {
    config: Config,
    validated: Validated,
    clients: Arc<KafkaClients>,
    sink: KafkaSink,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    election: LeaderElection,
    watermark: Watermark,
    /// After Kafka refused a batch: send one row at a time, waiting for
    /// each, up to and including this row (its handle: `tableoid:ctid`).
    isolate_until: Option<String>,
    /// After a delivery failed on the shared producer (which purged every
    /// source's queue), the last such failure: rounds send on a producer of
    /// their own until one publishes without a failure once
    /// `ALONE_QUIET` has passed since, so that a source whose deliveries
    /// keep failing costs the other sources one purge, not one per round.
    alone: Option<std::time::Instant>,
    /// The Schema Registry of the registry formats.
    registry: Option<crate::schema::Registry>,
    /// How a round reads the table, once a connection has resolved the
    /// column map against it.
    statements: Option<Statements>,
}

/// A round's statements over the column map.
#[derive(Debug, Clone)]
struct Statements {
    /// The rows of a round, oldest first (`$1` rows, older than `$2`),
    /// each followed by its handle: `tableoid:ctid`.
    select: String,
    /// Reads its result rows.
    columns: OutboxColumns,
    /// Marks rows published: `$1` a table (a partition's) oid, `$2` the
    /// ctids of its rows. Rows are marked by where they are, which the
    /// round's row locks keep still: an id column need not be unique.
    mark: String,
    /// The age of the oldest unpublished row, in seconds.
    oldest: String,
}

impl Statements {
    /// Resolves the column map against the table; the table must give
    /// the order polling publishes in.
    async fn of(client: &impl GenericClient, v: &Validated, published: &str) -> Result<Self, PollingError> {
        let catalog = crate::source::outbox::read_table(client, &v.table).await?;
        let resolved = OutboxColumns::from_catalog(&v.table.to_string(), &catalog, &v.columns)?;
        let timestamp = resolved
            .role_column(Role::Timestamp)
            .ok_or_else(|| AdminError::NoColumn {
                table: v.table.to_string(),
                column: "created_at (columns.timestamp)",
            })?
            .to_owned();
        let quote = |n: &str| format!("\"{}\"", n.replace('"', "\"\""));
        let table = v.table.quoted().to_string();
        let (list, columns) = resolved.select();
        // A timestamp without a zone holds UTC.
        let ts_utc = match resolved.timestamp_kind() {
            Some(crate::source::outbox::Kind::Timestamp) => {
                format!("{} AT TIME ZONE 'UTC'", quote(&timestamp))
            }
            _ => quote(&timestamp),
        };
        Ok(Statements {
            oldest: format!(
                "SELECT EXTRACT(EPOCH FROM now() - MIN({ts_utc}))::float8 FROM {table} WHERE {published} IS NULL",
                published = quote(published)
            ),
            // o.<timestamp>, not the text output column of the same name:
            // only the table column uses the partial index.
            select: format!(
                "SELECT {list}, o.tableoid::oid::text || ':' || o.ctid::text
                   FROM {table} o WHERE o.{published} IS NULL AND o.{ts} < $2::timestamptz \
                  ORDER BY o.{ts}, o.ctid LIMIT $1 FOR UPDATE",
                ts = quote(&timestamp),
                published = quote(published)
            ),
            columns,
            mark: format!(
                "UPDATE {table} SET {published} = now() WHERE tableoid = $1::text::oid AND ctid = ANY($2::text[]::tid[])",
                published = quote(published)
            ),
        })
    }
}

impl std::fmt::Debug for PollingRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PollingRelay")
            .field("table", &self.validated.table)
            .finish()
    }
}

/// How one round ended.
struct Round {
    selected: usize,
    published: usize,
}

/// A row enqueued in a round: the row, where it is in the table, and
/// what was enqueued.
struct Pending {
    row: OutboxRow,
    handle: String,
    enqueued: Enqueued,
}

impl PollingRelay {
    /// A polling relay with Kafka clients of its own.
    pub fn new(
        config: Config,
        validated: Validated,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Result<Self, PollingError> {
        Self::with_clients(config, validated, metrics, health, KafkaClients::new())
    }

    /// A polling relay on the process's shared Kafka `clients`.
    pub fn with_clients(
        config: Config,
        validated: Validated,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        clients: Arc<KafkaClients>,
    ) -> Result<Self, PollingError> {
        let sink = Self::new_sink(&clients, &config, false, false)?;
        let registry = crate::schema::Registry::from_config(&config, Some((*metrics).clone()))
            .map_err(PollingError::RegistrySetup)?;
        if let Some(r) = &registry {
            health.show_schemas(r.board());
        }
        let election = LeaderElection::new(
            validated.pg.clone(),
            LeaderElection::polling_key(&validated.table.to_string()),
            config.postgres.leader_timeout.0,
        );
        Ok(PollingRelay {
            config,
            validated,
            clients,
            sink,
            metrics,
            health,
            election,
            watermark: Watermark::default(),
            isolate_until: None,
            alone: None,
            registry,
            statements: None,
        })
    }

    /// A sink on the shared producer (a new lane; one that had a fatal
    /// error is replaced), or, while a refused row is isolated, on a
    /// producer of its own that sends one record per batch: on a shared one
    /// another source's record could share the row's batch, and its refusal
    /// would not be the row's own.
    fn new_sink(
        clients: &KafkaClients,
        config: &Config,
        isolating: bool,
        alone: bool,
    ) -> Result<KafkaSink, KafkaSinkError> {
        let kind = SinkKind {
            fenced_by_lease: Some(config.postgres.leader_timeout.0),
            one_per_batch: isolating,
            own_producer: alone,
            ..SinkKind::default()
        };
        clients.sink(&config.kafka, config.kafka.admin_timeout.0, &kind)
    }

    /// Polls until shutdown or a definite error.
    pub async fn run(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), PollingError> {
        if let Some(registry) = &mut self.registry {
            registry.stop_on(shutdown.clone());
            registry.check_at_start().await.map_err(PollingError::Schema)?;
        }
        let mut client: Option<Client> = None;
        let mut backoff = Duration::from_millis(500);
        let mut announced_standby = false;
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            if !self.election.still_held() {
                // Whatever the last leader left half done is read again.
                client = None;
                match self.election.try_lead().await {
                    Ok(true) => {
                        if announced_standby {
                            tracing::info!(table = %self.validated.table, "the polling leader is gone; taking over");
                        }
                        announced_standby = false;
                        self.health.set_standby(false);
                    }
                    Ok(false) => {
                        if !announced_standby {
                            tracing::info!(table = %self.validated.table, "another outboxd polls this table; waiting as a hot standby");
                            announced_standby = true;
                        }
                        self.health.set_standby(true);
                        self.health.set_streaming(None);
                        self.wait(&mut shutdown, Duration::from_secs(1)).await;
                        continue;
                    }
                    Err(e) => {
                        self.health.set_streaming(None);
                        tracing::warn!(error = %e, retry_in = ?backoff, "cannot take the polling leader lock; retrying");
                        self.wait(&mut shutdown, backoff).await;
                        backoff = (backoff * 2).min(self.config.postgres.reconnect_backoff_max.0);
                        continue;
                    }
                }
            }
            if client.as_ref().is_none_or(Client::is_closed) {
                match self.connect().await {
                    // The column map must fit the table, and the table
                    // give the order polling publishes in.
                    Ok(c) => match self.check_table(&c).await {
                        Ok(statements) => {
                            self.statements = Some(statements);
                            client = Some(c);
                        }
                        Err(e) if e.is_transient() => {
                            tracing::warn!(error = %e, retry_in = ?backoff, "cannot read the outbox table's columns; retrying");
                            self.wait(&mut shutdown, backoff).await;
                            continue;
                        }
                        Err(e) => return Err(e),
                    },
                    Err(e) => {
                        self.health.set_streaming(None);
                        tracing::warn!(error = %e, retry_in = ?backoff, "cannot connect; retrying");
                        self.wait(&mut shutdown, backoff).await;
                        backoff = (backoff * 2).min(self.config.postgres.reconnect_backoff_max.0);
                        continue;
                    }
                }
            }
            let Some(c) = client.as_mut() else { continue };
            self.health.set_streaming(Some(0));
            match self.round(c).await {
                Ok(round) => {
                    backoff = Duration::from_millis(500);
                    self.report(c, round.published).await;
                    if round.selected < self.config.polling.batch_size {
                        self.wait(&mut shutdown, self.config.polling.interval.0).await;
                    }
                }
                Err(e) if e.is_purge() => {
                    tracing::debug!(error = %e, "the shared producer purged rows of this round; the next round sends them again");
                    continue;
                }
                Err(e) if e.is_transient() => {
                    self.metrics.reconnects.inc();
                    if matches!(e, PollingError::Kafka(_) | PollingError::BatchRefused { .. }) {
                        if self.alone.is_none() {
                            tracing::warn!("a delivery failed on the producer the sources share: this source sends on a producer of its own until a round publishes without a failure a minute later, so that further failures cost the other sources nothing");
                        }
                        self.alone = Some(std::time::Instant::now());
                    }
                    if let PollingError::BatchRefused { .. } = &e {
                        tracing::warn!(error = %e, "polling round stopped");
                        continue;
                    }
                    tracing::warn!(error = %e, retry_in = ?backoff, "polling round failed; retrying");
                    self.health.set_streaming(None);
                    client = None;
                    self.sink = Self::new_sink(
                        &self.clients,
                        &self.config,
                        self.isolate_until.is_some(),
                        self.alone.is_some(),
                    )?;
                    self.wait(&mut shutdown, backoff).await;
                    backoff = (backoff * 2).min(self.config.postgres.reconnect_backoff_max.0);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The table's shape, once per connection: the column map fits it,
    /// and it gives the order polling publishes in.
    async fn check_table(&self, client: &Client) -> Result<Statements, PollingError> {
        let published = &self.config.polling.published_column;
        let statements = Statements::of(client, &self.validated, published).await?;
        let timestamp = statements
            .columns
            .role_column(Role::Timestamp)
            .unwrap_or_default()
            .to_owned();
        admin::polling_table_problem(client, &self.validated.table, &timestamp, published).await?;
        Ok(statements)
    }

    /// The polling connection: a round's transaction that the leader
    /// leaves open (stopped, cut off) is ended by PostgreSQL within the
    /// lease, so its row locks never hold the next leader up.
    async fn connect(&self) -> Result<Client, AdminError> {
        let client = admin::connect(&self.validated.pg).await?;
        let lease = self.config.postgres.leader_timeout.0.as_millis().max(1);
        client
            .batch_execute(&format!("SET idle_in_transaction_session_timeout = {lease}"))
            .await?;
        Ok(client)
    }

    async fn wait(&self, shutdown: &mut watch::Receiver<bool>, d: Duration) {
        self.health.beat();
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = shutdown.changed() => {}
        }
    }

    async fn report(&self, client: &Client, published: usize) {
        self.metrics.events_published.inc_by(published as u64);
        if published > 0 {
            self.metrics.transactions.inc();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.metrics.last_ack_timestamp_seconds.set(now);
            self.health.acked_at(std::time::Instant::now());
        }
        if let Some(statements) = &self.statements {
            if let Ok(row) = client.query_one(&statements.oldest, &[]).await {
                let age: Option<f64> = row.get(0);
                self.metrics
                    .oldest_unpublished_seconds
                    .set(age.map_or(0.0, |s| s.max(0.0)));
            }
        }
        self.health.set_inflight(0, None);
        self.health.status_sent(0, 0, 0);
    }

    async fn round(&mut self, client: &mut Client) -> Result<Round, PollingError> {
        // One record per batch on a producer of its own while a refused
        // row is isolated, the shared producer otherwise.
        let isolating = self.isolate_until.is_some();
        let alone = self.alone.is_some();
        if self.sink.shares_producer() == (isolating || alone) {
            self.sink = Self::new_sink(&self.clients, &self.config, isolating, alone)?;
        }
        // The last round heard every report of what it sent, and sent
        // again nothing purged: this round may send on the producer's
        // current generation.
        let generation = self.sink.quiet_generation().await;
        self.sink.adopt(generation);
        let tx = client.transaction().await?;
        // created_at::text follows DateStyle; a role or database default
        // such as 'SQL, DMY' must not change what outboxd reads.
        tx.batch_execute("SET LOCAL DateStyle = 'ISO'; SET LOCAL TimeZone = 'UTC'")
            .await?;
        let sample = tx
            .query_one(
                "SELECT clock_timestamp(), pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint
                   FROM pg_current_snapshot() s",
                &[],
            )
            .await?;
        let Some(watermark) = self
            .watermark
            .observe(sample.get(0), sample.get(2), sample.get(1))
        else {
            tracing::debug!("a transaction older than outboxd's first sample still runs: waiting for it before publishing, so that none of its rows is passed over");
            tx.commit().await?;
            return Ok(Round {
                selected: 0,
                published: 0,
            });
        };
        // The table as it is now: its columns cannot change until the
        // round ends (ALTER TABLE waits for this lock), so no row is read
        // as a type it no longer has.
        tx.batch_execute(&format!(
            "LOCK TABLE {} IN ACCESS SHARE MODE",
            self.validated.table.quoted()
        ))
        .await?;
        let statements = Statements::of(&tx, &self.validated, &self.config.polling.published_column).await?;
        let handle_at = statements.columns.width();
        let rows = tx
            .query(
                &statements.select,
                &[&(self.config.polling.batch_size as i64), &watermark],
            )
            .await?;
        let selected = rows.len();
        let mut published: Vec<String> = Vec::with_capacity(selected);
        let mut pending: Vec<Pending> = Vec::with_capacity(selected);
        let mut failure: Option<PollingError> = None;
        for r in &rows {
            let row = match statements.columns.from_result(r) {
                Ok(row) => row,
                Err(e) => {
                    failure = Some(PollingError::Row(e));
                    break;
                }
            };
            let handle: String = r.get(handle_at);
            // One at a time up to the row Kafka refused in a batch, so that
            // a refusal now is the row's own.
            let alone = self.isolate_until.is_some();
            // No record goes to Kafka without a fresh lease: a leader that
            // was frozen mid-round stops here; a standby took its rows.
            if !self.election.still_held() {
                failure = Some(PollingError::LeadershipLost);
                break;
            }
            let enqueued = match self.enqueue(&row).await {
                Ok(e) => e,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            pending.push(Pending {
                row,
                handle,
                enqueued,
            });
            if alone {
                if let Err(e) = self.settle(&mut pending, &mut published, true).await {
                    failure = Some(e);
                    break;
                }
                if pending.is_empty() && self.isolate_until.as_ref() == published.last() {
                    tracing::info!("past the row Kafka refused; sending in batches again");
                    self.isolate_until = None;
                }
            }
        }
        if failure.is_none() {
            if let Err(e) = self.settle(&mut pending, &mut published, false).await {
                failure = Some(e);
            }
        } else {
            // Wait for what was sent. After a purge of the shared producer
            // (another source failed) the stored prefix is marked, as
            // `settle` marks it; the rest goes again next round. After a
            // failure of this round's own, none is marked.
            let mut prefix = matches!(failure, Some(PollingError::Kafka(KafkaSinkError::Purged)));
            for p in pending.drain(..) {
                let report = p.enqueued.into_future().await;
                self.count_purged(&report);
                prefix &= matches!(report, Report::Stored { .. });
                if prefix {
                    published.push(p.handle);
                    continue;
                }
                name_the_failure(&mut failure, &mut self.isolate_until, p.row.id, p.handle, report);
            }
        }
        for (table, ctids) in by_table(&published) {
            tx.execute(&statements.mark, &[&table.to_string(), &ctids])
                .await?;
        }
        tx.commit().await?;
        if self.isolate_until.is_some() && failure.is_none() {
            // The refused row was not selected again (published meanwhile,
            // or deleted): nothing is left to isolate.
            self.isolate_until = None;
        }
        let quiet = self
            .alone
            .is_some_and(|t| t.elapsed() >= crate::relay::ALONE_QUIET);
        if quiet && failure.is_none() && !published.is_empty() {
            // Every report heard: the next round goes back to the shared
            // producer with nothing in flight.
            tracing::info!("a round published without a failure; sending on the shared producer again");
            self.alone = None;
        }
        if let Some(e) = failure {
            self.metrics.error(match &e {
                PollingError::Kafka(k) => k.reason(),
                PollingError::BatchRefused { .. } => "batch_refused",
                PollingError::LeadershipLost => "postgres_stream",
                PollingError::Poison(_) | PollingError::Row(_) => "poison",
                PollingError::Schema(_) => "schema_registry",
                PollingError::RegistrySetup(_) | PollingError::Mapping(_) => "config",
                PollingError::Admin(_) => "postgres_stream",
            });
            return Err(e);
        }
        Ok(Round {
            selected,
            published: published.len(),
        })
    }

    /// A row the shared producer purged unsent: the next round sends it
    /// again (`outboxd_resent_records_total`).
    fn count_purged(&self, report: &Report) {
        if report.was_purged_unsent() && self.sink.shares_producer() {
            self.metrics.resent_records.inc();
        }
    }

    /// The record of `row`, or its dead letter.
    async fn enqueue(&mut self, row: &OutboxRow) -> Result<Enqueued, PollingError> {
        // No commit time here: a created_at Kafka cannot take gets the
        // time of publishing.
        let now_ms = chrono::Utc::now().timestamp_millis();
        let mut record = build_record(row, &self.validated.topic, &self.validated.value, now_ms);
        if let Some(registry) = self.registry.as_mut() {
            // The row was written by created_at (polling has no commit time).
            let written_ms = row
                .created_at
                .rfc3339()
                .map_or(now_ms, chrono::DateTime::timestamp_millis);
            record = registry
                .prepare(record, row, written_ms.min(now_ms))
                .await
                .map_err(PollingError::Schema)?;
        }
        let enqueued = enqueue_row(&mut self.sink, &self.config.routing, row, record).await?;
        if let Enqueued::DeadLetter(_, reason) = &enqueued {
            self.metrics.dead_letters.with_label_values(&[reason]).inc();
        }
        Ok(enqueued)
    }

    /// Takes the acknowledgements of `pending` in row order, adding each
    /// acknowledged row to `published`; stops at the first failure. `alone`:
    /// the rows were sent one at a time, so a refusal is the row's own and
    /// follows `routing.on_poison`.
    async fn settle(
        &mut self,
        pending: &mut Vec<Pending>,
        published: &mut Vec<String>,
        alone: bool,
    ) -> Result<(), PollingError> {
        let mut failure = None;
        for Pending {
            row,
            handle,
            enqueued,
        } in pending.drain(..)
        {
            let dead = match &enqueued {
                Enqueued::DeadLetter(_, reason) => Some(*reason),
                Enqueued::Record(_) => None,
            };
            let report = enqueued.into_future().await;
            self.count_purged(&report);
            if failure.is_some() {
                name_the_failure(
                    &mut failure,
                    &mut self.isolate_until,
                    row.id.clone(),
                    handle,
                    report,
                );
                continue;
            }
            let (source, msg) = match report {
                Report::Stored { .. } => {
                    published.push(handle);
                    continue;
                }
                Report::Failed(source, msg) => (source, msg),
                other => {
                    failure = other.into_result().err().map(PollingError::Kafka);
                    continue;
                }
            };
            match (Refusal::of(&source), dead) {
                (Refusal::Record { reason, .. }, None) if alone => {
                    tracing::warn!(id = %row.id, error = %source, "Kafka refused an outbox row on its own");
                    let error = format!("Kafka refused it: {source}");
                    let dl =
                        set_aside(&mut self.sink, &self.config.routing, &row, reason, error.clone()).await?;
                    self.metrics.dead_letters.with_label_values(&[reason]).inc();
                    if let Err(e) = self
                        .stored_or_stub(dl, (&row, &handle), reason, error, published, false)
                        .await
                    {
                        failure = Some(e);
                    }
                }
                // A dead letter the broker refused (the row's headers
                // travel with it): its stub, once the refusal is its own.
                (Refusal::Record { .. }, Some(reason)) if alone => {
                    let error = format!("its dead letter was refused: {source}");
                    let stub = set_aside_as_stub(
                        &mut self.sink,
                        &self.config.routing,
                        &row,
                        reason,
                        error,
                        &source.to_string(),
                    )
                    .await?;
                    if let Err(e) = self
                        .stored_or_stub(stub, (&row, &handle), reason, source.to_string(), published, true)
                        .await
                    {
                        failure = Some(e);
                    }
                }
                (Refusal::Record { .. }, _) => {
                    self.isolate_until = Some(handle);
                    failure = Some(PollingError::BatchRefused {
                        id: row.id.clone(),
                        source,
                    });
                }
                _ => {
                    failure = Some(PollingError::Kafka(KafkaSinkError::Delivery {
                        topic: rdkafka::message::Message::topic(&msg).to_owned(),
                        source,
                    }));
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Awaits a row's dead letter (or its stub): stored, the row counts as
    /// published; a dead letter refused goes again as its stub; a stub
    /// refused stops polling, naming the row.
    async fn stored_or_stub(
        &mut self,
        sent: Enqueued,
        (row, handle): (&OutboxRow, &str),
        reason: &'static str,
        error: String,
        published: &mut Vec<String>,
        stubbed: bool,
    ) -> Result<(), PollingError> {
        let (mut sent, mut stubbed) = (sent, stubbed);
        loop {
            match sent.into_future().await {
                Report::Stored { .. } => {
                    published.push(handle.to_owned());
                    return Ok(());
                }
                Report::Failed(e, _) if Refusal::of(&e) != Refusal::Transient => {
                    if stubbed {
                        return Err(PollingError::Poison(EnqueueError::Poison {
                            id: row.id.clone(),
                            error: format!(
                                "{error}; its dead letter and that dead letter's stub were refused too ({e})"
                            ),
                        }));
                    }
                    stubbed = true;
                    sent = set_aside_as_stub(
                        &mut self.sink,
                        &self.config.routing,
                        row,
                        reason,
                        error.clone(),
                        &e.to_string(),
                    )
                    .await?;
                }
                other => return other.into_result().map(|_| ()).map_err(PollingError::Kafka),
            }
        }
    }
}

/// A round ends at its first failure in row order, but a purge is not
/// what to report when a later record (of row `id`) failed on its own:
/// that failure caused the purge. The round then backs off, isolates a
/// refused row, or stops, as that failure calls for (an error that stops
/// polling is never retried at once for ever).
fn name_the_failure(
    failure: &mut Option<PollingError>,
    isolate_until: &mut Option<String>,
    id: String,
    handle: String,
    later: Report,
) {
    if !failure.as_ref().is_some_and(PollingError::is_purge) || !later.is_failure() {
        return;
    }
    *failure = match later {
        Report::Failed(source, _) if matches!(Refusal::of(&source), Refusal::Record { .. }) => {
            *isolate_until = Some(handle);
            Some(PollingError::BatchRefused { id, source })
        }
        other => other.into_result().err().map(PollingError::Kafka),
    };
}

/// Row handles (`tableoid:ctid`) grouped by table: a partitioned outbox's
/// rows are marked partition by partition.
fn by_table(handles: &[String]) -> Vec<(u32, Vec<String>)> {
    let mut out: Vec<(u32, Vec<String>)> = Vec::new();
    for h in handles {
        let Some((table, ctid)) = h.split_once(':') else {
            continue;
        };
        let Ok(table) = table.parse::<u32>() else { continue };
        match out.iter_mut().find(|(t, _)| *t == table) {
            Some((_, ctids)) => ctids.push(ctid.to_owned()),
            None => out.push((table, vec![ctid.to_owned()])),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(s, 0).unwrap_or_default()
    }

    #[test]
    fn the_watermark_never_passes_a_running_transaction() {
        let mut w = Watermark::default();
        // A transaction (id 100) runs from before the first sample.
        assert_eq!(w.observe(at(10), 105, 100), None);
        assert_eq!(w.observe(at(11), 107, 100), None, "it still runs");
        // It ended; the oldest running is now 106 (got its id after the
        // sample at 10, whose next id was 105).
        assert_eq!(w.observe(at(12), 109, 106), Some(at(10)));
        // Nothing runs: the newest sample is the watermark.
        assert_eq!(w.observe(at(13), 110, 110), Some(at(13)));
        assert_eq!(w.samples.len(), 1);
    }

    #[test]
    fn a_long_transaction_keeps_the_history_bounded() {
        let mut w = Watermark::default();
        assert_eq!(w.observe(at(0), 10, 10), Some(at(0)));
        for i in 1..10_000 {
            // Transaction 10 runs throughout.
            assert_eq!(w.observe(at(i), 10 + i, 10), Some(at(0)));
            assert!(w.samples.len() <= MAX_SAMPLES + 1);
        }
        // It ends: a later sample qualifies, never one past the running one.
        let mark = w.observe(at(10_000), 10_010, 5_000).unwrap();
        assert!(mark <= at(4_990), "{mark}");
    }
}
