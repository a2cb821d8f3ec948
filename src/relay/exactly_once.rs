//! Exactly-once delivery: Kafka transactions aligned with PostgreSQL
//! transactions, and Kafka (not the slot) as the record of what was
//! published.
//!
//! # The flow
//!
//! At-least-once confirms a PostgreSQL commit once Kafka acknowledged its
//! events; a crash in between re-sends them. Exactly-once closes that gap
//! by putting the position into Kafka, atomically with the events:
//!
//! 1. **Start.** The session's producer calls `init_transactions` with a
//!    stable `transactional.id` (default `outboxd.<slot>`). The broker
//!    fences every older producer with that id (a zombie from before a
//!    restart, a second outboxd) and completes the transaction it left
//!    open. Only then is the progress topic read, with `read_committed`,
//!    to its end: the last record keyed by the slot name holds the commit
//!    LSN of the last PostgreSQL transaction that reached Kafka.
//! 2. **Skip.** Replication starts at the slot's `confirmed_flush_lsn`,
//!    which may be behind that record: the slot is confirmed only after a
//!    Kafka commit, and a crash can fall in between. Every PostgreSQL
//!    transaction whose commit LSN is at or below the record is skipped
//!    ([`Transactions::admit`]); once read, it is confirmed like any other.
//! 3. **Group.** Events go into an open Kafka transaction as they are read
//!    (memory stays bounded by `kafka.max_inflight`, as in at-least-once).
//!    A Kafka transaction only ever ends at a PostgreSQL commit, so it
//!    holds whole PostgreSQL transactions. It ends at the first commit
//!    after it holds `max_events` events or `max_bytes` bytes, or after its
//!    first event waited `max_wait` ([`Group::due`]). A PostgreSQL
//!    transaction larger than the bound is one Kafka transaction.
//! 4. **Commit.** Intake pauses; once every record's delivery is reported,
//!    the progress record (the last PostgreSQL transaction's commit LSN)
//!    is sent into the same transaction, and the transaction is committed.
//!    Only after that do its events count as acknowledged in the
//!    [`AckTracker`](crate::relay::progress::AckTracker), so the slot is confirmed
//!    only past what a `read_committed` consumer can see.
//! 5. **Failure.** Any error aborts the Kafka transaction (or leaves it to
//!    the next `init_transactions`, or the broker's
//!    `transaction.timeout.ms`, after a kill) and ends the session; the
//!    next one replays from the progress record. Records of an aborted
//!    transaction reach `read_uncommitted` consumers only.
//!
//! A record Kafka refuses makes the whole transaction abortable, so it
//! cannot be set aside in place as in at-least-once. The refused record's
//! LSN is remembered ([`Refused`]) and the replay sends its dead letter
//! instead, inside the same Kafka transaction as the rest of its
//! PostgreSQL transaction.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

use crate::config::{ExactlyOnceConfig, KafkaConfig};
use crate::kafka::records::KafkaRecord;
use crate::lsn::Lsn;
use crate::postgres::timeline::TimelineHistory;
use crate::relay::progress::TxnId;

/// The progress record's format version.
pub const PROGRESS_VERSION: u32 = 1;

/// The value of a progress record: what a committed Kafka transaction
/// holds, up to which PostgreSQL transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProgressRecord {
    pub version: u32,
    pub slot: String,
    pub database: String,
    /// `IDENTIFY_SYSTEM`'s `systemid`: LSNs of another cluster mean nothing.
    pub system_id: String,
    /// The server's timeline when the record was written.
    pub timeline: u32,
    /// Commit LSN of the last PostgreSQL transaction in Kafka.
    pub commit_lsn: String,
    /// End LSN of that transaction's commit record.
    pub end_lsn: String,
    /// That transaction's commit time (RFC 3339).
    pub commit_time: String,
    /// When the Kafka transaction was committed (RFC 3339, outboxd's clock).
    pub written_at: String,
    /// PostgreSQL transactions and events in that Kafka transaction.
    pub transactions: u64,
    pub events: u64,
    /// Which outboxd wrote it: `host/pid`.
    pub writer: String,
}

impl ProgressRecord {
    /// The commit time, in microseconds since the Unix epoch.
    pub fn commit_time_micros(&self) -> Result<i64, ProgressError> {
        chrono::DateTime::parse_from_rfc3339(&self.commit_time)
            .map(|t| t.timestamp_micros())
            .map_err(|_| ProgressError::Malformed(format!("commitTime {:?}", self.commit_time)))
    }

    pub fn commit_lsn(&self) -> Result<Lsn, ProgressError> {
        self.commit_lsn
            .parse()
            .map_err(|_| ProgressError::Malformed(format!("commitLsn {:?}", self.commit_lsn)))
    }

