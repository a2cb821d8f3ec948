//! Polling mode (`mode = "polling"`): seed 000's relay, for databases where
//! logical replication is not available.
//!
//! Each round, in one transaction:
//!
//! 1. `SELECT … FROM outbox WHERE published_at IS NULL ORDER BY created_at
//!    LIMIT n FOR UPDATE SKIP LOCKED`: several instances may run at once,
//!    and none takes a row another holds;
//! 2. every row becomes a record exactly as in CDC mode and is enqueued at
//!    once (no waiting between sends);
//! 3. acknowledgements are taken in row order; the round stops at its first
//!    failure, so no later event of an aggregate is marked ahead of an
//!    earlier one (the seed's rule);
//! 4. `UPDATE … SET published_at = now()` for the acknowledged prefix, and
//!    commit. The rest is picked up again next round.
//!
//! A full batch starts the next round at once; a short one waits
//! `polling.interval`. The age of the oldest unpublished row (the seed's
//! monitoring query) is exported as `outboxd_oldest_unpublished_seconds`.
//! Rows that can never be published follow `routing.on_poison` like CDC
//! mode: `stop` halts, `dead-letter` sets them aside and marks them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::config::{Config, Validated};
use crate::enqueue::{enqueue_row, EnqueueError, Enqueued};
use crate::health::Health;
use crate::kafka::{KafkaSink, KafkaSinkError};
use crate::metrics::Metrics;
use crate::outbox::{OutboxRow, TABLE_COLUMNS};
use crate::pg::admin::{self, AdminError};
use crate::routing::build_record;

/// Why polling stopped or a round failed.
#[derive(Debug, thiserror::Error)]
pub enum PollingError {
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    #[error(transparent)]
    Poison(EnqueueError),
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
    fn is_transient(&self) -> bool {
        match self {
            PollingError::Admin(AdminError::Connect { .. } | AdminError::Query(_)) => true,
            PollingError::Admin(_) => false,
            PollingError::Kafka(e) => e.is_transient(),
            PollingError::Poison(_) => false,
        }
    }
}

impl From<tokio_postgres::Error> for PollingError {
    fn from(e: tokio_postgres::Error) -> Self {
        PollingError::Admin(AdminError::Query(e))
    }
}

/// The polling relay.
pub struct PollingRelay {
    config: Config,
    validated: Validated,
    sink: KafkaSink,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
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

impl PollingRelay {
    pub fn new(
        config: Config,
        validated: Validated,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Result<Self, PollingError> {
        let sink = KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0)?;
        Ok(PollingRelay {
            config,
            validated,
            sink,
            metrics,
            health,
        })
    }

    /// Polls until shutdown or a definite error.
    pub async fn run(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), PollingError> {
        let mut client: Option<Client> = None;
        let mut backoff = Duration::from_millis(500);
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            if client.as_ref().is_none_or(Client::is_closed) {
                match admin::connect(&self.validated.pg).await {
                    Ok(c) => client = Some(c),
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
                Err(e) if e.is_transient() => {
                    self.metrics.reconnects.inc();
                    tracing::warn!(error = %e, retry_in = ?backoff, "polling round failed; retrying");
                    self.health.set_streaming(None);
                    client = None;
                    self.sink = KafkaSink::new(&self.config.kafka, self.config.kafka.admin_timeout.0)?;
                    self.wait(&mut shutdown, backoff).await;
                    backoff = (backoff * 2).min(self.config.postgres.reconnect_backoff_max.0);
                }
                Err(e) => return Err(e),
            }
        }
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
        if let Ok(age) = outbox_sdk::retention::oldest_unpublished_age(client, &self.validated.table).await {
            self.metrics
                .oldest_unpublished_seconds
                .set(age.map_or(0.0, |d| d.as_secs_f64()));
        }
        self.health.set_inflight(0, None);
        self.health.status_sent(0, 0, 0);
    }

    async fn round(&mut self, client: &mut Client) -> Result<Round, PollingError> {
        let table = self.validated.table.quoted().to_string();
        let tx = client.transaction().await?;
        // created_at::text follows DateStyle; a role or database default
        // such as 'SQL, DMY' must not change what outboxd reads.
        tx.batch_execute("SET LOCAL DateStyle = 'ISO'; SET LOCAL TimeZone = 'UTC'")
            .await?;
        let rows = tx
            .query(
                &format!(
                    // o.created_at, not the text output column of the same
                    // name: only the table column uses the partial index.
                    "SELECT {TABLE_COLUMNS}
                       FROM {table} o WHERE o.published_at IS NULL
                      ORDER BY o.created_at LIMIT $1 FOR UPDATE SKIP LOCKED"
                ),
                &[&(self.config.polling.batch_size as i64)],
            )
            .await?;
        let selected = rows.len();
        let mut pending = Vec::with_capacity(selected);
        for r in &rows {
            let row = OutboxRow::from_table(r);
            let id = row.id;
            // No commit time here: a created_at Kafka cannot take gets the
            // time of publishing.
            let now_ms = chrono::Utc::now().timestamp_millis();
            let record = build_record(&row, &self.validated.topic, &self.validated.value, now_ms);
            let fut = match enqueue_row(&mut self.sink, &self.config.routing, &row, record).await? {
                Enqueued::Record(f) => f,
                Enqueued::DeadLetter(f, reason) => {
                    self.metrics.dead_letters.with_label_values(&[reason]).inc();
                    f
                }
            };
            pending.push((id, fut));
        }
        // Acknowledgements in row order; stop at the first failure.
        let mut published: Vec<Uuid> = Vec::with_capacity(selected);
        let mut failure = None;
        for (id, fut) in pending {
            match fut.await {
                Ok(Ok(_)) if failure.is_none() => published.push(id),
                Ok(Ok(_)) => {}
                Ok(Err((source, msg))) => {
                    failure.get_or_insert(KafkaSinkError::Delivery {
                        topic: rdkafka::message::Message::topic(&msg).to_owned(),
                        source,
                    });
                }
                Err(_) => {
                    failure.get_or_insert(KafkaSinkError::Canceled);
                }
            }
        }
        if !published.is_empty() {
            tx.execute(
                &format!("UPDATE {table} SET published_at = now() WHERE id = ANY($1)"),
                &[&published],
            )
            .await?;
        }
        tx.commit().await?;
        if let Some(e) = failure {
            self.metrics.error(e.reason());
            return Err(e.into());
        }
        Ok(Round {
            selected,
            published: published.len(),
        })
    }
}
