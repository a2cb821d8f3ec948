//! `outboxd parked`: list, show, redrive, skip and discard parked
//! sequences (see [`crate::park`] for how events get there).
//!
//! # Redrive
//!
//! A sequence is re-published in position order, each record built anew
//! from the parked row under today's configuration (so a fixed cause, a
//! raised `max.message.bytes`, an allowed aggregate type, a new schema
//! version, now lets the head through), with a `redriven` header.
//!
//! * At-least-once: one record at a time; its row is deleted once Kafka
//!   acknowledged it. One record in flight means a refusal is known
//!   before the next record of the sequence is sent, so nothing is
//!   published past a head that still fails.
//! * Exactly-once: a batch of records and a marker (the last position, in
//!   the progress topic under `parked-redrive/<slot>`) go in one Kafka
//!   transaction; the rows are deleted after it committed. A crash between
//!   the two is finished by the next redrive, which reads the marker and
//!   deletes what it covers without publishing it again.
//!
//! Only rows whose transaction the slot has durably passed are redriven
//! (see [`ParkStore::durably_passed`]; a replay of the WAL could otherwise
//! bring a redriven event back): a redrive waits, up to `--wait`, for the
//! relay to confirm them and the slot's `restart_lsn` to follow. The
//! header goes last (see [`ParkStore::release`]), so events the relay
//! parks meanwhile are redriven after the others, and events after the
//! release are the relay's to publish.
//!
//! A head that fails again stays parked with the reason of today, its
//! attempts counted; the redrive of that sequence stops there.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{Config, Delivery, Validated};
use crate::kafka::records::{
    build_record, dead_letter_for_row, dead_letter_for_unreadable, KafkaRecord, Poison,
};
use crate::kafka::sink::{KafkaSink, KafkaSinkError, SendOutcome, SinkKind};
use crate::lsn::RowPos;
use crate::park::{ParkError, ParkStore, ParkedEvent, ParkedRow, SequenceHead};
use crate::relay::exactly_once::{self, Isolation};
use crate::source::outbox::{RowError, UnreadableRow};

/// The header a redriven record carries: when the redrive started.
pub const REDRIVEN: &str = "redriven";

/// Rows read, and (exactly-once) published per Kafka transaction.
const BATCH: i64 = 500;

/// Which sequences a command acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The sequences of this key (an aggregate id), on any topic or one.
    Key {
        key: String,
        topic: Option<String>,
    },
    /// The sequences whose head was parked for this reason.
    Reason(String),
    All,
}

impl Selection {
    fn picks(&self, h: &SequenceHead) -> bool {
        match self {
            Selection::Key { key, topic } => h.key == *key && topic.as_ref().is_none_or(|t| h.topic == *t),
            Selection::Reason(r) => h.head_reason == *r,
            Selection::All => true,
        }
    }
}

/// Why a parked command failed.
#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
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
    #[error("slot {0} does not exist: parked events are redriven once the slot has passed them; start outboxd (or create the slot) first")]
    NoSlot(String),
    #[error("no parked event has id {0} (see `outboxd parked list` and `show`)")]
    NoSuchEvent(String),
    #[error("event {id} is not the head of its sequence (the head is {head}): only a head can be skipped, or the sequence would be reordered")]
    NotHead { id: String, head: String },
    #[error("{UNPASSED} {0} within --wait: is outboxd running? A transaction left open on the server holds the slot back too (pg_stat_activity)")]
    Unconfirmed(String),
    #[error("discard deletes parked events for good: add --confirm")]
    NotConfirmed,
    #[error("{0} sequence(s) could not be redriven completely; see above")]
    Incomplete(usize),
}

/// One sequence in `outboxd parked list --json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Listed {
    pub topic: String,
    pub key: String,
    pub head_id: String,
    pub head_reason: String,
    pub events: i64,
    pub bytes: i64,
    pub parked_at: String,
}

async fn store(validated: &Validated) -> Result<ParkStore, ParkError> {
    ParkStore::connect(&validated.pg, &validated.table, validated.slot.as_str()).await
}

/// `outboxd parked list`: per sequence, the head's reason, the count and
/// since when.
pub async fn list(validated: &Validated) -> Result<Vec<Listed>, ParkedError> {
    let heads = store(validated).await?.heads().await?;
    Ok(heads
        .into_iter()
        .map(|h| Listed {
            topic: h.topic,
            key: h.key,
            head_id: h.head_id,
            head_reason: h.head_reason,
            events: h.events,
            bytes: h.bytes,
            parked_at: h.parked_at.to_rfc3339(),
        })
        .collect())
}