    pub fn end_lsn(&self) -> Result<Lsn, ProgressError> {
        self.end_lsn
            .parse()
            .map_err(|_| ProgressError::Malformed(format!("endLsn {:?}", self.end_lsn)))
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ProgressError> {
        let record: ProgressRecord =
            serde_json::from_slice(bytes).map_err(|e| ProgressError::Malformed(e.to_string()))?;
        if record.version != PROGRESS_VERSION {
            return Err(ProgressError::Malformed(format!(
                "version {} (this outboxd writes {PROGRESS_VERSION})",
                record.version
            )));
        }
        record.commit_lsn()?;
        record.end_lsn()?;
        Ok(record)
    }
}

/// The progress topic could not be read or makes no sense here.
#[derive(Debug, thiserror::Error)]
pub enum ProgressError {
    #[error("cannot read the progress topic: {0}")]
    Kafka(#[from] KafkaError),
    #[error("the progress record is not one outboxd wrote: {0}; reset it (see docs/exactly-once.md, \"Resetting the progress\")")]
    Malformed(String),
    #[error("reading the progress topic {topic:?} to its end took longer than {timeout:?}: a transaction of another producer may hold it open (another source, or an outboxd killed or frozen while committing; its successor's start or the broker's transaction.timeout.ms ends it); retrying. A transaction open longer than transaction.timeout.ms is hanging: find it with `kafka-transactions.sh find-hanging` and end it with `kafka-transactions.sh abort`")]
    Timeout { topic: String, timeout: Duration },
    #[error("Kafka cannot serve the progress topic {topic:?} yet ({error}); retrying")]
    Unavailable { topic: String, error: RDKafkaErrorCode },
    #[error("Kafka denied outboxd the progress topic {topic:?} ({error}): grant outboxd's principal READ, WRITE and DESCRIBE on it (and CREATE unless it exists). outboxd does not start without it: a slot register or progress record it cannot read would look like none, and a lost slot could be recreated or published events skipped")]
    Denied { topic: String, error: RDKafkaErrorCode },
    #[error("Kafka reported an error for the progress topic {topic:?}: {error}")]
    Topic { topic: String, error: RDKafkaErrorCode },
    #[error("Kafka reported a write to the progress topic {topic:?} delivered without an offset, so it may not have been stored; retrying")]
    NotStored { topic: String },
    #[error("the progress topic {topic:?} has {partitions} partitions; outboxd keeps its slot register and exactly-once progress in a topic of one partition, compacted: with several, a key moved to another partition (a partition count changed) can bring an older record back after compaction, and each start reads every partition. outboxd never makes such a topic. Stop outboxd, create one (kafka-topics.sh --create --topic <name> --partitions 1 --config cleanup.policy=compact), set kafka.progress_topic to it and start: nothing is lost, and what lay between each slot and its last Kafka commit is published again (see docs/exactly-once.md, \"The progress topic's shape\")")]
    Partitions { topic: String, partitions: usize },
}

impl ProgressError {
    pub fn is_transient(&self) -> bool {
        !matches!(
            self,
            ProgressError::Malformed(_)
                | ProgressError::Denied { .. }
                | ProgressError::Topic { .. }
                | ProgressError::Partitions { .. }
        )
    }
}

/// What a topic-level metadata error means for a reader of the progress
/// topic: only a topic that does not exist holds no record. Anything else
/// (a leader not yet elected, a denied topic) must never read as "no
/// record": that would recreate a lost slot, or skip nothing that should be
/// skipped. `None`: the topic does not exist.
fn topic_error(topic: &str, error: RDKafkaErrorCode) -> Option<ProgressError> {
    let topic = topic.to_owned();
    match error {
        RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic => None,
        RDKafkaErrorCode::TopicAuthorizationFailed | RDKafkaErrorCode::ClusterAuthorizationFailed => {
            Some(ProgressError::Denied { topic, error })
        }
        RDKafkaErrorCode::InvalidTopic | RDKafkaErrorCode::InvalidConfig => {
            Some(ProgressError::Topic { topic, error })
        }
        // Leader not available, not leader, a partition still being
        // created, a broker that is loading, or any error not known here.
        _ => Some(ProgressError::Unavailable { topic, error }),
    }
}

/// A `read_committed` consumer with the connection settings of
/// `kafka.options` (security, SASL, TLS), and no group.
fn consumer_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("client.id", "outboxd-progress")
        .set("group.id", "outboxd-progress-reader")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false");
    for (k, v) in &cfg.options {
        if !crate::kafka::sink::PRODUCER_ONLY.contains(&k.as_str()) {
            c.set(k, v);
        }
    }
    // A window whose start compaction or retention removed reads from the
    // earliest offset there is, whatever the options say.
    c.set("auto.offset.reset", "earliest");
    c.set("isolation.level", "read_committed");
    c
}

/// The last committed progress record keyed `slot`, or `None` (no record,
/// no topic, or a tombstone: a reset).
pub async fn read_progress(
    cfg: &KafkaConfig,
    topic: &str,
    slot: &str,
    timeout: Duration,
) -> Result<Option<ProgressRecord>, ProgressError> {
    match read_latest(cfg, topic, slot, Isolation::ReadCommitted, timeout).await? {
        Some(value) => ProgressRecord::decode(&value).map(Some),
        None => Ok(None),
    }
}

/// Which records a reader of the progress topic sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// Committed transactions only; reading waits for open ones.
    ReadCommitted,
    /// Every record, also of open transactions: for records written
    /// outside transactions, which an open transaction must not hold up.
    ReadUncommitted,
}

/// The value of the last record keyed `key` in `topic`, or `None` (no
/// record, no topic, or a tombstone).
pub async fn read_latest(
    cfg: &KafkaConfig,
    topic: &str,
    key: &str,
    isolation: Isolation,
    timeout: Duration,
) -> Result<Option<Vec<u8>>, ProgressError> {
    let mut config = consumer_config(cfg);
    if isolation == Isolation::ReadUncommitted {
        config.set("isolation.level", "read_uncommitted");
    }
    let (topic, key) = (topic.to_owned(), key.to_owned());
    tokio::task::spawn_blocking(move || read_blocking(&config, &topic, &key, timeout))
        .await
        .map_err(|_| ProgressError::Kafka(KafkaError::Canceled))?
}

