//! Runs one view (`views.rs`) from `account.events`: its own consumer group
//! (`<prefix>.<view>`), so each view has its own offsets, lag and rebuild.
//!
//! For each record, in one PostgreSQL transaction:
//!
//! 1. The view's position for the account (`projection_positions`, the
//!    last version it handled) is read. The seed's rule: only an event whose
//!    version is past it is handled, so a duplicate or a replayed record
//!    (version ≤ position) changes nothing. An event past position + 1 is a
//!    gap (records missing from the topic): it is dead-lettered with reason
//!    `gap: …` and the view waits for the missing version.
//! 2. The view applies the event (inside a savepoint). A broken rule rolls
//!    the savepoint back, dead-letters the record (the producer waits for
//!    Kafka's ack) and keeps the reason in `projection_rejections`, so the
//!    account's later events still apply.
//! 3. The position moves to the event's version, and the transaction
//!    commits.
//!
//! Only then is the record's offset committed to Kafka, so a crash in
//! between replays it, and step 1 ignores it. A database error is retried on
//! the same record (after a second, with a new connection if the old one
//! broke): nothing is skipped. A record that cannot be read at all (no
//! version, not JSON) is dead-lettered.
//!
//! Dead letters go to the DLQ topic with the record's key, value and
//! headers plus `dlq.reason`, `dlq.projection` and `dlq.source.*`. The
//! dead letter is written before the view's transaction commits, so a crash
//! in between can repeat it, never lose it. A rebuild repeats them too.
//!
//! **Rebuild** (`--rebuild VIEW`): the group's offsets are set to the start
//! of the topic first, then the view's rows, positions and rejections are
//! deleted, and the view is projected again from the first record. (In the
//! other order a crash in between would leave an empty view that resumes
//! from the old offsets.) The group must have no running member.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;

use crate::event::AccountRecord;
use crate::pool::Pool;
use crate::views::View;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the projections read and what they write to.
#[derive(Debug, Clone)]
pub struct Source {
    pub brokers: String,
    pub topic: String,
    pub dlq_topic: String,
    pub group_prefix: String,
    /// Values are outboxd's envelope (payload under `data`), not bare payloads.
    pub envelope: bool,
}

impl Source {
    pub fn group(&self, view: View) -> String {
        format!("{}.{}", self.group_prefix, view.name())
    }

    fn consumer_config(&self, view: View) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", self.group(view))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            // A topic outboxd has not created yet is noticed within seconds.
            .set("topic.metadata.refresh.interval.ms", "5000");
        c
    }
}

/// What a view has done since the service started.
#[derive(Debug, Default)]
pub struct Stats {
    pub applied: AtomicU64,
    pub duplicates: AtomicU64,
    pub dead_letters: AtomicU64,
    pub rebuilding: AtomicBool,
    pub last_error: Mutex<Option<String>>,
}

impl Stats {
    fn error(&self, e: String) {
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(e);
        }
    }
}

/// One view's runner, as the HTTP API sees it.
pub struct Projection {
    pub view: View,
    pub group: String,
    pub stats: Arc<Stats>,
    /// A consumer of the group that never joins it: reads committed offsets.
    offsets: BaseConsumer,
    topic: String,
}

impl std::fmt::Debug for Projection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Projection")
            .field("view", &self.view)
            .field("group", &self.group)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub name: &'static str,
    pub group: String,
    /// Records on the topic the group has not committed (all partitions).
    pub lag: Option<i64>,
    pub applied: u64,
    pub duplicates: u64,
    pub dead_letters: u64,
    pub rebuilding: bool,
    pub last_error: Option<String>,
}

impl Projection {
    pub fn new(view: View, source: &Source) -> Result<Self, BoxError> {
        Ok(Projection {
            view,
            group: source.group(view),
            stats: Arc::default(),
            offsets: source.consumer_config(view).create()?,
            topic: source.topic.clone(),
        })
    }

