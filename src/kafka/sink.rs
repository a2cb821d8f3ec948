//! The Kafka side: an idempotent producer, topic creation, broker checks.
//!
//! Records are enqueued with `send_reported` (the relay: the report comes
//! under a ticket in the sink's report queue, taken in batches) or `send`
//! (a future per record), neither of which waits for the broker (see
//! [`crate::kafka::delivery`]). The relay retires records as
//! acknowledgements arrive, in any order. When librdkafka's queue is full,
//! the send says so and the caller first waits for an acknowledgement
//! (backpressure), instead of blocking a thread.
//!
//! A sink sends on a [`Lane`] of its producer. Its producer is its own
//! ([`KafkaSink::build`]: transactional sinks, commands, and a relay that
//! isolates a refused record), or one that the at-least-once sources of a
//! process share ([`crate::kafka::clients::KafkaClients`]). After a failed
//! session the relay builds a new sink. An own producer is dropped with the
//! old one, which purges what it still queued (so nothing stale lands after
//! the replay from the slot), and the new producer starts with a fresh
//! idempotent identity (an old one may be fenced for good). A shared
//! producer stays: it purged its queue when the delivery failed, and it is
//! replaced only when it has a fatal error (see [`crate::kafka::delivery`]).
//!
//! Defaults that protect ordering and durability, applied before the
//! user's `kafka.options` (which may tune, but not turn off, idempotence):
//! `enable.idempotence=true`, `acks=all`. With idempotence librdkafka
//! retries without reordering a partition's messages.

use std::collections::HashSet;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::producer::Producer as _;

pub use crate::kafka::delivery::Report;
use crate::kafka::delivery::{Awaited, Lane, Producer, ReportQueue, Sharing, Stale, Ticket};
use crate::kafka::native::Outgoing;

use crate::config::KafkaConfig;
use crate::kafka::records::{HeaderName, KafkaRecord};
use crate::kafka::FastMap;

/// Kafka could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KafkaSinkError {
    #[error("invalid Kafka client settings: {0}; check kafka.brokers and kafka.options")]
    Config(String),
    #[error("cannot reach the Kafka brokers {brokers}: {source}; check kafka.brokers and the network")]
    Unreachable { brokers: String, source: KafkaError },
    #[error("topic {topic:?} does not exist and kafka.create_topics is false: create it (for example kafka-topics.sh --create --topic {topic} --partitions N --replication-factor N) or set kafka.create_topics = true")]
    TopicMissing { topic: String },
    #[error("cannot create topic {topic:?}: {reason}")]
    TopicCreate {
        topic: String,
        reason: String,
        /// The cluster was busy or unreachable; a later try may succeed.
        transient: bool,
    },
    #[error("topic {topic:?} was created but is not yet visible in the cluster metadata")]
    TopicNotVisible { topic: String },
    #[error("Kafka refused record for topic {topic:?}: {source}")]
    Produce { topic: String, source: KafkaError },
    #[error("Kafka did not acknowledge a record for topic {topic:?}: {source}")]
    Delivery { topic: String, source: KafkaError },
    #[error("a record with a value of {bytes} bytes for topic {topic:?} does not fit librdkafka's queue even when it is empty: raise kafka.options \"queue.buffering.max.kbytes\" above the largest record (or remove it; the default is 1 GiB)")]
    QueueTooSmall { topic: String, bytes: usize },
    #[error("the Kafka producer shut down with records in flight")]
    Canceled,
    #[error("the shared Kafka producer purged its unsent records after another delivery failed; they are sent again in order")]
    Purged,
    #[error("Kafka reported a record of partition {partition} delivered without an offset, so it may never have been stored (librdkafka's implicit acknowledgement: a later request of the partition succeeded while this one waited for a retry); the session restarts and sends it again from the slot")]
    NotStored { partition: i32 },
    #[error("another producer with transactional.id {id:?} took over ({source}): another outboxd on the same slot (or a stale one) now publishes; this one stops streaming. If two outboxd on different slots share kafka.exactly_once.transactional_id, give each its own")]
    Fenced { id: String, source: KafkaError },
    #[error("Kafka transaction {op} failed: {source}; aborting it and replaying from the progress record")]
    Transaction { op: &'static str, source: KafkaError },
    #[error("Kafka denied outboxd the transactional.id {id:?} ({source}): grant its principal WRITE and DESCRIBE on that TransactionalId (and IDEMPOTENT_WRITE on the cluster for older brokers), then restart")]
    TransactionDenied { id: String, source: KafkaError },
}

impl KafkaSinkError {
    /// Whether a restart (reconnect and replay from the slot) may help.
    pub fn is_transient(&self) -> bool {
        match self {
            KafkaSinkError::Unreachable { .. }
            | KafkaSinkError::Canceled
            | KafkaSinkError::Purged
            | KafkaSinkError::NotStored { .. } => true,
            KafkaSinkError::Delivery { source, .. } | KafkaSinkError::Produce { source, .. } => {
                Refusal::of(source) == Refusal::Transient
            }
            KafkaSinkError::TopicNotVisible { .. } => true,
            KafkaSinkError::TopicCreate { transient, .. } => *transient,
            // Fenced: the next session finds out whether another outboxd
            // leads (then this one waits as a standby) or takes over.
            KafkaSinkError::Fenced { .. } | KafkaSinkError::Transaction { .. } => true,
            KafkaSinkError::Config(_)
            | KafkaSinkError::QueueTooSmall { .. }
            | KafkaSinkError::TopicMissing { .. }
            | KafkaSinkError::TransactionDenied { .. } => false,
        }
    }

    /// A short, bounded label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            KafkaSinkError::Config(_) | KafkaSinkError::QueueTooSmall { .. } => "config",
            KafkaSinkError::Unreachable { .. } => "unreachable",
            KafkaSinkError::TopicMissing { .. } => "topic_missing",
            KafkaSinkError::TopicCreate { .. } | KafkaSinkError::TopicNotVisible { .. } => "topic_create",
            KafkaSinkError::Produce { .. } => "produce",
            KafkaSinkError::Delivery { .. } => "delivery",
            KafkaSinkError::Canceled => "canceled",
            KafkaSinkError::Purged => "purged",
            KafkaSinkError::NotStored { .. } => "not_stored",
            KafkaSinkError::Fenced { .. } => "fenced",
            KafkaSinkError::Transaction { .. } => "transaction",
            KafkaSinkError::TransactionDenied { .. } => "denied",
        }
    }
}