/// Writes a tombstone for `slot` to the progress topic: the next start
/// publishes from the slot's confirmed LSN. Call it only with outboxd
/// stopped.
pub async fn reset_progress(
    cfg: &KafkaConfig,
    topic: &str,
    slot: &str,
    timeout: Duration,
) -> Result<(), ProgressError> {
    write_plain(cfg, topic, slot, None, timeout).await
}

/// The settings of [`write_plain`]'s producer: one keyed record of a
/// compacted topic, `acks = all`, and not idempotent. librdkafka's
/// idempotent producer asks for its producer id only at its next timer
/// round once a broker is up, about half a second after start, and a slot
/// the register does not know waits for this write before it is streamed.
/// A retry without idempotence can only store the same record twice, which
/// compaction and every reader (the latest record of the key) take as one;
/// the next write to the key starts only once this one is answered.
/// `enable.gapless.guarantee` needs idempotence, so it is turned off here
/// too whatever `kafka.options` says (it guards a stream of records, and
/// this producer sends one).
pub(crate) fn plain_writer_config(cfg: &KafkaConfig, timeout: Duration) -> rdkafka::ClientConfig {
    let mut config = crate::kafka::sink::client_config(cfg);
    config
        .set("client.id", "outboxd-progress-writer")
        .set("acks", "all")
        .set("enable.idempotence", "false")
        .set("enable.gapless.guarantee", "false")
        .set("message.timeout.ms", timeout.as_millis().max(1).to_string());
    config
}

/// Writes one record (`None`: a tombstone) outside any transaction, and
/// waits until Kafka acknowledged it (on a producer of its own, see
/// [`plain_writer_config`]), then drops the producer on a blocking thread:
/// tearing down librdkafka's threads takes about 90 ms that the caller
/// need not wait for.
pub async fn write_plain(
    cfg: &KafkaConfig,
    topic: &str,
    key: &str,
    value: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(), ProgressError> {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let config = plain_writer_config(cfg, timeout);
    let producer: FutureProducer = config.create()?;
    let mut record = FutureRecord::<str, [u8]>::to(topic).key(key);
    if let Some(v) = &value {
        record = record.payload(v.as_slice());
    }
    // The delivery report, not just the queue: a refused write is an
    // error, and so is one reported without an offset (see
    // `kafka::Report`): the register must never believe a write it cannot
    // prove.
    let delivery = producer.send(record, timeout).await;
    tokio::task::spawn_blocking(move || drop(producer));
    let delivery = delivery.map_err(|(e, _)| ProgressError::Kafka(e))?;
    if delivery.offset < 0 {
        return Err(ProgressError::NotStored {
            topic: topic.to_owned(),
        });
    }
    Ok(())
}

/// Offsets read per partition at first, from the end backwards; each miss
/// reads eight times further back. A compacted topic holds one record per
/// slot, but compaction lags, so the tail is where the answer is.
const FIRST_WINDOW: i64 = 1_000;

fn read_blocking(
    config: &ClientConfig,
    topic: &str,
    slot: &str,
    timeout: Duration,
) -> Result<Option<Vec<u8>>, ProgressError> {
    let consumer: BaseConsumer = config.create()?;
    // A partition's end is its high watermark, which only a
    // `read_uncommitted` client is told. A `read_committed` one is told the
    // last stable offset, which stops before the first open transaction:
    // another source's, or that of an outboxd killed or frozen between its
    // progress record and its commit, open until its successor starts or
    // the broker's `transaction.timeout.ms`. Ending there would miss every
    // newer committed record and answer with an older one (its events
    // published twice); reading to the high watermark waits for that
    // transaction instead.
    let uncommitted: Option<BaseConsumer> = match config.get("isolation.level") {
        Some("read_committed") => {
            let mut edge = config.clone();
            edge.set("isolation.level", "read_uncommitted");
            Some(edge.create()?)
        }
        _ => None,
    };
    let edge = uncommitted.as_ref().unwrap_or(&consumer);
    let deadline = Instant::now() + timeout;
    // Every call gets what is left of the one timeout, not a whole one.
    let left = || {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(ProgressError::Timeout {
                topic: topic.to_owned(),
                timeout,
            })
        } else {
            Ok(left)
        }
    };
    let metadata = consumer.fetch_metadata(Some(topic), left()?)?;
    let mut partitions: Vec<i32> = Vec::new();
    for t in metadata.topics().iter().filter(|t| t.name() == topic) {
        if let Some(e) = t.error() {
            match topic_error(topic, RDKafkaErrorCode::from(e)) {
                Some(err) => return Err(err),
                None => continue,
            }
        }
        for p in t.partitions() {
            if let Some(e) = p.error() {
                return Err(topic_error(topic, RDKafkaErrorCode::from(e)).unwrap_or(
                    ProgressError::Unavailable {
                        topic: topic.to_owned(),
                        error: RDKafkaErrorCode::from(e),
                    },
                ));
            }
            partitions.push(p.id());
        }
    }
    // One partition, or the answer is not exact (see `Partitions`): the
    // newest record of a key is the last one in its partition only while
    // the partition count stays.
    if partitions.len() > 1 {
        return Err(ProgressError::Partitions {
            topic: topic.to_owned(),
            partitions: partitions.len(),
        });
    }
    let mut latest: Option<Found> = None;
    for partition in partitions {
        let (low, high) = edge.fetch_watermarks(topic, partition, left()?)?;
        let mut end = high;
        let mut window = FIRST_WINDOW;
        // A consumer assigned the same partition again reports the old
        // assignment's position until librdkafka has stopped that fetch,
        // which it does on a thread of its own after `assign` returns: a
        // step back could take the last window's end for its own and read
        // nothing. So each step back reads with a consumer of its own.
        while end > low {
            let start = (end - window).max(low);
            let stepped: BaseConsumer;
            let reader = if end == high {
                &consumer
            } else {
                stepped = config.create()?;
                &stepped
            };
            if let Some(found) = scan(reader, topic, partition, start, end, slot, deadline, timeout)? {
                if latest.as_ref().is_none_or(|(t, _)| found.0 >= *t) {
                    latest = Some(found);
                }
                break;
            }
            end = start;
            window = window.saturating_mul(8);
        }
    }
    Ok(latest.and_then(|(_, value)| value))
}