    /// The view's lag: for each partition, its end minus the group's
    /// committed offset (its start when nothing is committed). Blocking.
    pub fn lag(&self) -> Result<i64, BoxError> {
        let md = self.offsets.fetch_metadata(Some(&self.topic), KAFKA_TIMEOUT)?;
        let Some(topic) = md.topics().first().filter(|t| t.error().is_none()) else {
            return Ok(0); // nothing published yet
        };
        let mut tpl = TopicPartitionList::new();
        for p in topic.partitions() {
            tpl.add_partition(&self.topic, p.id());
        }
        let committed = self.offsets.committed_offsets(tpl, KAFKA_TIMEOUT)?;
        let mut lag = 0;
        for e in committed.elements() {
            let (low, high) = self
                .offsets
                .fetch_watermarks(&self.topic, e.partition(), KAFKA_TIMEOUT)?;
            let at = match e.offset() {
                Offset::Offset(o) => o,
                _ => low,
            };
            lag += (high - at).max(0);
        }
        Ok(lag)
    }

    /// The view's figures; a rebuild is over once the lag reads 0.
    pub fn report(&self, lag: Option<i64>) -> Report {
        if lag == Some(0) {
            self.stats.rebuilding.store(false, Ordering::Relaxed);
        }
        Report {
            name: self.view.name(),
            group: self.group.clone(),
            lag,
            applied: self.stats.applied.load(Ordering::Relaxed),
            duplicates: self.stats.duplicates.load(Ordering::Relaxed),
            dead_letters: self.stats.dead_letters.load(Ordering::Relaxed),
            rebuilding: self.stats.rebuilding.load(Ordering::Relaxed),
            last_error: self.stats.last_error.lock().ok().and_then(|e| e.clone()),
        }
    }

