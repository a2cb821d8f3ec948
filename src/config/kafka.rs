//! `[kafka]` and `[kafka.exactly_once]`: where events go.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::{secs, yes, HumanDuration};

/// `[kafka]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `host:port,host:port`.
    pub brokers: String,
    /// Create missing topics through the admin API.
    #[serde(default = "yes")]
    pub create_topics: bool,
    /// Partitions of created topics.
    #[serde(default = "default_partitions")]
    pub topic_partitions: i32,
    /// Replication factor of created topics; -1 uses the broker default.
    #[serde(default = "default_replication_factor")]
    pub topic_replication_factor: i32,
    /// Topic-level configs of created topics, for example
    /// `"min.insync.replicas" = "2"`. Topics that already exist are left as
    /// they are.
    #[serde(default)]
    pub topic_config: BTreeMap<String, String>,
    /// Most events sent but not yet acknowledged; reading pauses above it.
    /// Unset, it grows with the partitions a session writes to (see
    /// [`KafkaConfig::inflight_budget`]).
    #[serde(default)]
    pub max_inflight: Option<usize>,
    /// Most bytes (keys, values and headers) sent but not yet
    /// acknowledged; reading pauses above it too. Unset, it grows with the
    /// partitions like `max_inflight`.
    #[serde(default)]
    pub max_inflight_bytes: Option<usize>,
    /// Timeout of metadata and admin requests.
    #[serde(default = "default_admin_timeout")]
    pub admin_timeout: HumanDuration,
    /// `at-least-once` (default) or `exactly-once` (Kafka transactions, for
    /// consumers with `isolation.level = read_committed`).
    #[serde(default)]
    pub delivery: Delivery,
    /// Exactly-once settings; used when `delivery = "exactly-once"`.
    #[serde(default)]
    pub exactly_once: ExactlyOnceConfig,
    /// The compacted topic where outboxd keeps, per slot, the slot
    /// register (both modes: which slots it streamed, so that a lost slot
    /// is noticed) and the exactly-once progress record. Default
    /// `outboxd.progress`; `kafka.exactly_once.progress_topic` is the
    /// older spelling.
    #[serde(default)]
    pub progress_topic: Option<String>,
    /// Keep the slot register (see `progress_topic`), so that a slot that
    /// disappears (a promotion before the slot was synced, a dropped slot)
    /// stops outboxd instead of a new slot silently skipping events.
    /// Exactly-once always keeps it.
    #[serde(default = "yes")]
    pub slot_register: bool,
    /// librdkafka settings, passed as they are.
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let options: BTreeMap<&str, &str> = self.options.keys().map(|k| (k.as_str(), "***")).collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("create_topics", &self.create_topics)
            .field("topic_partitions", &self.topic_partitions)
            .field("topic_replication_factor", &self.topic_replication_factor)
            .field("topic_config", &self.topic_config)
            .field("max_inflight", &self.max_inflight)
            .field("max_inflight_bytes", &self.max_inflight_bytes)
            .field("admin_timeout", &self.admin_timeout)
            .field("delivery", &self.delivery)
            .field("exactly_once", &self.exactly_once)
            .field("progress_topic", &self.progress_topic)
            .field("slot_register", &self.slot_register)
            .field("options", &options)
            .finish()
    }
}

impl KafkaConfig {
    /// The progress topic: `kafka.progress_topic`, else the older
    /// `kafka.exactly_once.progress_topic`, else `outboxd.progress`.
    pub fn progress_topic(&self) -> &str {
        self.progress_topic
            .as_deref()
            .or(self.exactly_once.progress_topic.as_deref())
            .unwrap_or("outboxd.progress")
    }

    /// Whether the slot register is kept: always with exactly-once.
    pub fn keeps_slot_register(&self) -> bool {
        self.slot_register || self.delivery == Delivery::ExactlyOnce
    }

    /// The producer's `transaction.timeout.ms` (librdkafka's default 60 s):
    /// how long the broker lets a Kafka transaction stay open.
    pub fn transaction_timeout(&self) -> Duration {
        Duration::from_millis(
            self.options
                .get("transaction.timeout.ms")
                .and_then(|t| t.parse().ok())
                .unwrap_or(60_000),
        )
    }
}

/// How records become durable in Kafka, and so what the slot may confirm.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// Each record is acknowledged on its own; a crash re-sends what was in
    /// flight, so consumers deduplicate by the `id` header.
    #[default]
    AtLeastOnce,
    /// Whole PostgreSQL transactions go into Kafka transactions, with the
    /// progress record in the same transaction: a `read_committed`
    /// consumer sees each event once.
    ExactlyOnce,
}