/// A record keyed by the slot: its timestamp, and its value (`None`: a
/// tombstone).
type Found = (i64, Option<Vec<u8>>);

/// Reads `[start, end)` of one partition with `read_committed`; the last
/// record keyed `slot` there, as (timestamp, value). Reading reaches `end`
/// only once every transaction below it is complete.
#[allow(clippy::too_many_arguments)]
fn scan(
    consumer: &BaseConsumer,
    topic: &str,
    partition: i32,
    start: i64,
    end: i64,
    slot: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<Option<Found>, ProgressError> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(start))?;
    consumer.assign(&tpl)?;
    let mut found = None;
    loop {
        if Instant::now() > deadline {
            return Err(ProgressError::Timeout {
                topic: topic.to_owned(),
                timeout,
            });
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                if m.offset() < end && m.key() == Some(slot.as_bytes()) {
                    let ts = m.timestamp().to_millis().unwrap_or(0);
                    found = Some((ts, m.payload().map(<[u8]>::to_vec)));
                }
                if m.offset() + 1 >= end {
                    return Ok(found);
                }
            }
            Some(Err(KafkaError::PartitionEOF(_))) | None => {
                // Nothing to hand out. The window may end in records no
                // message stands for (a transaction's commit or abort
                // marker): the position passes them all the same.
                let position = consumer
                    .position()?
                    .find_partition(topic, partition)
                    .and_then(|p| p.offset().to_raw())
                    .unwrap_or(start);
                if position >= end {
                    return Ok(found);
                }
            }
            Some(Err(e)) => {
                if let Some(err) = poll_error(topic, e) {
                    return Err(err);
                }
            }
        }
    }
}

/// What an error handed out by a progress reader's `poll` means: `None`
/// for one librdkafka recovers from on its own (a bootstrap broker that is
/// down, a lookup that failed, a leader moving), so the read polls on
/// within its deadline; a denied read, the refusal that names the grant
/// (it is not retried); anything else, an error the session retries.
fn poll_error(topic: &str, error: KafkaError) -> Option<ProgressError> {
    use RDKafkaErrorCode as C;
    match error.rdkafka_error_code() {
        Some(
            C::BrokerTransportFailure
            | C::AllBrokersDown
            | C::Resolve
            | C::BrokerNotAvailable
            | C::NetworkException
            | C::RequestTimedOut
            | C::OperationTimedOut
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::PreferredLeaderNotAvailable,
        ) => None,
        Some(code @ (C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed)) => {
            topic_error(topic, code)
        }
        _ => Some(error.into()),
    }
}

/// The bounds of one Kafka transaction.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_events: usize,
    pub max_bytes: usize,
    pub max_wait: Duration,
}

impl From<&ExactlyOnceConfig> for Limits {
    fn from(c: &ExactlyOnceConfig) -> Self {
        Limits {
            max_events: c.max_events,
            max_bytes: c.max_bytes,
            max_wait: c.max_wait.0,
        }
    }
}

pub use crate::relay::progress::LastCommit;

/// The PostgreSQL transactions in the open Kafka transaction.
#[derive(Debug, Default)]
pub struct Group {
    /// Events sent per PostgreSQL transaction (in the ack tracker's ids).
    txns: Vec<(TxnId, usize)>,
    events: usize,
    bytes: usize,
    transactions: u64,
    /// When its first event was sent.
    opened_at: Option<Instant>,
    /// The last PostgreSQL commit read into it.
    last: Option<LastCommit>,
    /// A PostgreSQL transaction is being read into it.
    mid_transaction: bool,
}

impl Group {
    /// An event of `txn`, `bytes` long, went into the Kafka transaction.
    pub fn sent(&mut self, txn: TxnId, bytes: usize, now: Instant) {
        self.opened_at.get_or_insert(now);
        self.events += 1;
        self.bytes += bytes;
        self.mid_transaction = true;
        match self.txns.last_mut() {
            Some((t, n)) if *t == txn => *n += 1,
            _ => self.txns.push((txn, 1)),
        }
    }

    /// A PostgreSQL transaction began.
    pub fn begin(&mut self) {
        self.mid_transaction = true;
    }