impl Report {
    /// The report as a result: stored, or the error that says why not.
    pub fn into_result(self) -> Result<(i32, i64), KafkaSinkError> {
        match self {
            Report::Stored { partition, offset } => Ok((partition, offset)),
            Report::Failed(source, msg) => Err(KafkaSinkError::Delivery {
                topic: rdkafka::message::Message::topic(&msg).to_owned(),
                source,
            }),
            Report::Unproven { partition } => Err(KafkaSinkError::NotStored { partition }),
            Report::Canceled => Err(KafkaSinkError::Canceled),
        }
    }
}

/// What a Kafka error about a record means for the relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A later try may succeed: the network, a leader change, a timeout, a
    /// partition short of in-sync replicas.
    Transient,
    /// Kafka refuses the record, or the batch it travelled in, for good.
    Record {
        /// A bounded label for metrics and the dead letter's `dlq.reason`.
        reason: &'static str,
        /// The payload is what is too large: leave it out of the dead letter.
        omit_payload: bool,
    },
    /// outboxd may not write there: an operator must grant access. Never a
    /// reason to dead-letter a valid event.
    Denied,
}

impl Refusal {
    pub fn of(e: &KafkaError) -> Refusal {
        let Some(code) = e.rdkafka_error_code() else {
            return Refusal::Transient;
        };
        match code {
            RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::MessageBatchTooLarge
            | RDKafkaErrorCode::InvalidMessageSize => Refusal::Record {
                reason: "too_large",
                omit_payload: true,
            },
            RDKafkaErrorCode::InvalidTimestamp => Refusal::Record {
                reason: "bad_timestamp",
                omit_payload: false,
            },
            // A partition a `partition` placement picked that the topic
            // does not have (librdkafka's local error, once it knows the
            // topic's partitions).
            RDKafkaErrorCode::UnknownPartition => Refusal::Record {
                reason: "bad_partition",
                omit_payload: false,
            },
            RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidMessage => Refusal::Record {
                reason: "refused",
                omit_payload: false,
            },
            RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::TransactionalIdAuthorizationFailed => Refusal::Denied,
            _ => Refusal::Transient,
        }
    }
}

/// librdkafka's complaint about a setting, naming the key but never its
/// value: librdkafka quotes values, and `kafka.options` holds passwords.
pub(crate) fn describe_config_error(e: &KafkaError, cfg: &KafkaConfig) -> String {
    let mut text = match e {
        KafkaError::ClientConfig(_, description, key, _) => format!("{description} (key {key:?})"),
        other => other.to_string(),
    };
    let mut values: Vec<&str> = cfg
        .options
        .values()
        .map(String::as_str)
        .filter(|v| v.len() > 1)
        .collect();
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    for v in values {
        text = text.replace(v, "<redacted>");
    }
    text
}

/// Properties only a producer knows, which a consumer would warn about.
pub(crate) const PRODUCER_ONLY: &[&str] = &[
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "enable.gapless.guarantee",
    "transactional.id",
    "transaction.timeout.ms",
    "linger.ms",
    "queue.buffering.max.ms",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
    "queue.buffering.backpressure.threshold",
    "batch.num.messages",
    "batch.size",
    "compression.codec",
    "compression.type",
    "compression.level",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "request.timeout.ms",
    "message.send.max.retries",
    "retries",
    "partitioner",
    "sticky.partitioning.linger.ms",
    "delivery.report.only.error",
    "queuing.strategy",
    "produce.offset.report",
    "enable.sparse.connections",
];

/// The librdkafka settings for a config.
pub fn client_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("client.id", "outboxd")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set(
            "queue.buffering.max.messages",
            (cfg.max_inflight_ceiling() * 2).max(100_000).to_string(),
        )
        .set("message.timeout.ms", "120000");
    for (k, v) in &cfg.options {
        c.set(k, v);
    }
    c
}

/// The producer's settings: [`client_config`] and what only the producer
/// needs. `kafka.options` still win.
pub(crate) fn producer_config(cfg: &KafkaConfig, kind: &SinkKind) -> ClientConfig {
    let mut client = client_config(cfg);
    // librdkafka learns the cluster's brokers from the bootstrap
    // connection and then retires it, failing a metadata request still in
    // flight on it; with sparse connections the retry waits out a
    // connection-suppression window (about 50 ms at the default reconnect
    // backoff). The producer talks to every partition leader anyway: let
    // it connect to each broker as soon as it learns of it, which takes
    // the first event's metadata from ~55 ms to ~5 ms.
    if !cfg.options.contains_key("enable.sparse.connections") {
        client.set("enable.sparse.connections", "false");
    }
    if kind.one_per_batch {
        client.set("batch.num.messages", "1");
    }
    if let Some(limit) = kind.batch_bytes {
        let configured = cfg
            .options
            .get("batch.size")
            .and_then(|b| b.parse::<usize>().ok())
            .unwrap_or(DEFAULT_BATCH_SIZE);
        client.set("batch.size", configured.min(limit).max(1).to_string());
    }
    if let (Some(lease), None, false) = (
        kind.fenced_by_lease,
        &kind.transactional_id,
        cfg.options.contains_key("message.timeout.ms"),
    ) {
        client.set("message.timeout.ms", lease.as_millis().max(1).to_string());
    }
    if let Some(id) = &kind.transactional_id {
        client.set("transactional.id", id);
        // librdkafka wants message.timeout.ms <= transaction.timeout.ms:
        // a record may not outlive the transaction it is in.
        if !cfg.options.contains_key("message.timeout.ms") {
            let txn_timeout = cfg
                .options
                .get("transaction.timeout.ms")
                .map_or(DEFAULT_TRANSACTION_TIMEOUT_MS.to_owned(), String::clone);
            client.set("message.timeout.ms", txn_timeout);
        }
    }
    client
}

/// librdkafka's default `queue.buffering.max.kbytes`.
const DEFAULT_QUEUE_KBYTES: &str = "1048576";

/// librdkafka's queue bounds for a producer the sources share
/// (`crate::kafka::clients`): far above what the sources' budgets let into
/// it. librdkafka reserves nothing for them.
pub(crate) const SHARED_QUEUE_MESSAGES: &str = "10000000";
/// 2^31 - 1 KiB, librdkafka's largest.
pub(crate) const SHARED_QUEUE_KBYTES: &str = "2147483647";

/// `queue.buffering.max.kbytes` as `kafka.options` sets it, else `default`.
fn queue_kbytes(cfg: &KafkaConfig, default: &str) -> u64 {
    cfg.options
        .get("queue.buffering.max.kbytes")
        .map_or(default, String::as_str)
        .trim()
        .parse()
        .unwrap_or(u64::MAX / 1024)
}

