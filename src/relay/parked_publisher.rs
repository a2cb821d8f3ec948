//! Publishing parked events: the `outboxd parked redrive` command's and
//! the relay's handback's one way to send a sequence's rows to Kafka.
//!
//! * At-least-once: one record at a time; its row is deleted once Kafka
//!   acknowledged it. One record in flight means a refusal is known
//!   before the next record of the sequence is sent, so nothing is
//!   published past a head that still fails.
//! * Exactly-once: a batch of records and a marker (the last position, in
//!   the progress topic under `parked-redrive/<slot>`) go in one Kafka
//!   transaction of a producer of its own (`<transactional id>.redrive`
//!   for the command, `<transactional id>.handback` for the relay, so
//!   that neither fences the other); the rows are deleted after it
//!   committed. A crash between the two is finished by the next publisher
//!   of either ([`Publisher::finish_committed`] applies both markers),
//!   which deletes what a marker covers without publishing it again.
//!
//! Two publishers never work on one sequence at once: each holds the
//! sequence's lock ([`ParkStore::lock_sequence`]) while it publishes.
//!
//! A record that cannot be built or that Kafka refuses for good stops the
//! sequence there: the event becomes its head, with the reason of today.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{Config, Delivery, Validated};
use crate::kafka::records::{build_record, KafkaRecord};
use crate::kafka::sink::{KafkaSink, KafkaSinkError, SendOutcome, SinkKind};
use crate::lsn::RowPos;
use crate::park::{ParkError, ParkStore, ParkedEvent, ParkedRow};
use crate::relay::exactly_once::{self, Isolation};

/// The header a redriven record carries: when the redrive started.
pub const REDRIVEN: &str = "redriven";

/// Rows read, and (exactly-once) published per Kafka transaction.
pub const BATCH: i64 = 500;

/// Why publishing parked events failed (not a refusal of a record: that
/// stops its sequence, see [`Failed`]).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Park(#[from] ParkError),
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    #[error(transparent)]
    Progress(#[from] exactly_once::ProgressError),
    #[error(transparent)]
    Schema(#[from] crate::schema::SchemaError),
    #[error("schema_registry: {0}")]
    RegistrySetup(String),
}

/// Who publishes parked events: each has its own transactional id and
/// marker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Publishing {
    /// `outboxd parked redrive` and `skip`.
    Redrive,
    /// The relay, for a sequence a redrive handed back.
    Handback,
}

impl Publishing {
    fn name(self) -> &'static str {
        match self {
            Publishing::Redrive => "redrive",
            Publishing::Handback => "handback",
        }
    }
}

/// The progress-topic key of a role's marker.
fn marker_key(role: Publishing, slot: &str) -> String {
    format!("parked-{}/{slot}", role.name())
}

/// Publishes parked events: a plain idempotent producer, or (exactly-once)
/// a transactional one of its own.
pub struct Publisher {
    sink: KafkaSink,
    config: Config,
    validated: Validated,
    registry: Option<crate::schema::Registry>,
    exactly_once: bool,
    started_at: String,
    marker_key: String,
    /// Exactly-once: one record per Kafka transaction, after Kafka refused
    /// a transaction of several (the refusal may have been a batch's).
    one_by_one: bool,
    /// What the table says of its columns today (which roles it has, and
    /// for `connect-json` their types); a parked row does not keep it.
    facts: Option<std::sync::Arc<crate::source::outbox::ColumnFacts>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("exactly_once", &self.exactly_once)
            .field("one_by_one", &self.one_by_one)
            .finish_non_exhaustive()
    }
}

/// The marker of an exactly-once redrive: the sequence and the last
/// position its committed Kafka transaction holds.
#[derive(Debug, Serialize, Deserialize)]
struct Marker {
    topic: String,
    key: String,
    lsn: String,
    index: u32,
    /// The id of the event at that position: a marker is only ever applied
    /// to the row it was written for (a restored database may park other
    /// events at the same positions).
    id: String,
}