    /// An event of `txn` was parked instead of sent: the Kafka transaction
    /// opens all the same, so that its progress record (alone, if nothing
    /// else is sent) comes to cover the parked event's PostgreSQL
    /// transaction, and a replay never handles it again once a redrive
    /// handed its sequence back (see `crate::relay`'s parking).
    pub fn parked(&mut self, txn: TxnId, now: Instant) {
        self.opened_at.get_or_insert(now);
        if self.txns.last().is_none_or(|(t, _)| *t != txn) {
            self.txns.push((txn, 0));
        }
    }

    /// A PostgreSQL transaction's commit was read.
    pub fn commit(&mut self, last: LastCommit) {
        self.mid_transaction = false;
        if self.opened_at.is_some() {
            self.transactions += 1;
            self.last = Some(last);
        }
    }

    /// Nothing was sent into it.
    pub fn is_empty(&self) -> bool {
        self.opened_at.is_none()
    }

    /// Whether to commit now: at a PostgreSQL commit, with a bound reached.
    pub fn due(&self, limits: &Limits, now: Instant) -> bool {
        let Some(opened) = self.opened_at else {
            return false;
        };
        !self.mid_transaction
            && self.last.is_some()
            && (self.events >= limits.max_events
                || self.bytes >= limits.max_bytes
                || now.duration_since(opened) >= limits.max_wait)
    }

    /// It holds `max_events` events or `max_bytes` bytes.
    pub fn over_size(&self, limits: &Limits) -> bool {
        self.events >= limits.max_events || self.bytes >= limits.max_bytes
    }

    /// Since its first event was sent.
    pub fn age(&self) -> Option<Duration> {
        self.opened_at.map(|o| o.elapsed())
    }

    /// When `max_wait` runs out, if it is still ahead.
    pub fn deadline(&self, limits: &Limits) -> Option<Instant> {
        self.opened_at.map(|o| o + limits.max_wait)
    }

    /// A PostgreSQL transaction is half read into it.
    pub fn mid_transaction(&self) -> bool {
        self.mid_transaction
    }

    pub fn last(&self) -> Option<LastCommit> {
        self.last
    }

    /// The last PostgreSQL transaction with an event in it.
    pub fn last_txn(&self) -> Option<TxnId> {
        self.txns.last().map(|(t, _)| *t)
    }

    pub fn events(&self) -> usize {
        self.events
    }

    pub fn transactions(&self) -> u64 {
        self.transactions
    }

    /// Ends the group: the events per PostgreSQL transaction, to count as
    /// acknowledged once the commit succeeded.
    pub fn take(&mut self) -> Vec<(TxnId, usize)> {
        let txns = std::mem::take(&mut self.txns);
        *self = Group {
            mid_transaction: self.mid_transaction,
            ..Group::default()
        };
        txns
    }
}

/// A record Kafka refused inside a transaction, for the replay to set
/// aside: its dead letter (or, if that was refused too, the stub) goes in
/// its place.
#[derive(Clone, Debug)]
pub struct Refused {
    pub reason: &'static str,
    pub error: String,
    pub topic: String,
    pub omit_payload: bool,
    /// Kafka refused the dead letter too: send its stub.
    pub stub: bool,
}

impl Refused {
    pub fn new(
        reason: &'static str,
        error: &rdkafka::error::KafkaError,
        topic: String,
        omit_payload: bool,
        stub: bool,
    ) -> Self {
        Refused {
            reason,
            error: error.to_string(),
            topic,
            omit_payload,
            stub,
        }
    }
}

pub use crate::lsn::RowPos;

/// Refused records by their place in the stream, kept across sessions
/// until the slot has confirmed their transaction.
#[derive(Debug, Default)]
pub struct RefusedRecords(BTreeMap<RowPos, Refused>);

impl RefusedRecords {
    pub fn get(&self, pos: RowPos) -> Option<&Refused> {
        self.0.get(&pos)
    }

    /// Remembers a refusal. A refused dead letter keeps what is known of
    /// the record's own refusal, and asks for the stub.
    pub fn insert(&mut self, pos: RowPos, refused: Refused) {
        match self.0.get_mut(&pos) {
            Some(known) if refused.stub => known.stub = true,
            _ => {
                self.0.insert(pos, refused);
            }
        }
    }