/// librdkafka's default `batch.size`.
const DEFAULT_BATCH_SIZE: usize = 1_000_000;

/// librdkafka's default `transaction.timeout.ms`: how long the broker lets
/// a transaction of a vanished outboxd hold `read_committed` consumers
/// back, unless a restart's `init_transactions` aborts it sooner.
const DEFAULT_TRANSACTION_TIMEOUT_MS: &str = "60000";

/// What a failed transactional call of producer `id` means.
fn transaction_error(id: &str, op: &'static str, source: KafkaError) -> KafkaSinkError {
    let id = id.to_owned();
    match source.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch,
        ) => KafkaSinkError::Fenced { id, source },
        Some(
            RDKafkaErrorCode::TransactionalIdAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed,
        ) => KafkaSinkError::TransactionDenied { id, source },
        _ => KafkaSinkError::Transaction { op, source },
    }
}

/// What kind of producer a sink has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SinkKind {
    /// One record per batch (`batch.num.messages = 1`), so that a batch
    /// Kafka refuses is exactly the record it refuses. The relay uses it,
    /// briefly, after a refusal.
    pub one_per_batch: bool,
    /// A producer of its own although the kind could share one: the
    /// relay's deliveries failed on the shared producer, and further
    /// failures must not purge the other sources' queues.
    pub own_producer: bool,
    /// A transactional producer with this `transactional.id`: records go
    /// into Kafka transactions ([`KafkaSink::begin_if_needed`],
    /// [`KafkaSink::commit_transaction`]).
    pub transactional_id: Option<String>,
    /// A leader-elected producer's `message.timeout.ms` (its lease,
    /// `postgres.leader_timeout`), unless `kafka.options` sets one: what a
    /// stopped leader had queued times out before it wakes up to a lost
    /// lease (see `crate::relay::leader`). Transactional producers are fenced by
    /// their `transactional.id` instead.
    pub fenced_by_lease: Option<Duration>,
    /// At most this many bytes per batch (`batch.size`): the smallest
    /// `max.message.bytes` of a topic that refused a batch for its size,
    /// so that records which fit the topic one by one are not refused
    /// together (librdkafka does not split a refused batch).
    pub batch_bytes: Option<usize>,
}

impl SinkKind {
    /// Whether sinks of this kind can share a producer: not a
    /// transactional one (a Kafka transaction belongs to one producer),
    /// and not one whose batches are shaped for one relay's refusal.
    pub fn can_share(&self) -> bool {
        self.transactional_id.is_none()
            && !self.one_per_batch
            && !self.own_producer
            && self.batch_bytes.is_none()
    }
}

/// Result of enqueueing a record.
#[derive(Debug)]
pub enum SendOutcome<T = Awaited> {
    /// Enqueued: its report comes through an [`Awaited`] future, or as its
    /// [`Ticket`] in the sink's [`ReportQueue`].
    Sent(T),
    /// librdkafka's queue is full: wait for an acknowledgement, then retry.
    QueueFull,
}

/// Asks the cluster for metadata, off the async threads. It uses the
/// sink's admin client, never its producer, so it never keeps a replaced
/// producer alive.
#[derive(Clone)]
pub struct BrokerProbe {
    client: std::sync::Arc<AdminClient<DefaultClientContext>>,
    timeout: Duration,
    brokers: String,
}

impl std::fmt::Debug for BrokerProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerProbe")
            .field("brokers", &self.brokers)
            .finish()
    }
}

impl BrokerProbe {
    /// Cluster metadata, for one topic or all.
    async fn metadata(&self, topic: Option<&str>) -> Result<rdkafka::metadata::Metadata, KafkaSinkError> {
        let client = self.client.clone();
        let timeout = self.timeout;
        let topic = topic.map(str::to_owned);
        tokio::task::spawn_blocking(move || client.inner().fetch_metadata(topic.as_deref(), timeout))
            .await
            .map_err(|_| KafkaSinkError::Canceled)?
            .map_err(|source| KafkaSinkError::Unreachable {
                brokers: self.brokers.clone(),
                source,
            })
    }

    /// Succeeds with the number of brokers when the cluster answers.
    pub async fn check(&self) -> Result<usize, KafkaSinkError> {
        Ok(self.metadata(None).await?.brokers().len())
    }
}

/// A lane on a producer, an admin client, and the topics known to exist.
pub struct KafkaSink {
    producer: Lane,
    admin: std::sync::Arc<AdminClient<DefaultClientContext>>,
    probe: BrokerProbe,
    /// Topics proven served in this session (every partition answered),
    /// with their partitions.
    known_topics: FastMap<String, usize>,
    /// The partitions of the event topics this session has written to
    /// (see [`KafkaSink::partitions_in_use`]).
    partitions_in_use: usize,
    /// Topics the session's warm-up found in the metadata: they need no
    /// creation, but still the readiness check before their first record.
    existing_topics: HashSet<String>,
    /// Each known topic's `max.message.bytes`, where it could be read and
    /// records go uncompressed: a record larger is refused here, before
    /// it is sent (see [`KafkaSink::send`]). Filled by a lookup that
    /// [`KafkaSink::ensure_topic`] waits for briefly, then lets finish.
    topic_limits: std::sync::Arc<std::sync::Mutex<TopicLimits>>,
    /// Records go uncompressed (no `compression.type` in `kafka.options`),
    /// so their size in a batch is known before sending.
    uncompressed: bool,
    /// The value bytes librdkafka's queue holds at most
    /// (`queue.buffering.max.kbytes`): a larger value never fits.
    queue_bytes: u64,
    create_topics: bool,
    partitions: i32,
    replication_factor: i32,
    topic_config: Vec<(String, String)>,
    timeout: Duration,
    /// The session's warm-up: topics already served when it began.
    warm_up: Option<tokio::task::JoinHandle<Vec<String>>>,
    /// `Some` for a transactional producer: the current producer's id.
    transactional_id: Option<String>,
    /// A Kafka transaction is open (begun, not yet committed or aborted).
    in_transaction: bool,
    /// Transactional sinks have two producers, used in turn (see
    /// [`KafkaSink::start_commit`]): the one not current, and its id.
    spare: Option<(Lane, String)>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("brokers", &self.probe.brokers)
            .finish()
    }
}

impl KafkaSink {
    pub fn new(cfg: &KafkaConfig, timeout: Duration) -> Result<Self, KafkaSinkError> {
        Self::build(cfg, timeout, &SinkKind::default())
    }