/// `[kafka.exactly_once]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExactlyOnceConfig {
    /// The producers' `transactional.id` prefix: two producers, `<id>-0`
    /// and `<id>-1`, take turns. A new outboxd with the same id fences the
    /// old one. Default: `outboxd.<slot>`.
    #[serde(default)]
    pub transactional_id: Option<String>,
    /// The older spelling of `kafka.progress_topic`.
    #[serde(default)]
    pub progress_topic: Option<String>,
    /// A Kafka transaction is committed once it holds this many events
    /// (at the next PostgreSQL commit).
    #[serde(default = "default_txn_max_events")]
    pub max_events: usize,
    /// ... or this many bytes of keys, values and headers.
    #[serde(default = "default_txn_max_bytes")]
    pub max_bytes: usize,
    /// ... or when its first PostgreSQL transaction is this old.
    #[serde(default = "default_txn_max_wait")]
    pub max_wait: HumanDuration,
    /// How long a Kafka commit (or `init_transactions`) may take before
    /// the session gives up on it and replays from the progress record.
    #[serde(default = "default_txn_commit_timeout")]
    pub commit_timeout: HumanDuration,
}

impl Default for ExactlyOnceConfig {
    fn default() -> Self {
        ExactlyOnceConfig {
            transactional_id: None,
            progress_topic: None,
            max_events: default_txn_max_events(),
            max_bytes: default_txn_max_bytes(),
            max_wait: default_txn_max_wait(),
            commit_timeout: default_txn_commit_timeout(),
        }
    }
}

fn default_txn_max_events() -> usize {
    10_000
}

fn default_txn_max_bytes() -> usize {
    16 * 1024 * 1024
}

fn default_txn_max_wait() -> HumanDuration {
    HumanDuration(Duration::from_millis(10))
}

fn default_txn_commit_timeout() -> HumanDuration {
    secs(30)
}

fn default_partitions() -> i32 {
    3
}

fn default_replication_factor() -> i32 {
    -1
}

/// The in-flight bounds a session holds to, unless `kafka.max_inflight` or
/// `kafka.max_inflight_bytes` set them.
///
/// librdkafka sends one partition's batch per ProduceRequest, and a
/// partition has one request in flight at a time (its idempotence window
/// counts messages), so a batch holds what the partition gathered while
/// its previous request was out: a share of what the relay has in flight.
/// One budget for every partition made batches shrink as partitions grew
/// (5,000 records over 150 partitions: 37 records per stored batch, six
/// times the requests of one topic, and 0.4× its drain; BENCHMARKS.md,
/// "Many topics"). So the budget has a floor, for one topic, and grows by
/// a share per partition the session has written to, up to a ceiling that
/// bounds memory. The floor is what one topic drains fastest with:
/// records past what Kafka acknowledges per round trip only wait in
/// librdkafka's queue, where a ready batch whose partition may not send
/// makes its broker thread spin (BENCHMARKS.md, "Where the CPU went
/// against Apache Kafka"); 4 MiB is for large rows (10 KB rows drained as
/// fast as with 16 MiB at half the memory, BENCHMARKS.md, "Cost as work
/// grows").
pub mod budget {
    /// Records in flight with one topic.
    pub const FLOOR_RECORDS: usize = 5_000;
    /// Bytes in flight with one topic.
    pub const FLOOR_BYTES: usize = 4 << 20;
    /// Records per partition written to.
    pub const PER_PARTITION_RECORDS: usize = 120;
    /// Bytes per partition written to.
    pub const PER_PARTITION_BYTES: usize = 48 << 10;
    /// The most records in flight, with any number of partitions.
    pub const CEILING_RECORDS: usize = 20_000;
    /// The most bytes in flight, with any number of partitions.
    pub const CEILING_BYTES: usize = 16 << 20;
}

impl KafkaConfig {
    /// The most records and bytes a session keeps in flight while it
    /// writes to `partitions` partitions (see [`budget`]).
    pub fn inflight_budget(&self, partitions: usize) -> (usize, usize) {
        let grown =
            |floor: usize, each: usize, ceiling: usize| partitions.saturating_mul(each).clamp(floor, ceiling);
        (
            self.max_inflight.unwrap_or_else(|| {
                grown(
                    budget::FLOOR_RECORDS,
                    budget::PER_PARTITION_RECORDS,
                    budget::CEILING_RECORDS,
                )
            }),
            self.max_inflight_bytes.unwrap_or_else(|| {
                grown(
                    budget::FLOOR_BYTES,
                    budget::PER_PARTITION_BYTES,
                    budget::CEILING_BYTES,
                )
            }),
        )
    }

    /// The most records a session may keep in flight.
    pub fn max_inflight_ceiling(&self) -> usize {
        self.max_inflight.unwrap_or(budget::CEILING_RECORDS)
    }
}

fn default_admin_timeout() -> HumanDuration {
    secs(10)
}