    /// Forgets the rows of transactions the slot has confirmed: a commit
    /// at or past `confirmed` may still be replayed. A transaction still
    /// open when other commits and keepalives move the slot is not
    /// affected: its commit lies after everything confirmed.
    pub fn forget_through(&mut self, confirmed: Lsn) {
        self.0.retain(|pos, _| pos.commit_lsn >= confirmed);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Where a session stands with respect to the progress record.
#[derive(Debug)]
pub struct Transactions {
    pub limits: Limits,
    pub progress_topic: String,
    /// PostgreSQL transactions committed at or below this LSN are in Kafka.
    pub skip_through: Option<Lsn>,
    pub group: Group,
    /// The open Kafka transaction is closing: new stream events are held
    /// until its commit starts.
    pub closing: bool,
    /// The progress record is in the open Kafka transaction.
    pub progress_sent: bool,
    /// Who writes the progress records.
    pub identity: Identity,
}

/// What each progress record says about its writer.
#[derive(Clone, Debug)]
pub struct Identity {
    /// `host/pid` of this outboxd.
    pub writer: String,
    pub slot: String,
    pub database: String,
    pub system_id: String,
    pub timeline: u32,
}

/// What the progress record read at start means for this server.
#[derive(Debug, PartialEq, Eq)]
pub enum Resume {
    /// No record: start at the slot.
    FromSlot,
    /// Skip PostgreSQL transactions committed at or below this LSN.
    SkipThrough(Lsn),
    /// The record was written on an ancestor timeline, before that
    /// timeline's switch point: that WAL is the same on this timeline, so
    /// skip through it as through a record of this timeline.
    SkipThroughAncestor { lsn: Lsn, record: u32, switch: Lsn },
    /// The record was written on another timeline (a promotion or a
    /// point-in-time recovery) and not before its switch point on the way
    /// to this one (or the history is unknown); LSNs past the switch may
    /// have been reused, so it is not trusted to skip: start at the slot
    /// (duplicates possible, no loss).
    OtherTimeline { record: u32, server: u32 },
}

/// A progress record that belongs to another PostgreSQL cluster or slot.
#[derive(Debug, thiserror::Error)]
#[error("the progress record for slot {slot:?} in topic {topic:?} was written for PostgreSQL system {record} ({database:?}), but this server is system {server}: its LSNs say nothing about this server, and trusting them could skip events. If this server replaces that one for good, reset the progress (docs/exactly-once.md, \"Resetting the progress\"); otherwise use another progress topic or slot name")]
pub struct ForeignProgress {
    pub slot: String,
    pub topic: String,
    pub record: String,
    pub database: String,
    pub server: String,
}

/// `host/pid`, naming this process in progress records.
pub fn writer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    format!("{}/{}", host.trim(), std::process::id())
}

impl Transactions {
    pub fn new(config: &ExactlyOnceConfig, progress_topic: String, identity: Identity) -> Self {
        Transactions {
            limits: Limits::from(config),
            progress_topic,
            skip_through: None,
            group: Group::default(),
            closing: false,
            progress_sent: false,
            identity,
        }
    }

    /// Decides where to resume from the record read at start.
    /// `history` is this server's timeline history (`None` on timeline 1,
    /// or when it could not be read): it says whether a record of an
    /// ancestor timeline still holds here.
    pub fn resume(
        &mut self,
        record: Option<&ProgressRecord>,
        history: Option<&TimelineHistory>,
    ) -> Result<Resume, ProgressError> {
        let Some(r) = record else {
            return Ok(Resume::FromSlot);
        };
        let lsn = r.commit_lsn()?;
        if r.timeline != self.identity.timeline {
            // The whole commit record must lie before the switch point.
            let end = r.end_lsn()?;
            let switch = history.and_then(|h| h.switch_point(r.timeline));
            return Ok(match switch {
                Some(switch) if r.timeline < self.identity.timeline && end <= switch => {
                    self.skip_through = Some(lsn);
                    Resume::SkipThroughAncestor {
                        lsn,
                        record: r.timeline,
                        switch,
                    }
                }
                _ => Resume::OtherTimeline {
                    record: r.timeline,
                    server: self.identity.timeline,
                },
            });
        }
        self.skip_through = Some(lsn);
        Ok(Resume::SkipThrough(lsn))
    }

    /// Checks that a record was written for this server.
    pub fn check_owner(&self, r: &ProgressRecord) -> Result<(), ForeignProgress> {
        if r.system_id == self.identity.system_id {
            return Ok(());
        }
        Err(ForeignProgress {
            slot: self.identity.slot.clone(),
            topic: self.progress_topic.clone(),
            record: r.system_id.clone(),
            database: r.database.clone(),
            server: self.identity.system_id.clone(),
        })
    }

    /// Whether a PostgreSQL transaction committing at `final_lsn` still
    /// has to be published (it is not in Kafka already).
    pub fn admit(&self, final_lsn: Lsn) -> bool {
        self.skip_through.is_none_or(|through| final_lsn > through)
    }