    /// A sink with producers of its own.
    pub fn build(cfg: &KafkaConfig, timeout: Duration, kind: &SinkKind) -> Result<Self, KafkaSinkError> {
        let bad_config = |e| KafkaSinkError::Config(describe_config_error(&e, cfg));
        // Two transactional producers, `<id>-0` and `<id>-1`, take turns.
        let ids = kind
            .transactional_id
            .as_ref()
            .map(|base| [format!("{base}-0"), format!("{base}-1")]);
        let with_id = |id: Option<&String>| SinkKind {
            transactional_id: id.cloned(),
            ..kind.clone()
        };
        let first = ids.as_ref().map(|[a, _]| a);
        // Both producers report to one queue: the relay follows the sink,
        // whichever producer is current.
        let reports = ReportQueue::default();
        let producer = Producer::create(&producer_config(cfg, &with_id(first)), Sharing::Owned)
            .map_err(bad_config)?
            .lane(reports.clone());
        let spare = match &ids {
            Some([_, b]) => Some((
                Producer::create(&producer_config(cfg, &with_id(Some(b))), Sharing::Owned)
                    .map_err(bad_config)?
                    .lane(reports),
                b.clone(),
            )),
            None => None,
        };
        let admin: AdminClient<DefaultClientContext> = client_config(cfg).create().map_err(bad_config)?;
        Ok(Self::assemble(
            cfg,
            timeout,
            (producer, first.cloned()),
            spare,
            std::sync::Arc::new(admin),
        ))
    }

    /// A sink on a new lane of `producer` (shared), with `admin` (shared).
    pub(crate) fn on_lane(
        cfg: &KafkaConfig,
        timeout: Duration,
        producer: &std::sync::Arc<Producer>,
        admin: std::sync::Arc<AdminClient<DefaultClientContext>>,
    ) -> Self {
        let lane = producer.lane(ReportQueue::default());
        Self::assemble(cfg, timeout, (lane, None), None, admin)
    }

    /// A sink on `producer` (a lane, and its `transactional.id` if any).
    fn assemble(
        cfg: &KafkaConfig,
        timeout: Duration,
        (producer, transactional_id): (Lane, Option<String>),
        spare: Option<(Lane, String)>,
        admin: std::sync::Arc<AdminClient<DefaultClientContext>>,
    ) -> Self {
        // The shared producer's queue is set larger (`crate::kafka::clients`).
        let queue_default = match producer.producer().sharing() {
            Sharing::PurgeOnFailure => SHARED_QUEUE_KBYTES,
            Sharing::Owned => DEFAULT_QUEUE_KBYTES,
        };
        KafkaSink {
            probe: BrokerProbe {
                client: admin.clone(),
                timeout,
                brokers: cfg.brokers.clone(),
            },
            producer,
            admin,
            known_topics: FastMap::default(),
            partitions_in_use: 0,
            existing_topics: HashSet::new(),
            topic_limits: std::sync::Arc::default(),
            uncompressed: cfg
                .options
                .iter()
                .filter(|(k, _)| k.as_str() == "compression.type" || k.as_str() == "compression.codec")
                .all(|(_, v)| v == "none"),
            create_topics: cfg.create_topics,
            partitions: cfg.topic_partitions,
            replication_factor: cfg.topic_replication_factor,
            topic_config: cfg.topic_config.clone().into_iter().collect(),
            timeout,
            queue_bytes: queue_kbytes(cfg, queue_default).saturating_mul(1024),
            warm_up: None,
            transactional_id,
            in_transaction: false,
            spare,
        }
    }

    /// Whether the producer is shared with other sinks (and purges its
    /// queue when a delivery fails, see [`crate::kafka::delivery`]).
    pub fn shares_producer(&self) -> bool {
        self.producer.producer().sharing() == Sharing::PurgeOnFailure
    }

    /// The producer's generation (see [`crate::kafka::delivery`]): read it
    /// before hearing the reports of what this sink sent, then
    /// [`KafkaSink::adopt`] it.
    pub fn generation(&self) -> u64 {
        self.producer.producer().generation()
    }

    /// The generation once no purge is under way (see
    /// [`crate::kafka::delivery::Producer::quiet_generation`]).
    pub async fn quiet_generation(&self) -> u64 {
        self.producer.producer().quiet_generation().await
    }

    /// Takes generation `seen`: every record this sink sent before it has
    /// reported, and what came back purged was sent again.
    pub fn adopt(&mut self, seen: u64) {
        self.producer.adopt(seen);
    }

    /// Whether the producer purged since this sink last adopted a generation.
    pub fn is_stale(&self) -> bool {
        self.producer.is_stale()
    }

    /// What a failed transactional call means.
    fn transaction_error(&self, op: &'static str, source: KafkaError) -> KafkaSinkError {
        transaction_error(self.transactional_id.as_deref().unwrap_or_default(), op, source)
    }

    /// Registers the transactional producer with its coordinator. This
    /// fences every earlier producer with the same `transactional.id` and
    /// completes (commits or aborts) whatever transaction it left, so that
    /// a `read_committed` read afterwards sees all it committed.
    pub async fn init_transactions(&self, timeout: Duration) -> Result<(), KafkaSinkError> {
        let init = |producer: &Lane, id: &str| {
            let (producer, id) = (producer.handle(), id.to_owned());
            tokio::task::spawn_blocking(move || {
                producer
                    .init_transactions(timeout)
                    .map_err(|e| transaction_error(&id, "init", e))
            })
        };
        let current = init(
            &self.producer,
            self.transactional_id.as_deref().unwrap_or_default(),
        );
        let spare = self.spare.as_ref().map(|(p, id)| init(p, id));
        current.await.map_err(|_| KafkaSinkError::Canceled)??;
        if let Some(spare) = spare {
            spare.await.map_err(|_| KafkaSinkError::Canceled)??;
        }
        Ok(())
    }

    /// The producer's fatal error, if it has one: after it, every send and
    /// delivery fails with a purge, so this is what to report. A fenced
    /// transactional producer ends here.
    pub fn fatal_error(&self) -> Option<KafkaSinkError> {
        let current = (
            &self.producer,
            self.transactional_id.as_deref().unwrap_or_default(),
        );
        let spare = self.spare.as_ref().map(|(p, id)| (p, id.as_str()));
        [Some(current), spare]
            .into_iter()
            .flatten()
            .find_map(|(producer, id)| {
                let (code, reason) = producer.client().fatal_error()?;
                tracing::debug!(%code, reason, id, "the producer has a fatal error");
                Some(transaction_error(
                    id,
                    "produce",
                    KafkaError::MessageProduction(code),
                ))
            })
    }