impl Publisher {
    pub async fn new(config: &Config, validated: &Validated, role: Publishing) -> Result<Self, PublishError> {
        let exactly_once = config.kafka.delivery == Delivery::ExactlyOnce;
        let kind = SinkKind {
            transactional_id: validated
                .transactional_id
                .as_ref()
                .filter(|_| exactly_once)
                .map(|id| format!("{id}.{}", role.name())),
            ..SinkKind::default()
        };
        let sink = KafkaSink::build(&config.kafka, config.kafka.admin_timeout.0, &kind)?;
        if exactly_once {
            sink.init_transactions(config.kafka.exactly_once.commit_timeout.0)
                .await?;
        }
        let registry =
            crate::schema::Registry::from_config(config, None).map_err(PublishError::RegistrySetup)?;
        let facts = {
            let client = crate::postgres::admin::connect(&validated.pg)
                .await
                .map_err(ParkError::Admin)?;
            let catalog = crate::source::outbox::read_table(&client, &validated.table)
                .await
                .map_err(ParkError::Admin)?;
            let resolved = crate::source::outbox::OutboxColumns::from_catalog(
                &validated.table.to_string(),
                &catalog,
                &validated.columns,
            )
            .map_err(|e| ParkError::Unreadable(e.to_string()))?;
            Some(std::sync::Arc::new(resolved.facts()))
        };
        Ok(Publisher {
            sink,
            config: config.clone(),
            validated: validated.clone(),
            registry,
            exactly_once,
            started_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            marker_key: marker_key(role, validated.slot.as_str()),
            one_by_one: false,
            facts,
        })
    }

    /// The record of a parked event under today's configuration, or why
    /// it still cannot be published (reason, error).
    async fn record(
        &mut self,
        ev: &ParkedEvent,
    ) -> Result<Result<KafkaRecord, (String, String)>, PublishError> {
        let ParkedRow::Row(row) = &ev.row else {
            return Ok(Err((
                "unreadable".into(),
                format!("{} (an unreadable row is never redriven: `outboxd parked skip --id {}` sends it to the dead-letter topic)", ev.error, ev.id()),
            )));
        };
        let commit_ms = row.created_at.rfc3339().map_or_else(
            || chrono::Utc::now().timestamp_millis(),
            chrono::DateTime::timestamp_millis,
        );
        let mut row = row.clone();
        if row.facts.is_none() {
            row.facts.clone_from(&self.facts);
        }
        let row = &row;
        let mut built = build_record(row, &self.validated.topic, &self.validated.value, commit_ms);
        if let Some(registry) = self.registry.as_mut() {
            built = registry.prepare(built, row, commit_ms).await?;
        }
        Ok(match built {
            Ok(mut rec) => {
                rec.headers.retain(|(k, _)| k != REDRIVEN);
                rec.headers
                    .push((REDRIVEN.into(), self.started_at.as_bytes().to_vec()));
                Ok(rec)
            }
            Err(e) => Err((e.reason().to_owned(), e.to_string())),
        })
    }