    /// Sets the group's offsets to the start of the topic, then empties the
    /// view (see the module doc for the order).
    pub async fn reset(&self, pool: &Pool) -> Result<(), BoxError> {
        self.stats.rebuilding.store(true, Ordering::Relaxed);
        let md = self.offsets.fetch_metadata(Some(&self.topic), KAFKA_TIMEOUT)?;
        if let Some(topic) = md.topics().first().filter(|t| t.error().is_none()) {
            let mut tpl = TopicPartitionList::new();
            for p in topic.partitions() {
                let (low, _) = self
                    .offsets
                    .fetch_watermarks(&self.topic, p.id(), KAFKA_TIMEOUT)?;
                tpl.add_partition_offset(&self.topic, p.id(), Offset::Offset(low))?;
            }
            self.offsets.commit(&tpl, CommitMode::Sync).map_err(|e| {
                format!(
                    "cannot reset the offsets of consumer group {}: {e}; is another instance of the service running? Stop it first",
                    self.group
                )
            })?;
        }
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        tx.execute(&format!("DELETE FROM {}", self.view.table()), &[])
            .await?;
        for table in ["projection_positions", "projection_rejections"] {
            tx.execute(
                &format!("DELETE FROM {table} WHERE projection = $1"),
                &[&self.view.name()],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// What one record did.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Applied,
    Duplicate,
    DeadLettered,
}

/// Consumes the topic into the view until the process ends.
pub async fn run(projection: Arc<Projection>, source: Arc<Source>, pool: Pool, producer: FutureProducer) {
    let view = projection.view;
    let stats = &projection.stats;
    let consumer: StreamConsumer = loop {
        match source
            .consumer_config(view)
            .create()
            .map_err(BoxError::from)
            .and_then(|c: StreamConsumer| c.subscribe(&[&source.topic]).map(|_| c).map_err(Into::into))
        {
            Ok(c) => break c,
            Err(e) => {
                stats.error(format!("cannot start the consumer: {e}"));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let mut client = None;
    loop {
        let m = match consumer.recv().await {
            Ok(m) => m,
            Err(e) => {
                // A topic not created yet, a broker restarting: wait and poll again.
                tracing::debug!(view = view.name(), "consumer: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let outcome = loop {
            if client.is_none() {
                match pool.get().await {
                    Ok(c) => client = Some(c),
                    Err(e) => {
                        stats.error(format!("database: {e}"));
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
            let Some(c) = client.as_mut() else { continue };
            match handle(view, c, &producer, &source, &m).await {
                Ok(outcome) => break outcome,
                Err(e) => {
                    tracing::warn!(
                        view = view.name(),
                        offset = m.offset(),
                        "retrying the record: {e}"
                    );
                    stats.error(e.to_string());
                    if c.is_closed() {
                        client = None;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        match outcome {
            Outcome::Applied => &stats.applied,
            Outcome::Duplicate => &stats.duplicates,
            Outcome::DeadLettered => &stats.dead_letters,
        }
        .fetch_add(1, Ordering::Relaxed);
        // The view's transaction has committed (or the record is a dead
        // letter or a duplicate): only now is the record done.
        if let Err(e) = consumer.commit_message(&m, CommitMode::Async) {
            stats.error(format!("offset commit: {e}"));
        }
    }
}

async fn handle(
    view: View,
    client: &mut tokio_postgres::Client,
    producer: &FutureProducer,
    source: &Source,
    m: &BorrowedMessage<'_>,
) -> Result<Outcome, BoxError> {
    let ev = match AccountRecord::decode(m, source.envelope) {
        Ok(ev) => ev,
        Err(why) => {
            dead_letter(producer, source, view, m, &why).await?;
            return Ok(Outcome::DeadLettered);
        }
    };
    let mut tx = client.transaction().await?;
    let position: i64 = tx
        .query_opt(
            "SELECT version FROM projection_positions WHERE projection = $1 AND account_id = $2 FOR UPDATE",
            &[&view.name(), &ev.account_id],
        )
        .await?
        .map_or(0, |r| r.get(0));
    if ev.version <= position {
        return Ok(Outcome::Duplicate);
    }
    if ev.version > position + 1 {
        let why = format!(
            "gap: the {} view of account {} is at version {position}, this event has version {}; the versions between are missing from the topic",
            view.name(),
            ev.account_id,
            ev.version
        );
        dead_letter(producer, source, view, m, &why).await?;
        return Ok(Outcome::DeadLettered);
    }
    let savepoint = tx.savepoint("apply").await?;
    let verdict = view.apply(&savepoint, &ev).await?;
    let outcome = match verdict {
        Ok(()) => {
            savepoint.commit().await?;
            Outcome::Applied
        }
        Err(why) => {
            savepoint.rollback().await?;
            dead_letter(producer, source, view, m, &why).await?;
            tx.execute(
                "INSERT INTO projection_rejections (projection, account_id, version, event_id, reason)
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                &[&view.name(), &ev.account_id, &ev.version, &ev.event_id, &why],
            )
            .await?;
            Outcome::DeadLettered
        }
    };
    tx.execute(
        "INSERT INTO projection_positions (projection, account_id, version) VALUES ($1, $2, $3)
         ON CONFLICT (projection, account_id) DO UPDATE SET version = EXCLUDED.version",
        &[&view.name(), &ev.account_id, &ev.version],
    )
    .await?;
    tx.commit().await?;
    Ok(outcome)
}

async fn dead_letter(
    producer: &FutureProducer,
    source: &Source,
    view: View,
    m: &BorrowedMessage<'_>,
    reason: &str,
) -> Result<(), BoxError> {
    tracing::warn!(view = view.name(), offset = m.offset(), "dead letter: {reason}");
    let mut headers = OwnedHeaders::new();
    if let Some(h) = m.headers() {
        for h in h.iter() {
            headers = headers.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
    }
    let partition = m.partition().to_string();
    let offset = m.offset().to_string();
    for (key, value) in [
        ("dlq.reason", reason),
        ("dlq.projection", view.name()),
        ("dlq.source.topic", m.topic()),
        ("dlq.source.partition", &partition),
        ("dlq.source.offset", &offset),
    ] {
        headers = headers.insert(Header {
            key,
            value: Some(value),
        });
    }
    let mut record = FutureRecord::to(&source.dlq_topic)
        .payload(m.payload().unwrap_or_default())
        .headers(headers);
    if let Some(k) = m.key() {
        record = record.key(k);
    }
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| format!("cannot write to {}: {e}", source.dlq_topic))?;
    Ok(())
}

/// Creates the DLQ topic when it is missing, with the source topic's
/// partition count (1 when the source does not exist yet).
pub async fn ensure_dlq(source: &Source, replication_factor: i32) -> Result<(), BoxError> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::types::RDKafkaErrorCode;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &source.brokers)
        .create()?;
    let md = admin.inner().fetch_metadata(Some(&source.topic), KAFKA_TIMEOUT)?;
    let partitions = md
        .topics()
        .first()
        .filter(|t| t.error().is_none())
        .map_or(1, |t| t.partitions().len().max(1)) as i32;
    let topic = NewTopic::new(
        &source.dlq_topic,
        partitions,
        TopicReplication::Fixed(replication_factor),
    );
    for result in admin.create_topics([&topic], &AdminOptions::new()).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                return Err(format!("cannot create the dead-letter topic {name}: {code}").into())
            }
        }
    }
    Ok(())
}