    /// Whether a Kafka transaction is open.
    pub fn in_transaction(&self) -> bool {
        self.in_transaction
    }

    /// Opens a Kafka transaction if the producer is transactional and none
    /// is open. Local to the client: no request is sent.
    fn begin_if_needed(&mut self) -> Result<(), KafkaSinkError> {
        if self.transactional_id.is_none() || self.in_transaction {
            return Ok(());
        }
        self.producer
            .begin_transaction()
            .map_err(|e| self.transaction_error("begin", e))?;
        self.in_transaction = true;
        Ok(())
    }

    /// Whether `topic` is known to exist and be served in this session: a
    /// record for it needs no [`KafkaSink::ensure_topic`].
    pub fn knows_topic(&self, topic: &str) -> bool {
        self.known_topics.contains_key(topic)
    }

    /// The partitions of the event topics (and the dead-letter topic) this
    /// session has written to: what its in-flight budget grows with
    /// ([`crate::config::KafkaConfig::inflight_budget`]).
    pub fn partitions_in_use(&self) -> usize {
        self.partitions_in_use
    }

    /// Records and events librdkafka still holds (`rd_kafka_outq_len`).
    pub fn in_flight(&self) -> i32 {
        self.producer.in_flight_count()
    }

    /// Starts committing the open Kafka transaction in the background; the
    /// handle yields the outcome. Call it once every record's delivery has
    /// been reported: librdkafka's commit first flushes, and a flush with
    /// records outstanding sleeps in 100 ms steps.
    ///
    /// The other producer becomes current at once, so the next transaction
    /// can fill while this one commits: a producer's next transaction would
    /// otherwise wait for its coordinator to finish the last one (librdkafka
    /// retries AddPartitionsToTxn every 20 ms meanwhile). The caller keeps
    /// their order: one commit at a time, and no record of the next
    /// transaction before every record of this one is acknowledged.
    pub fn start_commit(&mut self, timeout: Duration) -> tokio::task::JoinHandle<Result<(), KafkaSinkError>> {
        let producer = self.producer.handle();
        let id = self.transactional_id.clone().unwrap_or_default();
        self.in_transaction = false;
        if let Some((spare, spare_id)) = self.spare.take() {
            let previous = std::mem::replace(&mut self.producer, spare);
            self.transactional_id = Some(spare_id);
            self.spare = Some((previous, id.clone()));
        }
        tokio::task::spawn_blocking(move || {
            producer
                .commit_transaction(timeout)
                .map_err(|e| transaction_error(&id, "commit", e))
        })
    }

    /// Aborts the open Kafka transaction, if any: its records are never
    /// shown to `read_committed` consumers.
    pub async fn abort_transaction(&mut self, timeout: Duration) -> Result<(), KafkaSinkError> {
        if !self.in_transaction {
            return Ok(());
        }
        self.in_transaction = false;
        let producer = self.producer.handle();
        tokio::task::spawn_blocking(move || producer.abort_transaction(timeout))
            .await
            .map_err(|_| KafkaSinkError::Canceled)?
            .map_err(|e| self.transaction_error("abort", e))
    }

    /// A cheap handle that asks the cluster for metadata.
    pub fn probe(&self) -> BrokerProbe {
        self.probe.clone()
    }

    /// Asks the cluster for metadata; returns the number of brokers.
    pub async fn check_brokers(&self) -> Result<usize, KafkaSinkError> {
        self.probe.check().await
    }