/// `outboxd parked show`: the parked events of the selected sequences, in
/// order.
pub async fn show(validated: &Validated, selection: &Selection) -> Result<Vec<ParkedEvent>, ParkedError> {
    let store = store(validated).await?;
    let mut out = Vec::new();
    for h in store.heads().await?.iter().filter(|h| selection.picks(h)) {
        let mut after = None;
        loop {
            let batch = store.events(&h.topic, &h.key, after, BATCH).await?;
            let Some(last) = batch.last() else { break };
            after = Some(last.pos);
            out.extend(batch);
        }
    }
    Ok(out)
}

/// The start of the message that the slot has not passed a position.
const UNPASSED: &str = "the slot has not durably passed (restart_lsn, which follows the confirmed position at checkpoints and running-transaction records, every 15 s or so)";

/// Waits, up to `wait`, until the slot has durably passed the transaction
/// at `lsn` ([`ParkStore::durably_passed`]): the WAL never brings it back
/// to the relay, so what is done with its parked rows stays done.
async fn wait_confirmed(store: &ParkStore, lsn: crate::lsn::Lsn, wait: Duration) -> Result<(), ParkedError> {
    let deadline = Instant::now() + wait;
    loop {
        let passed = store
            .durably_passed()
            .await?
            .ok_or_else(|| ParkedError::NoSlot(store.slot().to_owned()))?;
        if lsn < passed {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(ParkedError::Unconfirmed(lsn.to_string()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `outboxd parked discard --confirm`: deletes the selected sequences,
/// once the slot has durably passed them (or a replay would park them
/// again).
pub async fn discard(
    validated: &Validated,
    selection: &Selection,
    confirm: bool,
    wait: Duration,
) -> Result<u64, ParkedError> {
    if !confirm {
        return Err(ParkedError::NotConfirmed);
    }
    let mut store = store(validated).await?;
    let mut n = 0;
    for h in store.heads().await?.into_iter().filter(|h| selection.picks(h)) {
        // Events the relay parks meanwhile keep the sequence: they are
        // discarded too once the slot has passed them, and never unseen.
        loop {
            let Some(last) = store.last_lsn(&h.topic, &h.key).await? else {
                if store
                    .discard_through(&h.topic, &h.key, crate::lsn::Lsn::ZERO)
                    .await?
                    .1
                {
                    break;
                }
                continue;
            };
            wait_confirmed(&store, last, wait).await?;
            let (deleted, released) = store.discard_through(&h.topic, &h.key, last).await?;
            n += deleted;
            tracing::warn!(
                topic = h.topic,
                key = h.key,
                events = deleted,
                "discarded parked events"
            );
            if released {
                break;
            }
        }
    }
    Ok(n)
}

/// What a redrive did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Redriven {
    /// Sequences released (every event published).
    pub released: usize,
    /// Events published.
    pub published: u64,
    /// Sequences left parked (a head failed again, or the slot had not
    /// passed their events within `--wait`).
    pub left: usize,
}

/// Options of `redrive` and `skip`.
#[derive(Clone, Debug)]
pub struct RedriveOptions {
    pub dry_run: bool,
    /// How long to wait for the slot to confirm past parked events.
    pub wait: Duration,
}

/// Publishes parked events: a plain idempotent producer, or (exactly-once)
/// a transactional one of its own.
struct Publisher {
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
    async fn new(config: &Config, validated: &Validated) -> Result<Self, ParkedError> {
        let exactly_once = config.kafka.delivery == Delivery::ExactlyOnce;
        let kind = SinkKind {
            transactional_id: validated
                .transactional_id
                .as_ref()
                .filter(|_| exactly_once)
                .map(|id| format!("{id}.redrive")),
            ..SinkKind::default()
        };
        let sink = KafkaSink::build(&config.kafka, config.kafka.admin_timeout.0, &kind)?;
        if exactly_once {
            sink.init_transactions(config.kafka.exactly_once.commit_timeout.0)
                .await?;
        }
        let registry =
            crate::schema::Registry::from_config(config, None).map_err(ParkedError::RegistrySetup)?;
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
            marker_key: format!("parked-redrive/{}", validated.slot.as_str()),
            one_by_one: false,
            facts,
        })
    }

    /// The record of a parked event under today's configuration, or why
    /// it still cannot be published (reason, error).
    async fn record(
        &mut self,
        ev: &ParkedEvent,
    ) -> Result<Result<KafkaRecord, (String, String)>, ParkedError> {
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
                    .push((REDRIVEN.to_owned(), self.started_at.as_bytes().to_vec()));
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
    async fn finish_committed(&mut self, store: &ParkStore) -> Result<(), ParkedError> {
        if !self.exactly_once {
            return Ok(());
        }
        let topic = self.config.kafka.progress_topic().to_owned();
        let value = exactly_once::read_latest(
            &self.config.kafka,
            &topic,
            &self.marker_key,
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

/// Why redriving one sequence stopped early.
enum Stopped {
    /// The head failed again: it stays parked with this reason.
    Failed {
        id: String,
        reason: String,
        error: String,
    },
    /// The slot did not confirm past these events within `--wait`.
    NotConfirmed { lsn: String },
}

/// `outboxd parked redrive`.
pub async fn redrive(
    config: &Config,
    validated: &Validated,
    selection: &Selection,
    options: &RedriveOptions,
) -> Result<Redriven, ParkedError> {
    let mut store = store(validated).await?;
    let heads: Vec<SequenceHead> = store
        .heads()
        .await?
        .into_iter()
        .filter(|h| selection.picks(h))
        .collect();
    let mut done = Redriven::default();
    if options.dry_run {
        for h in &heads {
            println!(
                "would redrive {} event(s) of topic {:?} key {:?} (head {} parked for {})",
                h.events, h.topic, h.key, h.head_id, h.head_reason
            );
        }
        return Ok(done);
    }
    let mut publisher = Publisher::new(config, validated).await?;
    publisher.finish_committed(&store).await?;
    for h in &heads {
        match redrive_sequence(&mut store, &mut publisher, &h.topic, &h.key, options, &mut done).await? {
            None => {
                done.released += 1;
                tracing::info!(topic = h.topic, key = h.key, "redriven: the sequence is released");
            }
            Some(Stopped::Failed { id, reason, error }) => {
                done.left += 1;
                eprintln!("outboxd: topic {:?} key {:?}: event {id} still cannot be published ({reason}): {error}; it stays parked at the head", h.topic, h.key);
            }
            Some(Stopped::NotConfirmed { lsn }) => {
                done.left += 1;
                eprintln!("outboxd: topic {:?} key {:?}: {UNPASSED} {lsn} within --wait: is outboxd running? The rest stays parked", h.topic, h.key);
            }
        }
    }
    Ok(done)
}

/// Redrives one sequence to its end and releases it (`None`), or says why
/// it stopped.
async fn redrive_sequence(
    store: &mut ParkStore,
    p: &mut Publisher,
    topic: &str,
    key: &str,
    options: &RedriveOptions,
    done: &mut Redriven,
) -> Result<Option<Stopped>, ParkedError> {
    // The wait is for each look at the slot: a redrive that makes progress
    // goes on.
    let mut deadline = Instant::now() + options.wait;
    loop {
        let batch = store.events(topic, key, None, BATCH).await?;
        if batch.is_empty() {
            if store.release(topic, key).await? {
                return Ok(None);
            }
            continue;
        }
        let passed = store
            .durably_passed()
            .await?
            .ok_or_else(|| ParkedError::NoSlot(store.slot().to_owned()))?;
        // Only what the slot has durably passed: the WAL never brings it
        // back, not even after a crash of PostgreSQL.
        let ready: Vec<&ParkedEvent> = batch.iter().take_while(|e| e.pos.commit_lsn < passed).collect();
        if ready.is_empty() {
            if Instant::now() >= deadline {
                return Ok(Some(Stopped::NotConfirmed {
                    lsn: batch[0].pos.commit_lsn.to_string(),
                }));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        deadline = Instant::now() + options.wait;
        let ready = if p.one_by_one { &ready[..1] } else { &ready[..] };
        let stopped = if p.exactly_once {
            publish_in_transaction(store, p, topic, key, ready, done).await?
        } else {
            publish_one_by_one(store, p, ready, done).await?
        };
        if stopped.is_some() {
            return Ok(stopped);
        }
    }
}

/// At-least-once: each record acknowledged before the next is sent, its
/// row deleted after.
async fn publish_one_by_one(
    store: &mut ParkStore,
    p: &mut Publisher,
    events: &[&ParkedEvent],
    done: &mut Redriven,
) -> Result<Option<Stopped>, ParkedError> {
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
        done.published += 1;
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
    done: &mut Redriven,
) -> Result<Option<Stopped>, ParkedError> {
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
                Err(e) => return Err(e.into()),
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
        done.published += records.len() as u64;
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
) -> Result<Option<Stopped>, ParkedError> {
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
) -> Result<Option<Stopped>, ParkedError> {
    store.failed(ev, &reason, &error).await?;
    Ok(Some(Stopped::Failed {
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
) -> Result<Option<Stopped>, ParkedError> {
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

/// Only a sequence's head may be skipped: the rest keeps its order.
async fn is_head(store: &ParkStore, ev: &ParkedEvent) -> Result<(), ParkedError> {
    let head = store
        .events(&ev.topic, &ev.key, None, 1)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| ParkedError::NoSuchEvent(ev.id()))?;
    if head.pos != ev.pos {
        return Err(ParkedError::NotHead {
            id: ev.id(),
            head: head.id(),
        });
    }
    Ok(())
}

/// `outboxd parked skip --id`: sends the head of its sequence to the
/// dead-letter topic, deletes it, and redrives the rest.
pub async fn skip(
    config: &Config,
    validated: &Validated,
    id: &str,
    options: &RedriveOptions,
) -> Result<Redriven, ParkedError> {
    let store = store(validated).await?;
    // An exactly-once redrive that committed but did not delete first:
    // its events are in Kafka, and none of them may become a dead letter.
    if !options.dry_run {
        Publisher::new(config, validated)
            .await?
            .finish_committed(&store)
            .await?;
    }
    let ev = store
        .by_id(id)
        .await?
        .ok_or_else(|| ParkedError::NoSuchEvent(id.to_owned()))?;
    is_head(&store, &ev).await?;
    if options.dry_run {
        println!(
            "would send event {id} to {} and redrive the rest of topic {:?} key {:?}",
            config.routing.dead_letter_topic, ev.topic, ev.key
        );
        return Ok(Redriven::default());
    }
    // As for a redrive: a replay of the WAL must not park it again. A
    // predecessor replayed meanwhile may have become the head: look again.
    wait_confirmed(&store, ev.pos.commit_lsn, options.wait).await?;
    is_head(&store, &ev).await?;
    let poison = Poison {
        reason: crate::metrics::DEAD_LETTER_REASONS
            .iter()
            .find(|r| **r == ev.reason)
            .copied()
            .unwrap_or("refused"),
        error: ev.error.clone(),
        lsn: ev.pos.commit_lsn,
        intended_topic: Some(ev.topic.clone()),
        omit_payload: false,
    };
    let dead_letter = match &ev.row {
        ParkedRow::Row(row) => dead_letter_for_row(row, &poison, &config.routing.dead_letter_topic),
        ParkedRow::Unreadable {
            id,
            aggregate_id,
            columns_json,
        } => {
            let row = UnreadableRow {
                id: id.clone(),
                aggregate_id: aggregate_id.clone(),
                error: RowError::Message {
                    reason: ev.error.clone(),
                },
                columns_json: columns_json.clone(),
            };
            dead_letter_for_unreadable(&row, &poison, &config.routing.dead_letter_topic)
        }
    };
    // Its own producer, never transactional: a dead letter is a copy for
    // an operator, and it goes before the rest is redriven.
    let mut sink = KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0)?;
    sink.ensure_topic(&dead_letter.topic).await?;
    let sent = loop {
        match sink.send(&dead_letter)? {
            SendOutcome::Sent(f) => break f,
            SendOutcome::QueueFull => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    };
    sent.await.into_result()?;
    store.delete(&ev).await?;
    store.advance_head(&ev.topic, &ev.key).await?;
    tracing::warn!(
        id,
        topic = ev.topic,
        key = ev.key,
        dead_letter_topic = config.routing.dead_letter_topic,
        "skipped: the head went to the dead-letter topic"
    );
    let selection = Selection::Key {
        key: ev.key.clone(),
        topic: Some(ev.topic.clone()),
    };
    redrive(config, validated, &selection, options).await
}