    /// The progress record for the open group, as a Kafka record.
    pub fn progress_record(&self, now: chrono::DateTime<chrono::Utc>) -> Option<KafkaRecord> {
        let last = self.group.last()?;
        let commit_time = chrono::DateTime::from_timestamp_micros(last.commit_time)
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let record = ProgressRecord {
            version: PROGRESS_VERSION,
            slot: self.identity.slot.clone(),
            database: self.identity.database.clone(),
            system_id: self.identity.system_id.clone(),
            timeline: self.identity.timeline,
            commit_lsn: last.commit_lsn.to_string(),
            end_lsn: last.end_lsn.to_string(),
            commit_time,
            written_at: now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            transactions: self.group.transactions(),
            events: self.group.events() as u64,
            writer: self.identity.writer.clone(),
        };
        Some(KafkaRecord {
            topic: self.progress_topic.clone(),
            key: self.identity.slot.clone().into_bytes(),
            value: Some(record.encode()),
            headers: vec![(
                "outboxd.progress.version".into(),
                PROGRESS_VERSION.to_string().into_bytes(),
            )],
            timestamp_ms: now.timestamp_millis(),
            partition: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            writer: "host/1".into(),
            slot: "s".into(),
            database: "db".into(),
            system_id: "7300000000000000001".into(),
            timeline: 1,
        }
    }

    fn limits() -> Limits {
        Limits {
            max_events: 3,
            max_bytes: 1000,
            max_wait: Duration::from_millis(50),
        }
    }

    #[test]
    fn a_group_ends_only_at_a_postgres_commit_past_a_bound() {
        let now = Instant::now();
        let mut g = Group::default();
        assert!(!g.due(&limits(), now + Duration::from_secs(9)), "empty");
        g.begin();
        for _ in 0..5 {
            g.sent(TxnId::for_tests(0), 10, now);
        }
        assert!(!g.due(&limits(), now), "over max_events but mid-transaction");
        let last = LastCommit {
            commit_lsn: Lsn(100),
            end_lsn: Lsn(108),
            commit_time: 0,
        };
        g.commit(last);
        assert!(g.due(&limits(), now), "at the commit");
        assert_eq!(g.last(), Some(last));
        assert_eq!(g.take(), vec![(TxnId::for_tests(0), 5)]);
        assert!(g.is_empty());

        g.begin();
        g.sent(TxnId::for_tests(1), 10, now);
        g.commit(last);
        assert!(!g.due(&limits(), now + Duration::from_millis(10)), "no bound yet");
        assert!(g.due(&limits(), now + Duration::from_millis(50)), "max_wait");
        assert_eq!(g.deadline(&limits()), Some(now + Duration::from_millis(50)));
        g.take();
        g.begin();
        g.sent(TxnId::for_tests(2), 2000, now);
        g.commit(last);
        assert!(g.due(&limits(), now), "max_bytes");
        assert!(g.over_size(&limits()));
    }

    #[test]
    fn a_parked_event_opens_a_group_whose_progress_record_covers_it() {
        let now = Instant::now();
        let mut g = Group::default();
        g.begin();
        g.parked(TxnId::for_tests(7), now);
        g.parked(TxnId::for_tests(7), now);
        assert!(!g.is_empty(), "a parked event opens the Kafka transaction");
        let last = LastCommit {
            commit_lsn: Lsn(300),
            end_lsn: Lsn(308),
            commit_time: 0,
        };
        g.commit(last);
        assert_eq!(
            g.last(),
            Some(last),
            "its progress record names the parked event's transaction"
        );
        assert_eq!(g.last_txn(), Some(TxnId::for_tests(7)));
        assert_eq!(g.events(), 0);
        assert!(
            g.due(&limits(), now + Duration::from_millis(50)),
            "committed at max_wait"
        );
        assert_eq!(g.take(), vec![(TxnId::for_tests(7), 0)]);
    }

    #[test]
    fn refused_rows_are_kept_until_their_transaction_is_confirmed() {
        let refused = || Refused {
            reason: "too_large",
            error: "e".into(),
            topic: "t".into(),
            omit_payload: true,
            stub: false,
        };
        let mut r = RefusedRecords::default();
        // Two rows of one COPY: the same insert LSN, different places.
        let (a, b) = (
            RowPos {
                commit_lsn: Lsn(0x9000),
                index: 0,
            },
            RowPos {
                commit_lsn: Lsn(0x9000),
                index: 1,
            },
        );
        r.insert(b, refused());
        assert!(r.get(a).is_none() && r.get(b).is_some());
        // Other commits, and keepalives, confirm past the rows' inserts
        // while their transaction is still open: kept.
        r.forget_through(Lsn(0x8FFF));
        r.forget_through(Lsn(0x9000));
        assert!(r.get(b).is_some());
        r.forget_through(Lsn(0x9030));
        assert!(r.is_empty());
    }

    #[test]
    fn empty_postgres_transactions_do_not_open_a_group() {
        let mut g = Group::default();
        g.begin();
        g.commit(LastCommit {
            commit_lsn: Lsn(1),
            end_lsn: Lsn(2),
            commit_time: 0,
        });
        assert!(g.is_empty());
        assert_eq!(g.last(), None);
        assert!(!g.due(&limits(), Instant::now() + Duration::from_secs(1)));
    }

    #[test]
    fn progress_records_round_trip_and_skip_what_is_in_kafka() {
        let mut t = Transactions::new(
            &ExactlyOnceConfig::default(),
            "outboxd.progress".into(),
            identity(),
        );
        t.group.begin();
        t.group.sent(TxnId::for_tests(0), 1, Instant::now());
        t.group.commit(LastCommit {
            commit_lsn: Lsn(0x16B_3748),
            end_lsn: Lsn(0x16B_3778),
            commit_time: 1_700_000_000_000_000,
        });
        let rec = t.progress_record(chrono::Utc::now()).expect("a record");
        assert_eq!(rec.topic, "outboxd.progress");
        assert_eq!(rec.key, b"s");
        let decoded = ProgressRecord::decode(rec.value_bytes()).unwrap();
        assert_eq!(decoded.commit_lsn, "0/16B3748");
        assert_eq!(decoded.events, 1);
        t.check_owner(&decoded).unwrap();

        let mut fresh = Transactions::new(
            &ExactlyOnceConfig::default(),
            "outboxd.progress".into(),
            identity(),
        );
        assert!(fresh.admit(Lsn(1)));
        assert_eq!(
            fresh.resume(Some(&decoded), None).unwrap(),
            Resume::SkipThrough(Lsn(0x16B_3748))
        );
        assert!(!fresh.admit(Lsn(0x16B_3748)), "at the record: in Kafka");
        assert!(fresh.admit(Lsn(0x16B_3749)));

        let mut promoted = Transactions::new(
            &ExactlyOnceConfig::default(),
            "outboxd.progress".into(),
            Identity {
                timeline: 2,
                ..identity()
            },
        );
        assert_eq!(
            promoted.resume(Some(&decoded), None).unwrap(),
            Resume::OtherTimeline { record: 1, server: 2 }
        );
        assert!(promoted.admit(Lsn(1)), "another timeline skips nothing");
        // Timeline 1 left after the record's commit: the record holds here.
        let after = TimelineHistory::parse("1\t0/16B3778\tno recovery target specified\n").unwrap();
        assert_eq!(
            promoted.resume(Some(&decoded), Some(&after)).unwrap(),
            Resume::SkipThroughAncestor {
                lsn: Lsn(0x16B_3748),
                record: 1,
                switch: Lsn(0x16B_3778)
            }
        );
        assert!(!promoted.admit(Lsn(0x16B_3748)));
        assert!(promoted.admit(Lsn(0x16B_3749)));
        // ... left inside the commit record, or before it: not trusted.
        for history in ["1\t0/16B3777\tr\n", "1\t0/1000000\tr\n", "3\t0/FFFFFFFF\tr\n"] {
            let mut p = Transactions::new(
                &ExactlyOnceConfig::default(),
                "outboxd.progress".into(),
                Identity {
                    timeline: 2,
                    ..identity()
                },
            );
            let h = TimelineHistory::parse(history).unwrap();
            assert_eq!(
                p.resume(Some(&decoded), Some(&h)).unwrap(),
                Resume::OtherTimeline { record: 1, server: 2 },
                "{history}"
            );
            assert!(p.admit(Lsn(1)));
        }

        let other = Transactions::new(
            &ExactlyOnceConfig::default(),
            "outboxd.progress".into(),
            Identity {
                system_id: "42".into(),
                ..identity()
            },
        );
        let e = other.check_owner(&decoded).unwrap_err().to_string();
        assert!(e.contains("7300000000000000001") && e.contains("reset"), "{e}");
    }

    #[test]
    fn foreign_or_future_records_are_refused() {
        assert!(ProgressRecord::decode(b"{}").is_err());
        assert!(ProgressRecord::decode(b"not json").is_err());
        let mut t = Transactions::new(
            &ExactlyOnceConfig::default(),
            "outboxd.progress".into(),
            identity(),
        );
        t.group.sent(TxnId::for_tests(0), 1, Instant::now());
        t.group.commit(LastCommit {
            commit_lsn: Lsn(1),
            end_lsn: Lsn(2),
            commit_time: 0,
        });
        let rec = t.progress_record(chrono::Utc::now()).unwrap();
        let mut v: serde_json::Value = serde_json::from_slice(rec.value_bytes()).unwrap();
        v["version"] = 2.into();
        let e = ProgressRecord::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(e.to_string().contains("version 2"), "{e}");
        v["version"] = 1.into();
        v["commitLsn"] = "zz".into();
        assert!(ProgressRecord::decode(&serde_json::to_vec(&v).unwrap()).is_err());
    }

    #[test]
    fn a_reader_polls_through_what_librdkafka_recovers_from() {
        use RDKafkaErrorCode as C;
        let poll = |code| poll_error("p", KafkaError::MessageConsumption(code));
        for code in [
            C::BrokerTransportFailure,
            C::AllBrokersDown,
            C::Resolve,
            C::NotLeaderForPartition,
        ] {
            assert!(poll(code).is_none(), "{code:?}");
        }
        let denied = poll(C::TopicAuthorizationFailed).unwrap();
        assert!(matches!(denied, ProgressError::Denied { .. }), "{denied:?}");
        assert!(!denied.is_transient());
        let other = poll(C::InvalidMessage).unwrap();
        assert!(matches!(other, ProgressError::Kafka(_)) && other.is_transient());
    }

    #[test]
    fn the_consumer_leaves_producer_settings_out() {
        let text = "brokers = \"k:9092\"\n[options]\n\"linger.ms\" = \"50\"\n\"security.protocol\" = \"SASL_SSL\"\n\"isolation.level\" = \"read_uncommitted\"\n";
        let cfg: KafkaConfig = toml::from_str(text).unwrap();
        let c = consumer_config(&cfg);
        assert_eq!(c.get("linger.ms"), None);
        assert_eq!(c.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(
            c.get("isolation.level"),
            Some("read_committed"),
            "never overridden"
        );
    }

    /// The register's writer is made with `kafka.options` a user may set
    /// for the relay's producers: `enable.gapless.guarantee` (which the
    /// docs suggest) needs idempotence, which the writer turns off, and
    /// librdkafka would refuse the pair (found by review: every register
    /// write then failed, and with it the detection of a lost slot).
    #[test]
    fn the_register_writer_is_made_with_the_gapless_guarantee_asked_for() {
        let text = "brokers = \"127.0.0.1:9\"\n[options]\n\"enable.gapless.guarantee\" = \"true\"\n\"enable.idempotence\" = \"true\"\n\"acks\" = \"1\"\n";
        let cfg: KafkaConfig = toml::from_str(text).unwrap();
        let config = plain_writer_config(&cfg, Duration::from_secs(1));
        assert_eq!(config.get("enable.idempotence"), Some("false"));
        assert_eq!(config.get("acks"), Some("all"), "never overridden");
        let made: Result<rdkafka::producer::BaseProducer, _> = config.create();
        assert!(made.is_ok(), "{:?}", made.err());
    }
}