    async fn topic_exists(&self, topic: &str) -> Result<bool, KafkaSinkError> {
        let md = self.probe.metadata(Some(topic)).await?;
        Ok(md
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    }

    /// Whether every partition of `topic` has a leader that serves it (it
    /// answers ListOffsets): `Some` with its number of partitions. Asked
    /// through the producer's own client, so that the producer's metadata
    /// is current before its first record.
    async fn topic_ready(&self, topic: &str) -> Option<usize> {
        let producer = self.producer.handle();
        let (topic, timeout) = (topic.to_owned(), self.timeout);
        tokio::task::spawn_blocking(move || {
            let client = producer.client();
            let md = client.fetch_metadata(Some(&topic), timeout).ok()?;
            let t = md.topics().iter().find(|t| t.name() == topic)?;
            let served = |p: &rdkafka::metadata::MetadataPartition| {
                p.leader() >= 0
                    && p.error().is_none()
                    && client.fetch_watermarks(&topic, p.id(), timeout).is_ok()
            };
            let ready =
                t.error().is_none() && !t.partitions().is_empty() && t.partitions().iter().all(served);
            ready.then(|| t.partitions().len())
        })
        .await
        .ok()
        .flatten()
    }

    /// Makes sure `topic` exists, creating it when allowed, and that every
    /// partition is served, and learns its `max.message.bytes` (see
    /// [`KafkaSink::send`]). Cached per session.
    pub async fn ensure_topic(&mut self, topic: &str) -> Result<(), KafkaSinkError> {
        let known = self.known_topics.contains_key(topic);
        self.ensure_topic_with(topic, self.partitions, &[]).await?;
        if !known {
            self.partitions_in_use += self.known_topics.get(topic).copied().unwrap_or(1);
        }
        let unreadable = self.topic_limits.lock().map_or(true, |l| l.unreadable);
        if !known && self.uncompressed && !unreadable {
            let lookup = tokio::spawn(learn_limit(
                self.admin.clone(),
                self.topic_limits.clone(),
                topic.to_owned(),
                self.timeout.min(LIMIT_LOOKUP_TIMEOUT),
            ));
            // A broker answers in milliseconds; one that does not answer
            // DescribeConfigs holds up no record for long.
            let _ = tokio::time::timeout(LIMIT_WAIT, lookup).await;
        }
        Ok(())
    }

    /// The `max.message.bytes` of `topic` (the largest record batch the
    /// broker accepts for it), when it can be read within a few seconds.
    pub async fn topic_max_message_bytes(&self, topic: &str) -> Option<usize> {
        max_message_bytes(&self.admin, topic, self.timeout.min(LIMIT_LOOKUP_TIMEOUT)).await
    }

    /// Whether the progress topic keeps the slot register and the progress
    /// records for good; `Err` when its configuration cannot be read
    /// (DescribeConfigs denied, no answer).
    pub async fn progress_topic_retention(&self, topic: &str) -> Result<Retention, String> {
        let opts = AdminOptions::new().request_timeout(Some(self.timeout.min(LIMIT_LOOKUP_TIMEOUT)));
        let results = self
            .admin
            .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
            .await
            .map_err(|e| e.to_string())?;
        let resource = results.into_iter().next().ok_or_else(|| "no answer".to_owned())?;
        let resource = match resource {
            Ok(r) => r,
            Err(RDKafkaErrorCode::UnknownTopicOrPartition) => return Ok(Retention::Missing),
            Err(code) => return Err(code.to_string()),
        };
        // A topic that does not exist (yet, or not on every broker yet)
        // comes back from Kafka 4 as a resource without entries, not as
        // an error: that is no policy, and certainly not `delete`.
        if resource.entries.is_empty() {
            return Ok(Retention::Missing);
        }
        let value = |name: &str| resource.get(name).and_then(|e| e.value.clone());
        Ok(
            match retention_problem(
                topic,
                value("cleanup.policy").as_deref(),
                value("retention.ms").as_deref(),
                value("retention.bytes").as_deref(),
            ) {
                None => Retention::Kept,
                Some(problem) => Retention::Deletes(problem),
            },
        )
    }

    /// Makes sure the progress topic exists: one partition, compacted (one
    /// record per slot is all it must keep).
    pub async fn ensure_progress_topic(&mut self, topic: &str) -> Result<(), KafkaSinkError> {
        self.ensure_topic_with(topic, 1, &[("cleanup.policy", "compact")])
            .await
    }

    async fn ensure_topic_with(
        &mut self,
        topic: &str,
        partitions: i32,
        overrides: &[(&str, &str)],
    ) -> Result<(), KafkaSinkError> {
        self.absorb_warm_up().await;
        if self.known_topics.contains_key(topic) {
            return Ok(());
        }
        let started = tokio::time::Instant::now();
        if !self.existing_topics.contains(topic) && !self.topic_exists(topic).await? {
            if !self.create_topics {
                return Err(KafkaSinkError::TopicMissing {
                    topic: topic.to_owned(),
                });
            }
            let mut settings: Vec<(&str, &str)> = self
                .topic_config
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .filter(|(k, _)| !overrides.iter().any(|(o, _)| o == k))
                .collect();
            settings.extend_from_slice(overrides);
            let new = settings.iter().fold(
                NewTopic::new(
                    topic,
                    partitions,
                    TopicReplication::Fixed(self.replication_factor),
                ),
                |t, (k, v)| t.set(k, v),
            );
            let opts = AdminOptions::new().operation_timeout(Some(self.timeout));
            let results =
                self.admin
                    .create_topics([&new], &opts)
                    .await
                    .map_err(|e| KafkaSinkError::TopicCreate {
                        topic: topic.to_owned(),
                        reason: format!("{e}; retrying"),
                        transient: true,
                    })?;
            for r in results {
                match r {
                    Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err((_, code)) => return Err(self.topic_create_error(topic, code)),
                }
            }
            tracing::info!(topic, partitions, "created topic");
        }
        // No record goes to a topic before every partition is served, once
        // per session (so for each new producer), whoever created it. A
        // broker creates a new topic's partitions one after another;
        // records produced into that window were lost on Kafka 4.4 with
        // librdkafka 2.12 (the quick start lost the first order on a fresh
        // broker). Where librdkafka then acknowledges implicitly (no
        // offset), the relay replays (`Report::Unproven`); a record the
        // broker took for a duplicate comes back with an offset, and only
        // this wait keeps it from happening. Partitions added to a topic
        // later are found by librdkafka's metadata refresh; their first
        // records are covered by the offset check.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let partitions = loop {
            if let Some(partitions) = self.topic_ready(topic).await {
                break partitions;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(KafkaSinkError::TopicNotVisible {
                    topic: topic.to_owned(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        self.known_topics.insert(topic.to_owned(), partitions);
        tracing::debug!(topic, took = ?started.elapsed(), "topic ready");
        Ok(())
    }

    /// What a refused topic creation means, and what the operator can do.
    fn topic_create_error(&self, topic: &str, code: RDKafkaErrorCode) -> KafkaSinkError {
        let (hint, transient) = match code {
            RDKafkaErrorCode::InvalidReplicationFactor => (
                format!(
                    "kafka.topic_replication_factor = {} is more than the cluster has brokers; lower it, or use -1 for the broker default",
                    self.replication_factor
                ),
                false,
            ),
            RDKafkaErrorCode::InvalidPartitions => (
                "check kafka.topic_partitions".to_owned(),
                false,
            ),
            RDKafkaErrorCode::InvalidConfig | RDKafkaErrorCode::PolicyViolation => (
                "the cluster refused the topic's settings: check kafka.topic_partitions, kafka.topic_replication_factor and [kafka.topic_config]".to_owned(),
                false,
            ),
            RDKafkaErrorCode::TopicAuthorizationFailed | RDKafkaErrorCode::ClusterAuthorizationFailed => (
                "grant outboxd's principal CREATE on the topic (or the cluster), or create the topic yourself and set kafka.create_topics = false".to_owned(),
                false,
            ),
            RDKafkaErrorCode::InvalidTopic => (
                "the name is not a legal Kafka topic name".to_owned(),
                false,
            ),
            _ => ("retrying".to_owned(), true),
        };
        KafkaSinkError::TopicCreate {
            topic: topic.to_owned(),
            reason: format!("{code}; {hint}"),
            transient,
        }
    }

    /// Forgets which topics exist, so the next session checks (and, if
    /// allowed, creates) them again: a broker may have lost them.
    pub fn forget_topics(&mut self) {
        self.known_topics.clear();
        self.partitions_in_use = 0;
        self.existing_topics.clear();
        if let Ok(mut limits) = self.topic_limits.lock() {
            *limits = TopicLimits::default();
        }
        self.warm_up();
    }

    /// Asks for the whole cluster's metadata through the producer's own
    /// client, in the background: while PostgreSQL connects, the producer
    /// reaches its brokers, and every topic that already exists with a
    /// leader for each partition needs no check before its first record.
    /// (Topics outboxd creates still wait for [`KafkaSink::ensure_topic`]'s
    /// readiness check.)
    fn warm_up(&mut self) {
        let producer = self.producer.handle();
        let timeout = self.timeout;
        self.warm_up = Some(tokio::task::spawn_blocking(move || {
            let Ok(md) = producer.client().fetch_metadata(None, timeout) else {
                return Vec::new();
            };
            md.topics()
                .iter()
                .filter(|t| {
                    t.error().is_none()
                        && !t.partitions().is_empty()
                        && t.partitions()
                            .iter()
                            .all(|p| p.leader() >= 0 && p.error().is_none())
                })
                .map(|t| t.name().to_owned())
                .collect()
        }));
    }

    /// Takes in the warm-up's topics, waiting for it if it is still on its
    /// way: it is the metadata request a topic check would make anyway.
    async fn absorb_warm_up(&mut self) {
        let Some(handle) = self.warm_up.take() else {
            return;
        };
        if let Ok(topics) = handle.await {
            tracing::debug!(topics = topics.len(), "topics already served");
            self.existing_topics.extend(topics);
        }
    }

    /// Enqueues a record without waiting for the broker; with a
    /// transactional producer, inside the open Kafka transaction (opening
    /// one if needed).
    ///
    /// A record larger, alone in its batch, than its topic's
    /// `max.message.bytes` is refused here as the broker would refuse it
    /// (`MessageSizeTooLarge`), but synchronously: sent, the broker would
    /// refuse the whole batch around it, and a later batch of the same
    /// partition could be stored ahead of that batch's other records.
    pub fn send(&mut self, rec: &KafkaRecord) -> Result<SendOutcome, KafkaSinkError> {
        self.enqueue(rec, Lane::send_awaited)
    }

    /// As [`KafkaSink::send`], but the report goes to [`KafkaSink::reports`]
    /// under the returned ticket: the relay's way, which takes reports in
    /// batches (see [`crate::kafka::delivery`]).
    pub fn send_reported(&mut self, rec: &KafkaRecord) -> Result<SendOutcome<Ticket>, KafkaSinkError> {
        self.enqueue(rec, Lane::send_batched)
    }

    /// The queue that [`KafkaSink::send_reported`] reports to, for both
    /// producers of a transactional sink. A new sink has a new queue.
    pub fn reports(&self) -> ReportQueue {
        self.producer.reports().clone()
    }

    /// A shared producer that purged since this sink's generation refuses
    /// the send with [`KafkaSinkError::Purged`] (see [`KafkaSink::adopt`]).
    fn enqueue<T>(
        &mut self,
        rec: &KafkaRecord,
        send: impl Fn(&Lane, &Outgoing<'_, HeaderName>) -> Result<KafkaResult<T>, Stale>,
    ) -> Result<SendOutcome<T>, KafkaSinkError> {
        let send = |lane: &Lane, record| send(lane, record).map_err(|Stale| KafkaSinkError::Purged);
        let limit = self
            .topic_limits
            .lock()
            .ok()
            .and_then(|l| l.bytes.get(&rec.topic).copied());
        if let Some(limit) = limit {
            if batch_bytes_alone(rec) > limit {
                return Err(KafkaSinkError::Produce {
                    topic: rec.topic.clone(),
                    source: KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge),
                });
            }
        }
        self.begin_if_needed()?;
        let record = Outgoing {
            topic: &rec.topic,
            partition: rec.partition,
            key: &rec.key,
            value: rec.value.as_deref(),
            headers: &rec.headers,
            timestamp_ms: rec.timestamp_ms,
        };
        let full = |e: &KafkaError| matches!(e, KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull));
        // librdkafka counts a record's value against its queue's bytes: a
        // value larger than all of them never fits, and waiting would
        // never end. (A producer shared with other sources may be full of
        // theirs, so an empty queue is no test.)
        let outcome = match send(&self.producer, &record)? {
            Err(e) if full(&e) && rec.value_len() as u64 > self.queue_bytes => {
                return Err(KafkaSinkError::QueueTooSmall {
                    topic: rec.topic.clone(),
                    bytes: rec.value_len(),
                })
            }
            other => other,
        };
        match outcome {
            Ok(f) => Ok(SendOutcome::Sent(f)),
            Err(e) if full(&e) => Ok(SendOutcome::QueueFull),
            Err(source) => Err(KafkaSinkError::Produce {
                topic: rec.topic.clone(),
                source,
            }),
        }
    }
}

/// The `max.message.bytes` of each topic the session sends to, as far as
/// known.
#[derive(Debug, Default)]
struct TopicLimits {
    bytes: FastMap<String, usize>,
    /// One could not be read (denied, or no answer): not asked again in
    /// this session.
    unreadable: bool,
}

/// Reads `topic`'s `max.message.bytes` into `limits`.
async fn learn_limit(
    admin: std::sync::Arc<AdminClient<DefaultClientContext>>,
    limits: std::sync::Arc<std::sync::Mutex<TopicLimits>>,
    topic: String,
    timeout: Duration,
) {
    let limit = max_message_bytes(&admin, &topic, timeout).await;
    let Ok(mut limits) = limits.lock() else {
        return;
    };
    match limit {
        Some(limit) => {
            limits.bytes.insert(topic, limit);
        }
        None => {
            // Denied, or a broker without DescribeConfigs: records go
            // unchecked, and the broker refuses what it must.
            tracing::warn!(topic, "cannot read the topic's max.message.bytes (DescribeConfigs): a record too large for it is refused by the broker with its whole batch, not set aside before it is sent; grant DESCRIBE_CONFIGS on the topics");
            limits.unreadable = true;
        }
    }
}

/// The `max.message.bytes` of `topic`, when it can be read in `timeout`.
async fn max_message_bytes(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
    timeout: Duration,
) -> Option<usize> {
    let opts = AdminOptions::new().request_timeout(Some(timeout));
    let results = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
        .ok()?;
    let resource = results.into_iter().next()?.ok()?;
    resource.get("max.message.bytes")?.value.as_deref()?.parse().ok()
}

/// How long [`KafkaSink::ensure_topic`] waits for a topic's
/// `max.message.bytes` before the first record goes (the lookup goes on).
const LIMIT_WAIT: Duration = Duration::from_millis(500);

/// How long a topic's configuration (`max.message.bytes`, the progress
/// topic's retention) is waited for: a broker that does not answer
/// DescribeConfigs delays no start by more.
const LIMIT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// What the progress topic does with old records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retention {
    /// It keeps each slot's latest record for good.
    Kept,
    /// It would delete them: why, and the fix.
    Deletes(String),
    /// No such topic (yet): outboxd creates it compacted.
    Missing,
}

/// The bytes of a record batch (format v2, uncompressed) that holds `rec`
/// alone: what the broker compares with the topic's `max.message.bytes`.
/// The batch header is 61 bytes; the record is its length, then its
/// attributes, timestamp and offset deltas (0 alone), key, value and
/// headers, each length a zigzag varint.
pub fn batch_bytes_alone(rec: &KafkaRecord) -> usize {
    fn varint(n: usize) -> usize {
        let mut zigzag = (n as u64) << 1;
        let mut bytes = 1;
        while zigzag >= 0x80 {
            zigzag >>= 7;
            bytes += 1;
        }
        bytes
    }
    let field = |len: usize| varint(len) + len;
    let headers: usize = rec
        .headers
        .iter()
        .map(|(k, v)| field(k.len()) + field(v.len()))
        .sum();
    let body =
        1 + 1 + 1 + field(rec.key.len()) + field(rec.value_len()) + varint(rec.headers.len()) + headers;
    61 + varint(body) + body
}

/// Why a progress topic with these settings would lose its records: each
/// key (slot) must keep its latest record for good. Compaction does;
/// `delete` removes records by age or size unless both are unlimited.
pub fn retention_problem(
    topic: &str,
    cleanup_policy: Option<&str>,
    retention_ms: Option<&str>,
    retention_bytes: Option<&str>,
) -> Option<String> {
    let policy = cleanup_policy.unwrap_or("delete");
    let policies: Vec<&str> = policy.split(',').map(str::trim).collect();
    let deletes = policies.contains(&"delete");
    let forever = retention_ms == Some("-1") && retention_bytes.is_none_or(|b| b == "-1");
    if !deletes || forever {
        return None;
    }
    Some(format!(
        "progress topic {topic} has cleanup.policy={policy} (retention.ms={}): Kafka would delete the slot register's record (and the exactly-once progress record) of a slot idle that long, and a lost slot would then be recreated silently, exactly-once would publish again what Kafka holds. Make it compacted: kafka-configs.sh --bootstrap-server <brokers> --alter --entity-type topics --entity-name {topic} --add-config cleanup.policy=compact",
        retention_ms.unwrap_or("?")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_compacted_progress_topic_keeps_its_records() {
        let p = |policy, ms, bytes| retention_problem("t", policy, ms, bytes);
        assert_eq!(p(Some("compact"), Some("604800000"), Some("-1")), None);
        assert_eq!(p(Some("compact,delete"), Some("-1"), Some("-1")), None);
        assert!(p(Some("compact,delete"), Some("604800000"), Some("-1")).is_some());
        assert_eq!(
            p(Some("delete"), Some("-1"), Some("-1")),
            None,
            "kept for good, if not compacted"
        );
        let e = p(Some("delete"), Some("604800000"), None).unwrap_or_default();
        assert!(
            e.contains("cleanup.policy=compact") && e.contains("604800000"),
            "{e}"
        );
        assert!(p(None, None, None).is_some());
    }

    #[test]
    fn every_record_refusal_is_a_known_metric_label() {
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::InvalidTimestamp,
            RDKafkaErrorCode::InvalidRecord,
        ] {
            let e = KafkaError::MessageProduction(code);
            let Refusal::Record { reason, .. } = Refusal::of(&e) else {
                panic!("{code:?} is a record refusal");
            };
            assert!(crate::metrics::DEAD_LETTER_REASONS.contains(&reason), "{reason}");
        }
    }

    /// A secret given to a librdkafka property that rejects it never
    /// shows in the error; the error names the property.
    #[test]
    fn no_librdkafka_error_echoes_a_secret() {
        for secret in [
            "pa\"ss",
            "back\\slash",
            "new\nline",
            "p@ss/w?rd#1",
            "%zz%",
            "${NESTED}",
        ] {
            let env = |k: &str| (k == "KAFKA_PASSWORD").then(|| secret.to_owned());
            for key in ["sasl.password", "message.max.bytes", "sasl.mechanisms"] {
                let text = format!(
                    "[postgres]\nurl = \"postgres://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n[kafka.options]\n\"{key}\" = \"${{KAFKA_PASSWORD}}\"\n"
                );
                let (c, _) = crate::config::Config::from_toml(&text, env).unwrap();
                if let Err(err) = KafkaSink::new(&c.kafka, Duration::from_secs(1)) {
                    let err = err.to_string();
                    assert!(!err.contains(secret), "{key}={secret:?} in {err}");
                    assert!(err.contains(key), "{key}: {err}");
                }
            }
        }
    }

    fn kafka(options: &[(&str, &str)]) -> KafkaConfig {
        let mut text = String::from("brokers = \"127.0.0.1:9092\"\n[options]\n");
        for (k, v) in options {
            text.push_str(&format!("\"{k}\" = \"{v}\"\n"));
        }
        toml::from_str(&text).expect("a [kafka] table")
    }

    #[test]
    fn the_producer_connects_to_every_broker_it_learns_of_unless_told_otherwise() {
        let c = producer_config(&kafka(&[]), &SinkKind::default());
        assert_eq!(c.get("enable.sparse.connections"), Some("false"));
        assert_eq!(c.get("batch.num.messages"), None);
        assert_eq!(c.get("transactional.id"), None);
        let c = producer_config(
            &kafka(&[]),
            &SinkKind {
                fenced_by_lease: Some(Duration::from_secs(8)),
                ..SinkKind::default()
            },
        );
        assert_eq!(c.get("message.timeout.ms"), Some("8000"), "the leader lease");
        let kind = SinkKind {
            one_per_batch: true,
            transactional_id: Some("outboxd.s".into()),
            fenced_by_lease: Some(Duration::from_secs(8)),
            batch_bytes: None,
            own_producer: false,
        };
        let c = producer_config(&kafka(&[("enable.sparse.connections", "true")]), &kind);
        assert_eq!(c.get("enable.sparse.connections"), Some("true"));
        assert_eq!(c.get("batch.num.messages"), Some("1"));
        assert_eq!(c.get("transactional.id"), Some("outboxd.s"));
        assert_eq!(
            c.get("message.timeout.ms"),
            Some("60000"),
            "within the transaction timeout"
        );
        let c = producer_config(&kafka(&[("transaction.timeout.ms", "90000")]), &kind);
        assert_eq!(c.get("message.timeout.ms"), Some("90000"));
        // Batches no larger than a topic that refused one for its size.
        let small = SinkKind {
            batch_bytes: Some(20_000),
            ..SinkKind::default()
        };
        assert_eq!(
            producer_config(&kafka(&[]), &small).get("batch.size"),
            Some("20000")
        );
        let c = producer_config(&kafka(&[("batch.size", "16384")]), &small);
        assert_eq!(c.get("batch.size"), Some("16384"), "a smaller batch.size stays");
        // The metadata and admin clients keep librdkafka's default.
        assert_eq!(client_config(&kafka(&[])).get("enable.sparse.connections"), None);
    }
}