    /// Sends a record, waiting while the queue is full.
    async fn send(&mut self, rec: &KafkaRecord) -> Result<crate::kafka::delivery::Awaited, KafkaSinkError> {
        self.sink.ensure_topic(&rec.topic).await?;
        loop {
            match self.sink.send(rec)? {
                SendOutcome::Sent(f) => return Ok(f),
                SendOutcome::QueueFull => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    }

    /// Exactly-once: finishes an earlier redrive that committed its Kafka
    /// transaction but did not delete its rows.
    pub async fn finish_committed(&mut self, store: &ParkStore) -> Result<(), PublishError> {
        if !self.exactly_once {
            return Ok(());
        }
        for role in [Publishing::Redrive, Publishing::Handback] {
            self.apply_marker(store, &marker_key(role, store.slot())).await?;
        }
        Ok(())
    }

    /// Deletes what the latest committed marker under `key` covers.
    async fn apply_marker(&self, store: &ParkStore, key: &str) -> Result<(), PublishError> {
        let topic = self.config.kafka.progress_topic().to_owned();
        let value = exactly_once::read_latest(
            &self.config.kafka,
            &topic,
            key,
            Isolation::ReadCommitted,
            self.config.kafka.admin_timeout.0,
        )
        .await?;
        let Some(marker) = value.and_then(|v| serde_json::from_slice::<Marker>(&v).ok()) else {
            return Ok(());
        };
        let Ok(lsn) = marker.lsn.parse() else {
            return Ok(());
        };
        let through = RowPos {
            commit_lsn: lsn,
            index: marker.index,
        };
        // Applied already, or written for another history: nothing to do.
        match store.at(through).await? {
            Some(ev) if ev.id() == marker.id && ev.topic == marker.topic && ev.key == marker.key => {}
            _ => return Ok(()),
        }
        let n = store.delete_through(&marker.topic, &marker.key, through).await?;
        if n > 0 {
            tracing::info!(topic = marker.topic, key = marker.key, events = n, "an earlier redrive published these in a committed Kafka transaction: deleted them, not published again");
        }
        Ok(())
    }
}

/// A sequence's head that failed again under today's configuration: it
/// stays parked with this reason, one more attempt counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failed {
    pub id: String,
    pub reason: String,
    pub error: String,
}

impl Publisher {
    /// Publishes `events` (in position order, all of the sequence
    /// `topic`/`key`) and deletes their rows; `Some` when one failed and
    /// became the head (what precedes it is published). Returns, with it,
    /// how many were published; exactly-once, after a refused transaction
    /// of several, possibly none, and the next call goes one by one.
    pub async fn publish(
        &mut self,
        store: &mut ParkStore,
        topic: &str,
        key: &str,
        events: &[&ParkedEvent],
    ) -> Result<(u64, Option<Failed>), PublishError> {
        let events = if self.one_by_one {
            &events[..events.len().min(1)]
        } else {
            events
        };
        let mut published = 0;
        let failed = if self.exactly_once {
            publish_in_transaction(store, self, topic, key, events, &mut published).await?
        } else {
            publish_one_by_one(store, self, events, &mut published).await?
        };
        Ok((published, failed))
    }
}

/// At-least-once: each record acknowledged before the next is sent, its
/// row deleted after.
async fn publish_one_by_one(
    store: &mut ParkStore,
    p: &mut Publisher,
    events: &[&ParkedEvent],
    published: &mut u64,
) -> Result<Option<Failed>, PublishError> {
    for ev in events {
        let rec = match p.record(ev).await? {
            Ok(rec) => rec,
            Err((reason, error)) => return failed(store, ev, reason, error).await,
        };
        let report = match p.send(&rec).await {
            Ok(f) => f.await,
            Err(KafkaSinkError::Produce { source, topic }) => {
                return refused(store, ev, &source, &topic).await;
            }
            Err(e) => return Err(e.into()),
        };
        match report {
            crate::kafka::delivery::Report::Failed(source, _)
                if matches!(
                    crate::kafka::sink::Refusal::of(&source),
                    crate::kafka::sink::Refusal::Record { .. }
                ) =>
            {
                return refused(store, ev, &source, &rec.topic).await;
            }
            report => {
                report.into_result()?;
            }
        }
        store.delete(ev).await?;
        *published += 1;
    }
    Ok(None)
}

/// Exactly-once: the events and the marker in one Kafka transaction; the
/// rows deleted once it committed.
async fn publish_in_transaction(
    store: &mut ParkStore,
    p: &mut Publisher,
    topic: &str,
    key: &str,
    events: &[&ParkedEvent],
    published: &mut u64,
) -> Result<Option<Failed>, PublishError> {
    let mut records = Vec::with_capacity(events.len());
    let mut stopped = None;
    for ev in events {
        match p.record(ev).await? {
            Ok(rec) => records.push((ev, rec)),
            Err((reason, error)) => {
                // Publish what precedes it; it becomes the head.
                stopped = Some((ev, reason, error));
                break;
            }
        }
    }
    if let Some((last, _)) = records.last() {
        let marker = Marker {
            topic: topic.to_owned(),
            key: key.to_owned(),
            lsn: last.pos.commit_lsn.to_string(),
            index: last.pos.index,
            id: last.id(),
        };
        let marker = KafkaRecord {
            topic: p.config.kafka.progress_topic().to_owned(),
            key: p.marker_key.clone().into_bytes(),
            value: Some(serde_json::to_vec(&marker).unwrap_or_default()),
            headers: Vec::new(),
            timestamp_ms: chrono::Utc::now().timestamp_millis(),
            partition: None,
        };
        let timeout = p.config.kafka.exactly_once.commit_timeout.0;
        let alone = records.len() == 1;
        let mut futures = Vec::with_capacity(records.len() + 1);
        for (ev, rec) in &records {
            match p.send(rec).await {
                Ok(f) => futures.push(f),
                Err(KafkaSinkError::Produce { source, topic }) => {
                    p.sink.abort_transaction(timeout).await?;
                    return again_alone(store, p, ev, &source, &topic, alone).await;
                }
                Err(e) => {
                    // Not left open: it would hold read_committed consumers
                    // of its partitions until the next publisher fences it.
                    if let Err(abort) = p.sink.abort_transaction(timeout).await {
                        tracing::warn!(error = %abort, "could not abort the redrive's Kafka transaction; the next redrive or handback fences it");
                    }
                    return Err(e.into());
                }
            }
        }
        match p.send(&marker).await {
            Ok(f) => futures.push(f),
            Err(e) => {
                p.sink.abort_transaction(timeout).await?;
                return Err(e.into());
            }
        }
        for (i, f) in futures.into_iter().enumerate() {
            match (f.await, records.get(i)) {
                (crate::kafka::delivery::Report::Failed(source, _), Some((ev, rec)))
                    if matches!(
                        crate::kafka::sink::Refusal::of(&source),
                        crate::kafka::sink::Refusal::Record { .. }
                    ) =>
                {
                    p.sink.abort_transaction(timeout).await?;
                    return again_alone(store, p, ev, &source, &rec.topic, alone).await;
                }
                (report, _) => {
                    if let Err(e) = report.into_result() {
                        p.sink.abort_transaction(timeout).await?;
                        return Err(e.into());
                    }
                }
            }
        }
        p.sink
            .start_commit(p.config.kafka.exactly_once.commit_timeout.0)
            .await
            .map_err(|_| KafkaSinkError::Canceled)??;
        store.delete_through(topic, key, last.pos).await?;
        *published += records.len() as u64;
    }
    match stopped {
        Some((ev, reason, error)) => failed(store, ev, reason, error).await,
        None => Ok(None),
    }
}

/// Kafka refused a record of an exactly-once redrive's transaction, which
/// was aborted. Alone in it, the refusal is the record's own; among
/// others, it may be a batch's: the redrive goes on one record per
/// transaction, and finds out.
async fn again_alone(
    store: &mut ParkStore,
    p: &mut Publisher,
    ev: &ParkedEvent,
    source: &rdkafka::error::KafkaError,
    topic: &str,
    alone: bool,
) -> Result<Option<Failed>, PublishError> {
    if alone {
        return refused(store, ev, source, topic).await;
    }
    tracing::info!(error = %source, "Kafka refused a redrive's transaction; going on one record per transaction");
    p.one_by_one = true;
    Ok(None)
}

/// The head failed again under today's configuration.
async fn failed(
    store: &mut ParkStore,
    ev: &ParkedEvent,
    reason: String,
    error: String,
) -> Result<Option<Failed>, PublishError> {
    store.failed(ev, &reason, &error).await?;
    Ok(Some(Failed {
        id: ev.id(),
        reason,
        error,
    }))
}

/// Kafka refused the head's record; a refusal of the broker or the
/// cluster (not the record's) is an error of the redrive instead.
async fn refused(
    store: &mut ParkStore,
    ev: &ParkedEvent,
    source: &rdkafka::error::KafkaError,
    topic: &str,
) -> Result<Option<Failed>, PublishError> {
    match crate::kafka::sink::Refusal::of(source) {
        crate::kafka::sink::Refusal::Record { reason, .. } => {
            failed(
                store,
                ev,
                reason.to_owned(),
                format!("Kafka refused it for topic {topic:?}: {source}"),
            )
            .await
        }
        _ => Err(KafkaSinkError::Delivery {
            topic: topic.to_owned(),
            source: source.clone(),
        }
        .into()),
    }
}
